"""One stage of a sweep on Ray Tune: its searcher and scheduler, the trainable with the
stage's base config, the Tuner (new, or restored on `sweep.resume`), the fit, and the
trial records and reports it leaves. Also the two signals a stage is ended by: the
sweep's time cap and Ctrl+C."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import threading
from pathlib import Path

import ray
from ray import tune
from ray.tune.logger import JsonLoggerCallback

from sweeper.config.errors import ConfigError
from sweeper.config.sweep import StageSpec, flatten
from sweeper.sweep.algorithms import build_scheduler, build_searcher, random_start
from sweeper.sweep.callbacks import (
    IDLE_WORK,
    FlopCap,
    GridCosts,
    IdleSlot,
    MarksStopped,
    ProgressCallback,
)
from sweeper.sweep.cluster import TIME_CAP_STOP
from sweeper.sweep.feasibility import slots_for
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.ray_patches import BracketState, record_earlier_trials, replay_restored_rungs
from sweeper.sweep.results import collect_results
from sweeper.sweep.space import Space, grid_size, is_pure_grid
from sweeper.sweep.stages import fitted_micro_batches
from sweeper.sweep.state import SweepState
from sweeper.sweep.trainable import RUNG_METRIC, EarlierRun, TrialContext, run_trial
from sweeper.text import flops_text

# the largest grid whose trials are costed one by one (a run config each) for the ETA
MAX_COSTED_GRID = 1000


class StageCapped(Exception):
    """sweep.max_seconds ran out while a stage's Tune run trained: the records and reports
    of the trials that reported (those it stopped marked `capped`). The stage is kept as
    far as it went, and a resume with more time goes on with it."""

    def __init__(self, records: list[dict], reports: list[dict]):
        super().__init__("sweep.max_seconds ran out during a stage")
        self.records, self.reports = records, reports


@dataclasses.dataclass
class StageRun:
    """What one Tune run of a stage is made of: `stage` (an extension round's own, or the
    sweep's), the `base` config its trials start from and how many it launches."""

    plan: SweepPlan
    index: int
    stage: StageSpec
    base: dict
    out: Path
    planned: int
    space: Space
    ctx: TrialContext
    points: list
    suffix: str = ""  # an extension round's experiment name ends with it

    @property
    def name(self) -> str:
        return f"stage{self.index}_{self.stage.name}{self.suffix}"

    @property
    def grid(self) -> bool:
        return self.stage.search == "grid" or is_pure_grid(self.space)

    @property
    def rank_metric(self) -> str:
        """What the scheduler ranks: the cooled-down forks' value, where rungs fork trials."""
        return RUNG_METRIC if self.ctx.ranks_forks else self.plan.spec.metric


def run_stage(
    plan: SweepPlan,
    index: int,
    base: dict,
    out: Path,
    state: SweepState,
    remaining_trials: int | None,
    remaining_seconds: float | None,
    tracker,
    stage: StageSpec | None = None,
    suffix: str = "",
    spent_flops: float = 0.0,
    earlier_reports: list[dict] | None = None,
    reusable: EarlierRun | None = None,
) -> tuple[list[dict], list[dict]]:
    """Stage `index` on Ray Tune from `base`: its trial records and reports. An extension
    round (sweep/extend.py) passes its own `stage`, names its experiment with `suffix`,
    counts the first round's `spent_flops` against sweep.max_flops and has ASHA rank its
    trials against the first round's `earlier_reports` too. A trial that would train
    `reusable` again replays its reports."""
    run = prepare(plan, index, base, out, remaining_trials, stage, suffix)
    if run is None:
        return [], []
    tuner, earlier = make_tuner(run, state, tracker, spent_flops, earlier_reports, reusable)
    with interrupt_watch() as interrupted, time_cap(remaining_seconds) as capped:
        results = tuner.fit()
    if not capped() and interrupted():
        # Tune returns normally on Ctrl+C (after saving its state): this stage is not
        # finished and must not be frozen as if it were
        raise KeyboardInterrupt
    spec = plan.spec
    can_prune = run.stage.scheduler != "fifo" or bool(spec.max_seconds or spec.max_flops)
    records, reports = collect_results(
        results, run.stage.name, spec.metric, run.base, run.ctx, can_prune
    )
    if capped():
        cut_short(run, results, records, reports)
    return records, reports


def prepare(
    plan: SweepPlan,
    index: int,
    base: dict,
    out: Path,
    remaining_trials: int | None,
    stage: StageSpec | None,
    suffix: str,
) -> StageRun | None:
    """The stage's run, its trials cut to what sweep.max_trials leaves; None where a grid
    would have to be cut short (it cannot be, fairly)."""
    stage = stage or plan.stages[index]
    base = plan.stage_base(stage, base)
    space = plan.space(stage, flatten(base))
    planned = plan.planned_trials(stage, base)
    grid = stage.search == "grid" or is_pure_grid(space)
    per_sample = 1 if grid else grid_size(space)  # a random search's grid points per draw
    if remaining_trials is not None and planned > remaining_trials:
        if grid or remaining_trials < per_sample:
            print(
                f"[{stage.name}] skipped: its grid of {planned} trials exceeds the "
                f"{remaining_trials} left under sweep.max_trials"
            )
            return None
        planned = remaining_trials // per_sample * per_sample
    return StageRun(
        plan=plan,
        index=index,
        stage=stage,
        base=base,
        out=out,
        planned=planned,
        space=space,
        ctx=plan.trial_context(stage, base, storage=str(out / "ray")),
        points=plan.points(stage, flatten(base))[:planned],
        suffix=suffix,
    )


def make_tuner(run: StageRun, state, tracker, spent_flops, earlier_reports, reusable):
    """The stage's Tuner, restored where a resume finds its experiment; and how many of the
    first round's trials ASHA's rungs were given (an extension round)."""
    spec, stage = run.plan.spec, run.stage
    searcher, param_space = make_searcher(run)
    scheduler = make_scheduler(run)
    earlier = 0
    if earlier_reports and stage.scheduler == "asha":
        time_attr, _ = run.plan.time_axis(stage)
        earlier = record_earlier_trials(scheduler, earlier_reports, time_attr, run.rank_metric)
    # a DDP trial only launches its TorchTrainer, whose workers hold the CPUs/GPUs
    # (sweep.cpus_per_trial / gpus_per_trial are then per rank); Ray refuses an empty
    # request, and any CPU held here would be missing for the last rank: one byte of memory
    resources = (
        {"cpu": spec.cpus_per_trial, "gpu": spec.gpus_per_trial}
        if run.plan.workers == 1
        else {"cpu": 0, "memory": 1}
    )
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=run.base, ctx=run.ctx, earlier=reusable), resources
    )
    print_header(run, earlier)
    restored = restore(run, trainable, param_space)
    if restored is not None:
        return restored, earlier
    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            search_alg=searcher,
            scheduler=scheduler,
            num_samples=1 if run.grid else run.planned // grid_size(run.space),
            # no max_concurrent_trials: the searcher enforces sweep.concurrency itself, and
            # Tune, given both, only warns. No time_budget_s: sweep.max_seconds is time_cap's
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=run.name,
            storage_path=str(run.out / "ray"),
            verbose=0,
            callbacks=callbacks(run, scheduler, tracker),
            stop=FlopCap(spec.max_flops, state.total_flops() + spent_flops)
            if spec.max_flops
            else None,
            failure_config=tune.FailureConfig(max_failures=spec.max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
        ),
    )
    return tuner, earlier


def make_searcher(run: StageRun):
    spec = run.plan.spec
    return build_searcher(
        run.stage.search,
        run.space,
        metric=spec.metric,
        mode=spec.mode,
        seed=spec.seed + run.index,
        num_samples=run.planned,
        max_concurrent=spec.concurrency,
        bohb=dataclasses.asdict(spec.bohb),
        points=run.points,
        worst_on_divergence=spec.penalty is None,  # a penalty the user chose is told as is
    )


def make_scheduler(run: StageRun):
    spec = run.plan.spec
    time_attr, max_t = run.plan.time_axis(run.stage)
    return build_scheduler(
        run.stage.scheduler,
        # with rung forks, trials are ranked at the rungs by their cooled-down copies; the
        # searcher, the records and the plots keep the run's own val_bpb
        metric=run.rank_metric,
        mode=spec.mode,
        time_attr=time_attr,
        max_t=max_t,
        grace_period=max_t * spec.grace_fraction,
        reduction_factor=spec.reduction_factor,
        max_concurrent=spec.concurrency,
        brackets=spec.brackets,
    )


def callbacks(run: StageRun, scheduler, tracker) -> list:
    """The stage's Tune callbacks: progress lines, Tune's own result.json, MLflow, the
    baseline's idle slot, and HyperBand's brackets saved with Tune's state."""
    plan, stage = run.plan, run.stage
    clock = plan.time_axis(stage)
    costs = None
    if not plan.target and is_pure_grid(run.space) and run.planned <= MAX_COSTED_GRID:
        grid = {p.name: list(p.values) for p in run.space.params}
        with contextlib.suppress(ConfigError):  # a grid point no run takes fails as it starts
            costs = GridCosts(run.base, run.space.fixed, grid) if grid else None
    found = [
        *([MarksStopped(clock)] if plan.target else []),  # first: the others read it
        ProgressCallback(
            stage.name,
            run.planned,
            plan.spec.metric,
            plan.spec.mode,
            costs,
            clock=clock,
            scheduler=stage.scheduler,
        ),
        JsonLoggerCallback(),  # result.json: Tune's results read each trial's reports from it
        *tracker.stage_callbacks(stage.name, run.base, run.ctx, stage.search, stage.scheduler),
    ]
    if str(run.out) in IDLE_WORK:
        found.append(
            IdleSlot(
                str(run.out), stage.name, run.planned, cluster_slots(plan), plan.spec.concurrency
            )
        )
    if stage.scheduler in ("hyperband", "bohb"):
        found.append(BracketState(scheduler))
    return found


def cluster_slots(plan: SweepPlan) -> int:
    """Trials the cluster has resources for at once, whatever sweep.concurrency allows."""
    resources = ray.cluster_resources()
    return slots_for(plan, resources.get("CPU", 0), resources.get("GPU", 0), capped=False)


def print_header(run: StageRun, earlier: int) -> None:
    """The stage's first line: its search, scheduler, trials, budget and what it searches."""
    plan, stage = run.plan, run.stage
    time_attr, max_t = plan.time_axis(stage)
    stops = plan.rung_fractions(stage)
    levels = len(stops) + 1  # HyperBand's brackets: one per budget level
    hyperband = stage.scheduler in ("hyperband", "bohb")
    brackets = plan.spec.brackets
    notes = [
        f"{len(run.points)} given point{'s' * (len(run.points) > 1)} first" if run.points else None,
        f"rungs at {', '.join(f'{f:.0%}' for f in stops)} of it" if stops else None,
        f"each ranked on a copy cooled down over {plan.spec.rung_cooldown:.0%} of its steps"
        if run.ctx.ranks_forks
        else None,
        f"{min(brackets, levels)} of its {levels} brackets" if brackets and hyperband else None,
        random_start(stage.search, run.space, run.planned, given=len(run.points)),
        None if plan.target else fitted_micro_batches(run.space.params, run.base),
        f"ranked at the rungs against the first round's {earlier} trial{'s' * (earlier > 1)} too"
        if earlier
        else None,
    ]
    print(
        f"[{stage.name}] {stage.search} search, {stage.scheduler} scheduler, "
        f"{run.planned} trial{'s' * (run.planned != 1)} of "
        f"{budget_text(time_attr, max_t)}: {', '.join(run.space.names)}"
        + "".join(f"; {note}" for note in notes if note)
    )


def budget_text(time_attr: str, max_t: float) -> str:
    """A trial's budget on the stage's time axis, as the plan writes it: 160,000 tokens."""
    if time_attr == "tokens":
        return f"{max_t:,.0f} tokens"
    if time_attr == "flops":
        return f"{flops_text(max_t)} FLOPs"
    return f"{max_t:.0f} report{'s' * (max_t != 1)}"


def restore(run: StageRun, trainable, param_space):
    """The interrupted stage's Tuner, where a resume finds its experiment; else None."""
    stage = run.stage
    experiment = run.out / "ray" / run.name
    hyperband = stage.scheduler in ("hyperband", "bohb")
    if not (run.plan.spec.resume and tune.Tuner.can_restore(str(experiment))):
        return None
    if hyperband and not BracketState.saved(experiment):
        # Ray restores no scheduler's state (ray-project/ray#30838), and a HyperBand made anew
        # never fills its brackets with restored trials: without BracketState's save, start over
        print(
            f"[{stage.name}] the interrupted {stage.scheduler} stage starts over: it was "
            "stopped before Tune saved its brackets, so its trials so far are trained again"
        )
        shutil.rmtree(experiment)
        return None
    tuner = tune.Tuner.restore(
        str(experiment),
        trainable,
        resume_unfinished=True,
        resume_errored=True,
        param_space=param_space,
    )
    replayed = ""
    if hyperband:
        BracketState.link(tuner)
        replayed = "; its brackets as they were"
    if stage.scheduler == "asha":
        time_attr, _ = run.plan.time_axis(stage)
        count = replay_restored_rungs(tuner, time_attr, run.rank_metric)
        replayed = f"; ASHA's rungs hold the values of its {count} trials that reported"
    print(f"[{stage.name}] resuming the interrupted stage from {experiment}{replayed}")
    return tuner


def cut_short(run: StageRun, results, records: list[dict], reports: list[dict]) -> None:
    """After the time cap stopped the stage: keep the trials that reported, mark those it
    stopped, and raise StageCapped where any trial was left unfinished."""
    unfinished = {
        str(result.path)
        for result in results
        if result.error is None and not (result.metrics or {}).get("done")
    }
    if not unfinished and len(records) >= run.planned:
        return
    # a trial that never reported (not started yet) is not kept: the resume starts it.
    # (A user's function may report no tokens: its metric says it reported.)
    records = [
        r
        for r in records
        if r["path"] not in unfinished or r["tokens"] is not None or r["metric"] is not None
    ]
    for record in records:
        if record["path"] in unfinished:
            record["capped"] = True  # ranked as pruned until a resume trains it on
    cut = sum(bool(r.get("capped")) for r in records)
    stopped = (
        f": {cut} trial{'s' * (cut > 1)} stopped at {'their' if cut > 1 else 'its'} last "
        f"report (ranked as pruned until a resume trains {'them' if cut > 1 else 'it'} on)"
        if cut
        else ", before the trials it stopped had reported"
    )
    print(
        f"[{run.stage.name}] sweep.max_seconds={run.plan.spec.max_seconds:g} ran out during "
        f"this stage{stopped}",
        flush=True,
    )
    raise StageCapped(records, reports)


@contextlib.contextmanager
def time_cap(seconds: float | None):
    """Stops Tune's run after `seconds` as a Ctrl+C would, so its trials stay resumable (Tune's
    own time_budget_s ends them for good): Tune handles SIGUSR1 as SIGINT, so it is sent once
    Tune's handler is in place. Yields whether it fired; never without a cap, or off the main
    thread (no signals there)."""
    fired, done = threading.Event(), threading.Event()
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield fired.is_set
        return

    def before_tune(signum, frame):  # the default action of SIGUSR1 ends the process
        pass

    def watch():
        if not wait_for_time_cap(seconds, done):
            return
        while not done.is_set():
            if signal.getsignal(signal.SIGUSR1) is not before_tune:
                fired.set()
                TIME_CAP_STOP.set()
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            done.wait(0.05)

    previous = signal.signal(signal.SIGUSR1, before_tune)
    watcher = threading.Thread(target=watch, name="sweep-time-cap", daemon=True)
    watcher.start()
    try:
        yield fired.is_set
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGUSR1, previous)
        TIME_CAP_STOP.clear()


def wait_for_time_cap(seconds: float, done: threading.Event) -> bool:
    """Waits out the cap's `seconds`: True when they ran out, False when the stage ended
    first (`done`). A test swaps in a wait on what the trials have done."""
    return not done.wait(max(seconds, 0.0))


@contextlib.contextmanager
def interrupt_watch():
    """Tells whether Tune caught a Ctrl+C during the block. Tune swaps in its own SIGINT
    handler and puts the previous one back only when it is interrupted (ray/tune/tune.py,
    _setup_signal_catching), so finding our sentinel back in place means an interrupt."""

    def sentinel(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    previous = signal.signal(signal.SIGINT, sentinel)
    state = {"interrupted": False}
    try:
        yield lambda: state["interrupted"]
    finally:
        state["interrupted"] = signal.getsignal(signal.SIGINT) is sentinel
        signal.signal(signal.SIGINT, previous)
