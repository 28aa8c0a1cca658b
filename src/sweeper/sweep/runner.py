"""The staged sweep: `python -m sweeper +sweep=NAME`.

for each stage: space -> searcher + scheduler -> Tuner.fit() on Ray -> best trial ->
freeze its values into the base config of the next stage. A baseline run of the
unmodified config trains under the same budget in the first slot a stage leaves idle
(callbacks.IdleSlot). At the end:
summary, reports.csv, plots and the loss-vs-compute fit in the run dir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from sweeper.config.errors import ConfigError
from sweeper.config.schema import load_run_config
from sweeper.sweep.algorithms import metric_reader
from sweeper.sweep.plan import (
    base_config,
    resumable_state,
    slots_for,
    trainable_target,
    validate_sweep,
    with_reports,
)
from sweeper.sweep.spec import SweepSpec, flatten, stage_points, stage_space
from sweeper.sweep.stages import (
    fit_micro_batch,
    fitted_micro_batches,
    hydra_value,
    keeps_its_start,
    pick_best,
)
from sweeper.sweep.state import SweepState, spent_flops, sweep_definition
from sweeper.sweep.trainable import (
    RUNG_METRIC,
    EarlierRun,
    TrialContext,
    batch_of,
    trial_config,
)

# Ray's OOM kill of a worker, the CPU allocator's refusal, torch's CUDA OutOfMemoryError
OUT_OF_MEMORY_SIGNS = ("low on memory", "can't allocate memory", "OutOfMemoryError")
# a grid's trials are costed (load_run_config each, ~13 ms) for a compute-weighted ETA up to this
MAX_COSTED_GRID = 1000


class SweepFailed(Exception):
    """Every trial of a stage failed: the next stage would start from nothing it learned
    and fail the same way, so the sweep stops with the cause in one line."""

    def __init__(self, stage: str, error: str | None, out: Path):
        hint = ""
        if error and any(m in error for m in OUT_OF_MEMORY_SIGNS):
            hint = (
                "; give each trial more memory: fewer at once (sweep.concurrency=1) "
                "or a smaller trainer.device_batch_size"
            )
        super().__init__(
            f"every trial of stage '{stage}' failed: {error or 'unknown error'}{hint}; "
            f"earlier stages are kept: continue with sweep.resume=true hydra.run.dir={out}"
        )


class StageCapped(Exception):
    """sweep.max_seconds ran out while a stage's Tune run trained: the records and reports
    of the trials that reported (those it stopped marked `capped`). The stage is kept as
    far as it went, and a resume with more time goes on with it (reopen_capped_stage)."""

    def __init__(self, records: list[dict], reports: list[dict]):
        super().__init__("sweep.max_seconds ran out during a stage")
        self.records, self.reports = records, reports


def default_penalty(spec: SweepSpec, base: dict, target: str | None) -> float:
    """The value a diverged trial reports to the searcher in place of its NaN: worse than
    any trial that learned something, in the metric's own unit."""
    if spec.penalty is not None:
        return float(spec.penalty)
    worst = 1e9 if spec.mode == "min" else -1e9
    if target:
        return worst
    data = base["data"]
    if spec.metric == "val_bpb":  # a uniform guess over the vocabulary, in bits per byte
        return math.log2(data["vocab_size"]) / (data.get("bytes_per_token") or 1.0)
    if spec.metric == "train_loss":  # the same guess in nats per token
        return math.log(data["vocab_size"])
    # tokens_per_s: a diverged run trained nothing worth its speed
    return 0.0 if spec.mode == "max" else worst


def idle_gpus_hint(spec: SweepSpec, base: dict, target: str | None, gpus: float) -> str | None:
    """A line for a cluster with GPUs whose trials were given none: they train on CPU."""
    trainer = base["trainer"]
    on_cpu = trainer["device"] == "auto" and trainer["workers"] == 1 and not spec.gpus_per_trial
    if target or not gpus or not on_cpu:
        return None
    return (
        f"trials train on CPU (sweep.gpus_per_trial=0) beside {gpus:g} GPUs: "
        "sweep.gpus_per_trial=1 (or 0.5, two trials per GPU) trains them there"
    )


def time_axis(spec: SweepSpec, stage, target: str | None) -> tuple[str, float]:
    """ASHA/Hyperband's clock in `stage`: tokens or FLOPs (compute-denominated, so batch
    sizes compare fairly), or report count for a user's function without a compute budget."""
    if spec.budget.tokens_per_trial:
        return "tokens", float(spec.budget.tokens_per_trial)
    if spec.budget.flops_per_trial:
        return "flops", float(spec.budget.flops_per_trial)
    return "training_iteration", float(spec.stage_reports(stage))


def budget_text(time_attr: str, max_t: float) -> str:
    """A trial's budget on the stage's time axis, as the plan writes it: 160,000 tokens."""
    if time_attr == "tokens":
        return f"{max_t:,.0f} tokens"
    if time_attr == "flops":
        from sweeper.report.markdown import flops_text

        return f"{flops_text(max_t)} FLOPs"
    return f"{max_t:.0f} report{'s' * (max_t != 1)}"


def run_sweep(cfg, out_dir: str) -> float | None:
    from sweeper.report import summary as outputs
    from sweeper.sweep.cluster import start_ray
    from sweeper.sweep.confirm import run_confirmation

    spec = validate_sweep(cfg)
    target = trainable_target(cfg)
    out = Path(out_dir).resolve()
    base = base_config(cfg, spec, target)
    if not target:
        load_run_config(fit_micro_batch(base))  # the budget written in must still make a run
    # before MLflow and Ray: a state of another sweep is refused with nothing written
    state = resumable_state(out, spec, base) if spec.resume else None
    if spec.resume and state is None:
        print(f"sweep.resume=true but no sweep state in {out}: starting a new sweep")
    from sweeper.tracking import make_tracker, start_tracker

    done = state is not None and finished(spec, state, base)
    if not done:
        from sweeper.sweep.estimate import opening_line

        print(opening_line(spec, base, target, state), flush=True)
    if done:
        tracker = make_tracker(cfg, spec, out)
        # nothing left to train: the outputs are written again without starting Ray (~20 s)
        print("sweep.resume=true: every stage of this sweep finished earlier; writing its outputs")
    else:
        tracker_ready = start_tracker(cfg, spec, out)  # MLflow's start beside Ray's
        try:
            start_ray(cfg.ray)
        finally:
            # a tracker's error is the one to report, as when it was made before Ray; it
            # is also never left half made when Ray fails to start
            tracker = tracker_ready()
        import ray

        if hint := idle_gpus_hint(spec, base, target, ray.cluster_resources().get("GPU", 0)):
            print(hint)
    if state is None:
        from sweeper.report.markdown import command_overrides

        state = SweepState.new(
            out, spec.name, base, sweep_definition(spec), launched=command_overrides(out)
        )

    started = time.time() - state.elapsed
    baseline = None
    if spec.baseline and state.baseline is None:
        # evaluated once, at the end: only its last value is read, and a run's training does
        # not depend on how often it evaluates (trainable.same_training)
        baseline = outputs.Baseline(with_reports(base, 1, target), spec, target)

    reaper = contextlib.nullcontext()
    if not target and int(base["trainer"]["workers"]) > 1:
        from sweeper.train.distributed import placement_group_reaper

        reaper = placement_group_reaper()
    if baseline is not None:  # started in the first slot a stage leaves idle (IdleSlot)
        from sweeper.sweep.callbacks import IDLE_WORK

        IDLE_WORK[str(out)] = baseline.launch
    try:
        with reaper:
            run_stages(spec, base, target, out, state, started, tracker)
        if baseline is not None:
            left = spec.max_seconds - (time.time() - started) if spec.max_seconds else None
            result = baseline.collect(timeout=left)
            if result is None:
                print(
                    f"baseline: sweep.max_seconds={spec.max_seconds:g} ran out before it "
                    "finished: this sweep has none (a resume with more time trains it)"
                )
            else:
                state.set_baseline(result)
                tracker.log_baseline(state.baseline, baseline.base)
        run_confirmation(spec, state, base, target)
    except BaseException as error:
        # Ctrl+C or a crash: close the tracker's runs honestly, keep the state on disk
        if isinstance(error, KeyboardInterrupt):
            # the time the interrupted stage trained counts, as its trials go on from it
            state.elapsed = time.time() - started
            state.save()
            print(
                f"sweep interrupted: finished stages and trials are saved in {out}; "
                "continue it with the same command plus sweep.resume=true "
                f"hydra.run.dir={out}"
            )
        tracker.finish(
            {}, out, status="KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        )
        raise
    finally:
        if baseline is not None:
            IDLE_WORK.pop(str(out), None)
    from omegaconf import OmegaConf

    fit_cfg = OmegaConf.to_container(cfg.fit, resolve=True) if "fit" in cfg else {}
    summary = outputs.write_all(out, spec, state, base, fit_cfg, target)
    tracker.finish(summary, out)
    records = state.all_records()
    if records and all(r["status"] in ("diverged", "failed") for r in records):
        raise NothingToRank(state, out)
    return summary["best"]["value"] if summary.get("best") else None


def reported_instead(records: list[dict]) -> list[str] | None:
    """What the stage's trials reported where not one of them reported the metric (a
    user's function with its own name for it), else None."""
    ran = [r for r in records if r["status"] != "failed" or "reported" in r]
    if not ran or any("reported" not in r for r in ran):
        return None
    return sorted({key for r in ran for key in r["reported"]})


class MetricNotReported(SweepFailed):
    """No trial of a stage reported the sweep's metric: every later stage would rank
    nothing the same way, so the sweep stops at once with what the trials did report."""

    def __init__(
        self,
        stage: str,
        metric: str,
        reported: list[str],
        target: str | None,
        read_by: str | None = None,
    ):
        where = target or "the trainable"
        every = f" in every report, which {read_by} ranks" if read_by else ""
        Exception.__init__(
            self,
            f"no trial of stage '{stage}' reported {metric} (sweep.metric){every}; their "
            f"reports held {', '.join(reported) or 'no values'}: report {metric} from "
            f"{where}{' each time' if read_by else ''}, or rank by one of these with "
            "sweep.metric=NAME",
        )


class NothingToRank(SweepFailed):
    """Every trial of every stage diverged or failed. The sweep's outputs are written (the
    learning curves show where each one went wrong), but it has no best config to give,
    so the command fails. (Trials a sweep's own cap cut short before they reported leave
    no best either, but that is the cap the user chose: no failure.)"""

    def __init__(self, state: SweepState, out: Path):
        from sweeper.report.summary import counts_text, status_tally

        counts = counts_text(status_tally(state.all_records()))
        Exception.__init__(
            self,
            f"no trial of the sweep has a value to rank ({counts}), so it has no best "
            f"config: for diverged trials lower the LR ranges; each trial's reports are in "
            f"{out}/reports.csv",
        )


def finished(spec: SweepSpec, state: SweepState, base: dict) -> bool:
    """Whether a resumed sweep has nothing left to train: every stage, the baseline and the
    confirmation runs are in its state. (A stage a cap skipped is not: raising the cap and
    resuming runs it.)"""
    from sweeper.sweep.confirm import missing_runs

    return (
        all(state.stage_done(stage.name) for stage in spec.stages)
        and not reopens_capped_stage(spec, state)
        and (state.baseline is not None or not spec.baseline)
        and not missing_runs(spec, state, base)
    )


def planned_trials(spec: SweepSpec, stage, base: dict) -> int:
    """Trials a stage launches: every point of a grid, else its num_samples draws, each of
    them at every point of the grid params a random search holds beside sampled ones (Tune
    runs the grid once per sample; an lr_rule=retune stage over a grid of batch sizes)."""
    from sweeper.sweep.space import grid_size, is_pure_grid

    space = stage_space(spec, stage, flatten(base))
    grid = spec.stage_search(stage) == "grid" or is_pure_grid(space)
    return grid_size(space) if grid else stage.num_samples * grid_size(space)


def cluster_slots(spec: SweepSpec, workers: int) -> int:
    """Trials the cluster has resources for at once (`preflight.slots_for` on its
    resources, whatever sweep.concurrency lets a stage start)."""
    import ray

    resources = ray.cluster_resources()
    uncapped = dataclasses.replace(spec, concurrency=None)
    return slots_for(uncapped, workers, resources.get("CPU", 0), resources.get("GPU", 0))


def run_stages(
    spec: SweepSpec,
    base: dict,
    target,
    out: Path,
    state,
    started: float,
    tracker,
):
    """The stages in order, each starting from the best config of the ones before."""
    from sweeper.report import summary as outputs

    reopen_capped_stage(spec, state)
    current = state.base_after_finished_stages() or base
    for index, stage in enumerate(spec.stages):
        if state.stage_done(stage.name):
            print(f"[{stage.name}] finished in an earlier run: skipped")
            continue
        remaining_trials = None
        if spec.max_trials is not None:
            remaining_trials = spec.max_trials - state.trial_count()
        remaining_seconds = None
        if spec.max_seconds is not None:
            remaining_seconds = spec.max_seconds - (time.time() - started)
        reached = None
        if remaining_trials is not None and remaining_trials <= 0:
            reached = f"sweep.max_trials={spec.max_trials}"
        elif remaining_seconds is not None and remaining_seconds <= 0:
            reached = f"sweep.max_seconds={spec.max_seconds:g}"
        if reached:
            print(
                f"[{stage.name}] skipped, and the stages after it: {reached} is reached. To go "
                f"on, raise it and add sweep.resume=true hydra.run.dir={out}"
            )
            break
        capped = False
        try:
            records, reports = run_stage(
                spec,
                index,
                current,
                target,
                out,
                state,
                remaining_trials,
                remaining_seconds,
                tracker,
                reusable=reusable_run(spec, stage, state, current, target),
            )
        except StageCapped as cut:
            records, reports, capped = cut.records, cut.reports, True
        if capped and not records:  # a resume restores the stage's Tune run
            state.elapsed = time.time() - started
            state.save()
            print(time_cap_reached(stage.name, out))
            break
        if not records:
            break
        best = pick_best(records, spec.metric, spec.mode)
        if best is None and (instead := reported_instead(records)) is not None:
            every_report = any(r["status"] == "failed" for r in records if r.get("reported"))
            reader = metric_reader(spec.stage_search(stage), spec.stage_scheduler(stage))
            raise MetricNotReported(
                stage.name, spec.metric, instead, target, reader if every_report else None
            )
        if all(r["status"] == "failed" for r in records):
            raise SweepFailed(stage.name, records[0]["error"], out)
        edges = outputs.range_edges(spec, stage.name, current, best, None, not target)
        extended = {}
        if stage.extend_trials and edges and not capped:
            try:
                records, reports, extended = extend(
                    spec,
                    index,
                    current,
                    records,
                    reports,
                    best,
                    edges,
                    target,
                    out,
                    state,
                    started,
                    tracker,
                )
            except StageCapped as cut:
                records, reports, capped = cut.records, cut.reports, True
            best = pick_best(records, spec.metric, spec.mode)
            edges = outputs.range_edges(spec, stage.name, current, best, extended, not target)
        flop_capped = spec.max_flops is not None and (
            state.total_flops() + spent_flops(records) >= spec.max_flops
        )
        if (capped or flop_capped) and best is not None and best["status"] != "completed":
            best = None  # a value at fewer tokens than the budget: not one to freeze
        incumbent, start = state.carried(), current
        keeps_start = keeps_its_start(incumbent, best, spec.mode)
        if best is not None and not keeps_start:
            current = frozen_config(spec, stage, best, current, target)
        carried = best if best is not None and not keeps_start else incumbent
        state.finish_stage(
            stage.name,
            records,
            reports,
            best,
            current,
            time.time() - started,
            extended,
            carried,
            capped,
        )
        outputs.print_stage_table(stage.name, records, best, spec, edges)
        if keeps_start:
            print(f"[{stage.name}] {outputs.kept_note(spec, incumbent, best, start)}\n")
        elif best is None and (capped or flop_capped):
            print(
                f"[{stage.name}] no trial trained its whole budget before the "
                f"{'time' if capped else 'FLOP'} cap: nothing frozen\n"
            )
        elif best is None:
            print(
                f"[{stage.name}] no trial has a value to rank "
                f"({outputs.counts_text(outputs.status_tally(records))}): "
                "nothing frozen, the next stage starts from the same config\n"
            )
        if state.total_flops() >= (spec.max_flops or math.inf):
            print("the sweep's FLOP cap is reached: no further stages")
            break
        if capped:
            print(time_cap_reached(stage.name, out))
            break


def time_cap_reached(stage: str, out: Path) -> str:
    return (
        f"the sweep's time cap is reached: no further stages. A resume goes on with stage "
        f"'{stage}' (its stopped trials from their last report, then those it has yet to "
        f"start): raise sweep.max_seconds and add sweep.resume=true hydra.run.dir={out}"
    )


def reopens_capped_stage(spec: SweepSpec, state: SweepState) -> bool:
    """Whether the sweep's last stage is one the time cap ran out in, and this run has
    more time for it (a higher sweep.max_seconds, or none)."""
    last = state.stages[-1] if state.stages else None
    if last is None or not last.get("capped"):
        return False
    return spec.max_seconds is None or state.elapsed < spec.max_seconds


def reopen_capped_stage(spec: SweepSpec, state: SweepState) -> None:
    """A resume given more time reopens the stage the cap ran out in: its Tune run goes on
    from where the cap stopped it (run_stage's restore), the stopped trials from their
    last checkpoints."""
    if not reopens_capped_stage(spec, state):
        return
    last = state.stages[-1]
    state.reopen_last_stage()
    cut = sum(bool(r.get("capped")) for r in last["records"])
    stopped = {0: "", 1: ", and the trial it stopped trains on"}.get(
        cut, f", and the {cut} trials it stopped train on"
    )
    print(f"[{last['name']}] the time cap ran out during this stage: it goes on{stopped}")


def extend(
    spec: SweepSpec,
    index: int,
    start: dict,
    records: list[dict],
    reports: list[dict],
    best: dict,
    edges: list[dict],
    target: str | None,
    out: Path,
    state: SweepState,
    started: float,
    tracker,
) -> tuple[list[dict], list[dict], dict[str, list[float]]]:
    """The stage's round past the ends where its best sat (sweep/extend.py): both rounds'
    records and reports, and what it searched ({param: [low, high]} of a range, the new
    values of a list; empty when no round ran)."""
    from sweeper.sweep import extend as extension

    stage = spec.stages[index]
    after = trial_config(best["params"], start, stage_context(spec, stage, start, target))
    round_two, spent = extension.plan_round(
        spec, stage, start, after, edges, records, state, started, own_trainable=target is None
    )
    if round_two is None:
        return records, reports, {}
    remaining_seconds = None
    if spec.max_seconds is not None:
        remaining_seconds = spec.max_seconds - (time.time() - started)
    try:
        extra_records, extra_reports = run_stage(
            spec,
            index,
            after,
            target,
            out,
            state,
            planned_trials(spec, round_two, after),
            remaining_seconds,
            tracker,
            stage=round_two,
            experiment_suffix=extension.EXPERIMENT_SUFFIX,
            spent_flops=spent,
            earlier_reports=reports,
        )
    except StageCapped as cut:  # the stage as far as both rounds went
        merged = extension.merge_round(records, best, cut.records)
        raise StageCapped(merged, reports + cut.reports) from None
    return (
        extension.merge_round(records, best, extra_records),
        reports + extra_reports,
        extension.extended_ranges(round_two),
    )


def frozen_config(spec: SweepSpec, stage, best: dict, start: dict, target: str | None) -> dict:
    """The config `best` trained, rebuilt from the stage's start: a trial of the round past
    the ends trained from the first round's best (`extend`), and is rebuilt from it
    the same way, so the reproduce line and the next stages get the same LRs to the bit."""
    if "extended_from" in best:
        start = trial_config(
            best["extended_from"], start, stage_context(spec, stage, start, target)
        )
        return trial_config(best["round_params"], start, stage_context(spec, stage, start, target))
    return trial_config(best["params"], start, stage_context(spec, stage, start, target))


def reusable_run(spec: SweepSpec, stage, state: SweepState, start: dict, target):
    """The finished run a trial of `stage` may replay instead of training it again: the
    incumbent, the earlier stage's best that `start` (the config the stage starts from) was
    frozen from. A grid holding the frozen value (lr_bs: batch 8192 after an LR stage at
    8192) would train that run again, to the same bits (trainable.same_training): a slot
    for a whole trial. Only in a fifo stage (no rungs to rank it at), only for sweeper's
    own training (a user's function need not be deterministic), and only for a run that
    trained its whole budget on one seed."""
    incumbent = state.carried()
    if (
        target
        or spec.stage_scheduler(stage) != "fifo"
        or incumbent is None
        or incumbent.get("status") != "completed"
        or "seeds" in incumbent  # a mean over seeds, not one run
    ):
        return None
    own = next(s for s in state.stages if s["name"] == incumbent["stage"])
    reports = [r for r in own["reports"] if r["trial_id"] == incumbent["trial_id"]]
    if not reports or not reports[-1].get("final") or reports[-1]["status"] != "completed":
        return None
    source = incumbent.get("reused_from") or f"{incumbent['stage']}/{incumbent['trial_id']}"
    return EarlierRun(config=start, source=source, reports=tuple(reports))


def stage_context(
    spec: SweepSpec, stage, base: dict, target: str | None, storage: str | None = None
) -> TrialContext:
    space = stage_space(spec, stage, flatten(base))
    scheduler = spec.stage_scheduler(stage)
    pausing = pauses_trials(spec, scheduler)
    return TrialContext(
        metric=spec.metric,
        penalty=default_penalty(spec, base, target),
        target=target,
        lr_rule=stage.lr_rule,
        base_batch=batch_of(base),
        lr_keys=tuple(spec.lr_keys),
        # paused (Hyperband/BOHB) and retried trials resume from their last report
        checkpoint=pausing or spec.max_failures > 0,
        threads=spec.trial_threads,
        gpus=spec.gpus_per_trial,
        sampled=tuple(space.names),
        storage=storage,
        # trials evaluate at the rungs (a user's function reports where it likes)
        rungs=() if target else rung_fractions(spec, stage, target),
        rung_cooldown=spec.rung_cooldown,
        metric_read_by=metric_reader(spec.stage_search(stage), scheduler),
    )


def pauses_trials(spec: SweepSpec, scheduler: str) -> bool:
    """Whether the stage's scheduler pauses trials at its rungs (they then checkpoint)."""
    return scheduler in ("hyperband", "bohb")


def rung_fractions(spec: SweepSpec, stage, target: str | None) -> tuple[float, ...]:
    """Where the stage's scheduler ranks trials, as fractions of a trial's budget."""
    from sweeper.sweep.rungs import rungs

    _, max_t = time_axis(spec, stage, target)
    scheduler = spec.stage_scheduler(stage)
    stops = rungs(scheduler, max_t, max_t * spec.grace_fraction, spec.reduction_factor)
    return tuple(stop / max_t for stop in stops)


def run_stage(
    spec: SweepSpec,
    index: int,
    base: dict,
    target: str | None,
    out: Path,
    state: SweepState,
    remaining_trials: int | None,
    remaining_seconds: float | None,
    tracker,
    stage=None,
    experiment_suffix: str = "",
    spent_flops: float = 0.0,
    earlier_reports: list[dict] | None = None,
    reusable: EarlierRun | None = None,
) -> tuple[list[dict], list[dict]]:
    """Stage `index` on Ray Tune from `base`: its trial records and reports. `stage` stands
    in for spec.stages[index] in an extension round (sweep/extend.py), which also names its
    own Tune experiment, counts the first round's `spent_flops` against sweep.max_flops, and
    has ASHA rank its trials against the first round's `earlier_reports` too. A trial
    that would train `reusable` again replays its reports (reusable_run)."""
    from ray import tune
    from ray.tune.logger import JsonLoggerCallback

    from sweeper.sweep.algorithms import build_scheduler, build_searcher, random_start
    from sweeper.sweep.callbacks import (
        IDLE_WORK,
        FlopCap,
        GridCosts,
        IdleSlot,
        MarksStopped,
        ProgressCallback,
    )
    from sweeper.sweep.ray_patches import BracketState
    from sweeper.sweep.results import collect_results
    from sweeper.sweep.space import grid_size, is_pure_grid
    from sweeper.sweep.trainable import run_trial

    stage = stage or spec.stages[index]
    base = with_reports(base, spec.stage_reports(stage), target)
    space = stage_space(spec, stage, flatten(base))
    search, scheduler_name = spec.stage_search(stage), spec.stage_scheduler(stage)
    grid = search == "grid" or is_pure_grid(space)
    planned = planned_trials(spec, stage, base)
    per_sample = 1 if grid else grid_size(space)  # a random search's grid points per draw
    if remaining_trials is not None and planned > remaining_trials:
        if grid or remaining_trials < per_sample:  # a grid cannot be cut short fairly
            print(
                f"[{stage.name}] skipped: its grid of {planned} trials exceeds the "
                f"{remaining_trials} left under sweep.max_trials"
            )
            return [], []
        planned = remaining_trials // per_sample * per_sample
    ctx = stage_context(spec, stage, base, target, storage=str(out / "ray"))
    points = stage_points(spec, stage, flatten(base))[:planned]
    time_attr, max_t = time_axis(spec, stage, target)
    searcher, param_space = build_searcher(
        search,
        space,
        metric=spec.metric,
        mode=spec.mode,
        seed=spec.seed + index,
        num_samples=planned,
        max_concurrent=spec.concurrency,
        bohb=dataclasses.asdict(spec.bohb),
        points=points,
        worst_on_divergence=spec.penalty is None,  # a penalty the user chose is told as is
    )
    scheduler = build_scheduler(
        scheduler_name,
        # with rung forks, trials are ranked at the rungs by their cooled-down copies; the
        # searcher, the records and the plots keep the run's own val_bpb
        metric=RUNG_METRIC if ctx.ranks_forks else spec.metric,
        mode=spec.mode,
        time_attr=time_attr,
        max_t=max_t,
        grace_period=max_t * spec.grace_fraction,
        reduction_factor=spec.reduction_factor,
        max_concurrent=spec.concurrency,
        brackets=spec.brackets,
    )
    hyperband = scheduler_name in ("hyperband", "bohb")  # brackets, and paused trials
    earlier = 0
    if earlier_reports and scheduler_name == "asha":
        from sweeper.sweep.ray_patches import record_earlier_trials

        earlier = record_earlier_trials(
            scheduler, earlier_reports, time_attr, RUNG_METRIC if ctx.ranks_forks else spec.metric
        )
    workers = 1 if target else int(base["trainer"]["workers"])
    # a DDP trial only launches its TorchTrainer, whose workers hold the CPUs/GPUs
    # (sweep.cpus_per_trial / gpus_per_trial are then per rank); Ray refuses an empty
    # request, and any CPU held here would be missing for the last rank: one byte of memory
    resources = (
        {"cpu": spec.cpus_per_trial, "gpu": spec.gpus_per_trial}
        if workers == 1
        else {"cpu": 0, "memory": 1}
    )
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=base, ctx=ctx, earlier=reusable), resources
    )
    costs = None
    if not target and is_pure_grid(space) and planned <= MAX_COSTED_GRID:
        fixed, grid = space.fixed, {p.name: list(p.values) for p in space.params}
        with contextlib.suppress(ConfigError):  # a grid point no run takes fails as it starts
            costs = GridCosts(base, fixed, grid) if grid else None
    progress = ProgressCallback(
        stage.name,
        planned,
        spec.metric,
        spec.mode,
        costs,
        clock=(time_attr, max_t),
        scheduler=scheduler_name,
    )
    run_config = tune.RunConfig(
        name=f"stage{index}_{stage.name}{experiment_suffix}",
        storage_path=str(out / "ray"),
        verbose=0,
        callbacks=[
            *([MarksStopped((time_attr, max_t))] if target else []),  # first: the others read it
            progress,
            JsonLoggerCallback(),  # result.json: Tune's results read each trial's reports from it
            *tracker.stage_callbacks(stage.name, base, ctx, search, scheduler_name),
            *(
                [
                    IdleSlot(
                        str(out),
                        stage.name,
                        planned,
                        cluster_slots(spec, workers),
                        spec.concurrency,
                    )
                ]
                if str(out) in IDLE_WORK
                else []
            ),
            # HyperBand's brackets, saved with Tune's state so that a resume restores them
            *([BracketState(scheduler)] if hyperband else []),
        ],
        stop=FlopCap(spec.max_flops, state.total_flops() + spent_flops) if spec.max_flops else None,
        failure_config=tune.FailureConfig(max_failures=spec.max_failures),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
    )
    experiment = out / "ray" / run_config.name
    stops = rung_fractions(spec, stage, target)
    levels = len(stops) + 1  # HyperBand's brackets: one per budget level
    notes = [
        f"{len(points)} given point{'s' * (len(points) > 1)} first" if points else None,
        f"rungs at {', '.join(f'{f:.0%}' for f in stops)} of it" if stops else None,
        f"each ranked on a copy cooled down over {spec.rung_cooldown:.0%} of its steps"
        if ctx.ranks_forks
        else None,
        f"{min(spec.brackets, levels)} of its {levels} brackets"
        if spec.brackets and hyperband
        else None,
        random_start(search, space, planned, given=len(points)),
        None if target else fitted_micro_batches(space.params, base),
        f"ranked at the rungs against the first round's {earlier} trial{'s' * (earlier > 1)} too"
        if earlier
        else None,
    ]
    print(
        f"[{stage.name}] {search} search, {scheduler_name} scheduler, "
        f"{planned} trial{'s' * (planned != 1)} of "
        f"{budget_text(time_attr, max_t)}: {', '.join(space.names)}"
        + "".join(f"; {note}" for note in notes if note)
    )
    restorable = spec.resume and tune.Tuner.can_restore(str(experiment))
    if restorable and hyperband and not BracketState.saved(experiment):
        # Ray restores no scheduler's state (ray-project/ray#30838); BracketState saves the
        # brackets with Tune's experiment checkpoints. A stage cut before its first one has
        # none: a HyperBand as it was made never fills its brackets for the restored trials
        # (measured: the resumed stage hung at "1 paused"), so that stage starts over.
        print(
            f"[{stage.name}] the interrupted {scheduler_name} stage starts over: it was "
            "stopped before Tune saved its brackets, so its trials so far are trained again"
        )
        shutil.rmtree(experiment)
        restorable = False
    if restorable:
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
        if scheduler_name == "asha":
            from sweeper.sweep.ray_patches import replay_restored_rungs

            count = replay_restored_rungs(
                tuner, time_attr, RUNG_METRIC if ctx.ranks_forks else spec.metric
            )
            replayed = f"; ASHA's rungs hold the values of its {count} trials that reported"
        print(f"[{stage.name}] resuming the interrupted stage from {experiment}{replayed}")
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=param_space,
            tune_config=tune.TuneConfig(
                search_alg=searcher,
                scheduler=scheduler,
                num_samples=1 if grid else planned // per_sample,
                # no max_concurrent_trials: the searcher built above enforces
                # sweep.concurrency itself, and Tune, given both, only warns that it ignores it.
                # No time_budget_s either: sweep.max_seconds is time_cap's, below
                reuse_actors=True,
            ),
            run_config=run_config,
        )
    with interrupt_watch() as interrupted, time_cap(remaining_seconds) as capped:
        results = tuner.fit()
    if not capped() and interrupted():
        # Tune returns normally on Ctrl+C (after saving its state): this stage is not
        # finished and must not be frozen as if it were
        raise KeyboardInterrupt
    can_prune = scheduler_name != "fifo" or bool(spec.max_seconds or spec.max_flops)
    records, reports = collect_results(results, stage.name, spec.metric, base, ctx, can_prune)
    unfinished = {
        str(result.path)
        for result in results
        if result.error is None and not (result.metrics or {}).get("done")
    }
    if capped() and (unfinished or len(records) < planned):
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
            "report (ranked as pruned until a resume trains "
            f"{'them' if cut > 1 else 'it'} on)"
            if cut
            else ", before the trials it stopped had reported"
        )
        print(
            f"[{stage.name}] sweep.max_seconds={spec.max_seconds:g} ran out during this "
            f"stage{stopped}",
            flush=True,
        )
        raise StageCapped(records, reports)
    return records, reports


@contextlib.contextmanager
def time_cap(seconds: float | None):
    """Stops Tune's run after `seconds` as a Ctrl+C would: Tune keeps the trials still
    training resumable (their checkpoints, the searcher's state), where its own
    time_budget_s ends them for good. The stop is Tune's SIGUSR1, which it handles as it
    does SIGINT, sent once Tune's handler is in place; yields whether it fired. Without
    a cap, or off the main thread (no signals there), it never fires."""
    from sweeper.sweep.cluster import TIME_CAP_STOP

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
    """Waits out the cap's `seconds` on time_cap's watcher thread: True when they ran out,
    False when the stage ended first (`done`). A test swaps in a wait on what the trials
    have done, where seconds would depend on the machine's speed."""
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


def reproduce_overrides(final: dict) -> list[str]:
    """Hydra overrides that turn `python -m sweeper`'s default run into `final`: both sides
    resolved through the schema, so derived values (vocab size) do not show up as changes."""
    from sweeper.config.schema import RunConfig

    before = flatten(RunConfig().to_dict())
    after = flatten(load_run_config(final).to_dict())
    return [f"{k}={hydra_value(after[k])}" for k in sorted(after) if before.get(k) != after[k]]
