"""`sweep.dry_run=true`: what a sweep would run, printed before anything starts.

A sweep's cost is the product of settings spread over files and overrides; this computes it
from the plan, with nothing started or written: per stage its trials, what they search and
their FLOPs, then the sweep's at-most totals, and minutes from a few training steps timed
here where the trials train on this machine's CPUs. Later stages start from earlier stages'
best, which only the sweep can know: they are estimated from the base config.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path

from sweeper.config.schema import load_run_config
from sweeper.config.sweep import SweepSpec, flatten
from sweeper.sweep.confirm import missing_runs
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.space import bounding_values, is_pure_grid
from sweeper.sweep.stages import apply_params, sweep_run
from sweeper.sweep.state import SweepState
from sweeper.text import duration_text, flops_text, hydra_value
from sweeper.train.budget import model_counts, planned_flops, resolve_total_steps

# value combinations of a stage whose FLOPs are computed one by one; past this, each
# param's values are taken alone (the extremes then bound the trial's FLOPs all the same
# whenever FLOPs grow or shrink with each value, as depth, width, batch and budget do)
MAX_COMBINATIONS = 512


@dataclass(frozen=True)
class TrialCost:
    """What one trial trains and evaluates."""

    flops: float  # training FLOPs to its budget
    flops_per_token: int
    eval_tokens: int  # validation tokens of all its evaluations


@dataclass
class StageEstimate:
    name: str
    search: str
    scheduler: str
    trials: int
    searched: list[str]  # "key kind [values]" per param
    trial_flops: tuple[float, float] | None  # (least, most) FLOPs of one trial
    # every trial, each to its end (a pure grid's own points, else all at the dearest)
    costs: list[TrialCost] | None
    fork_factor: float  # training FLOPs with every fork at every rung, over without
    rungs: tuple[float, ...]  # where the scheduler may stop a trial, as budget fractions
    extend_trials: int
    lr_rule: str
    finished: bool = False
    points: tuple[str, ...] = ()  # the configurations it tries first, as the file gives them

    @property
    def most_flops(self) -> float | None:
        """Every trial to its end, and every fork at every rung."""
        if self.costs is None:
            return None
        return sum(cost.flops for cost in self.costs) * self.fork_factor


@dataclass(frozen=True)
class Speed:
    """One trial's speed on this machine, measured on the base config's model."""

    train_flops_per_s: float
    eval_flops_per_s: float  # forward FLOPs (a third of a training token's) a second
    setup_s: float  # data and model, which every trial sets up
    threads: int

    def trial_seconds(self, cost: TrialCost, fork_factor: float) -> float:
        train = cost.flops * fork_factor / self.train_flops_per_s
        evaluate = cost.eval_tokens * cost.flops_per_token / 3 / self.eval_flops_per_s
        return self.setup_s + train + evaluate


# the measurement: training steps and evaluation batches timed after an untimed first
# (warm-up); skipped for a model whose few steps would take a CPU tens of seconds
PROBE_STEPS = 3
PROBE_EVAL_BATCHES = 4
PROBE_MAX_FLOPS = 2e12


def measure_speed(base: dict, threads: int) -> Speed | None:
    """Times a few training steps (the real training loop, `train`) and evaluation batches
    of the base config's model here, on a trial's threads; None where the model is too
    big to time in seconds. Why measure: FLOPs alone say nothing of minutes, and a CPU's
    speed differs 2x between machines with and without bf16 units. A stage's other model
    sizes are taken at the same FLOP rate (a smaller model runs a little below it)."""
    from sweeper.sweep.trainable import placed
    from sweeper.train.cpu_fast import ops_for
    from sweeper.train.data import load_data
    from sweeper.train.device import resolve_device, resolve_dtype
    from sweeper.train.evaluation import evaluate
    from sweeper.train.loop import train
    from sweeper.train.model import GPT, GPTShape, residual_dtype_for

    config = placed(base, threads, 0.0)
    trainer = config["trainer"]
    micro = int(trainer["device_batch_size"]) * int(config["model"]["seq_len"])
    probe = {
        **config,
        "trainer": {
            **trainer,
            "max_steps": PROBE_STEPS + 1,
            **dict.fromkeys(("budget_tokens", "budget_flops", "tokens_per_param")),
            "num_evals": 1,
            "eval_tokens": micro,
            "rungs": [],
            "rung_cooldown": 0.0,
        },
    }
    run = load_run_config(probe)
    per_token = run_cost(config).flops_per_token
    if run.trainer.total_batch_size * per_token * (PROBE_STEPS + 1) > PROBE_MAX_FLOPS:
        return None
    started = time.perf_counter()
    device = resolve_device(run.trainer.device, 0)
    dtype = resolve_dtype(run.trainer.dtype, device)
    data = load_data(run.data, run.model.seq_len)
    residual, ops = residual_dtype_for(device, dtype), ops_for(device, compiled=False)
    model = GPT(GPTShape.from_config(run.model), residual, ops).to(device)
    setup_s = time.perf_counter() - started
    result = train(probe, verbose=False)
    evaluate(model, data, run, device, dtype, 0, 1)  # warm-up: one batch
    batches = {**probe["trainer"], "eval_tokens": PROBE_EVAL_BATCHES * micro}
    timed = load_run_config({**probe, "trainer": batches})
    started = time.perf_counter()
    evaluate(model, data, timed, device, dtype, 0, 1)
    eval_s = time.perf_counter() - started
    return Speed(
        train_flops_per_s=result["tokens_per_s"] * per_token,
        eval_flops_per_s=PROBE_EVAL_BATCHES * micro * per_token / 3 / max(eval_s, 1e-9),
        setup_s=setup_s,
        threads=threads,
    )


# each stage's trials run in processes Tune starts for that stage (reused between its
# trials), which import torch and load the data before the first trial trains
STAGE_START_S = 6.0


def makespan(seconds: list[float], slots: int) -> float:
    """Wall time of jobs run `slots` at a time, longest first, each on the slot free
    first (what Tune's queue does with trials of known length)."""
    free = [0.0] * max(1, slots)
    for job in sorted(seconds, reverse=True):
        heapq.heappush(free, heapq.heappop(free) + job)
    return max(free)


def param_text(param) -> str:
    """optimizer.matrix_lr log_uniform [0.004, 0.1], as the sweep file writes it."""
    values = param.values if param.values else (param.low, param.high)
    return f"{param.name} {param.kind} [{', '.join(hydra_value(v) for v in values)}]"


def run_cost(config: dict, rungs: tuple[float, ...] = ()) -> TrialCost:
    """The cost of the run `config` makes (a sweep run: its micro-batch fitted), which
    evaluates on its grid and at `rungs` (its scheduler's, as a trial is given them)."""
    from sweeper.train.evaluation import evaluation_count, evaluation_steps

    run = load_run_config(sweep_run(config, {"trainer.rungs": list(rungs)}))
    params, flops_per_token = model_counts(run)
    steps = resolve_total_steps(run, params, flops_per_token)
    evaluations = evaluation_count(steps, *evaluation_steps(run, steps, flops_per_token))
    return TrialCost(planned_flops(run), flops_per_token, evaluations * run.trainer.eval_tokens)


def trial_costs(
    base: dict, space, trials: int, grid: bool, rungs: tuple[float, ...] = ()
) -> tuple[tuple, list[TrialCost]]:
    """((least, most) FLOPs of one trial, each trial's cost), from the run each combination
    of the params' bounding values makes, evaluating at `rungs` too. A pure grid runs
    exactly its combinations; sampled trials are each counted at the dearest."""
    options = {p.name: bounding_values(p) for p in space.params}
    if math.prod(map(len, options.values())) <= MAX_COMBINATIONS:
        combos = [dict(zip(options, c)) for c in itertools.product(*options.values())]
    else:
        combos = [{key: value} for key, values in options.items() for value in values]
    costs = [
        run_cost(apply_params(base, {**space.fixed, **combo}), rungs) for combo in combos or [{}]
    ]
    flops = [cost.flops for cost in costs]
    if not (grid and len(costs) == trials):
        costs = [max(costs, key=lambda cost: cost.flops)] * trials
    return (min(flops), max(flops)), costs


def stage_estimates(plan: SweepPlan, base: dict, done=()) -> list[StageEstimate]:
    """Each stage's estimate from `base`; `done`: names of stages a resume skips (`base` is
    then the config they left)."""
    frozen = plan.frozen_lrs(base)
    estimates = []
    for stage in plan.stages:
        space = plan.space(stage, frozen)
        trials = plan.planned_trials(stage, base)
        grid = stage.search == "grid" or is_pure_grid(space)
        rungs = plan.rung_fractions(stage)
        trial_flops = costs = None
        if not plan.target:  # a user's function's cost is its own business
            stage_base = plan.stage_base(stage, base)
            trial_flops, costs = trial_costs(stage_base, space, trials, grid, rungs)
        estimates.append(
            StageEstimate(
                name=stage.name,
                search=stage.search,
                scheduler=stage.scheduler,
                trials=trials,
                searched=[param_text(p) for p in space.params]
                + [f"{k}={hydra_value(v)} (fixed)" for k, v in space.fixed.items()],
                trial_flops=trial_flops,
                costs=costs,
                # a fork at a rung trains rung_cooldown of the steps the trial took to get there
                fork_factor=1 + plan.spec.rung_cooldown * sum(rungs),
                rungs=rungs,
                extend_trials=stage.extend_trials,
                lr_rule=stage.lr_rule,
                finished=stage.name in done,
                points=tuple(point_text(point) for point in stage.points),
            )
        )
    return estimates


def finished(plan: SweepPlan, state: SweepState) -> bool:
    """Whether a resumed sweep has nothing left to train: every stage, the baseline and the
    confirmation runs are in its state. (A stage a cap skipped is not: raising the cap and
    resuming runs it.)"""
    spec = plan.spec
    return (
        all(state.stage_done(stage.name) for stage in spec.stages)
        and not state.reopens_capped_stage(spec.max_seconds)
        and (state.baseline is not None or not spec.baseline)
        and not missing_runs(plan, state)
    )


def estimates_left(plan: SweepPlan, state: SweepState | None = None) -> list[StageEstimate]:
    """Every stage's estimate; with the sweep state a resume continues, its finished stages
    marked so, and the rest estimated from the config they left."""
    finished = list(state.stages) if state is not None else []
    if state is not None and state.reopens_capped_stage(plan.spec.max_seconds):
        finished.pop()  # the stage the time cap cut short goes on, given more time
    done = [s["name"] for s in finished]
    start = (finished[-1]["base_after"] if finished else None) or plan.base
    return stage_estimates(plan, start, done)


def point_text(point) -> str:
    """`base`, or {optimizer.matrix_lr=0.02, optimizer.embedding_lr=0.3}."""
    if not isinstance(point, dict):
        return f"{point} (the config the stage starts from)" if point == "base" else str(point)
    return "{" + ", ".join(f"{k}={hydra_value(v)}" for k, v in flatten(point).items()) + "}"


def fraction_text(fraction: float) -> str:
    """1/4, 3/4, 1/9: the rungs' fractions of a budget as people say them."""
    for denominator in range(2, 100):
        numerator = round(fraction * denominator)
        if numerator and abs(numerator / denominator - fraction) < 1e-9:
            return f"{numerator}/{denominator}"
    return f"{fraction:.3g}"


def plan_text(
    plan: SweepPlan,
    slots: int | None,
    state=None,
    out: Path | None = None,
    speed: Speed | None = None,
) -> str:
    """The plan as printed: a block per stage, then the sweep's totals. `state`: the sweep
    state a resume continues (its finished stages are skipped, and the rest start from the
    config they left)."""
    spec, base, target = plan.spec, plan.base, plan.target
    plans = estimates_left(plan, state)
    unit = _unit(spec)
    lines = [f"sweep '{spec.name}': the plan (sweep.dry_run=true: nothing is trained or written)"]
    if not target:
        params, per_token = model_counts(load_run_config(sweep_run(base, {})))
        lines.append(
            f"  model: {params / 1e6:.3g}M params, {flops_text(per_token)} training FLOPs a "
            f"token; each trial {unit}"
        )
    else:
        lines.append(f"  trainable: {target} (its budget is its own)")
    width = max(len(p.name) for p in plans) if plans else 0
    for estimate in plans:
        head = f"  stage {estimate.name:<{width}}  "
        if estimate.finished:
            lines.append(f"{head}finished in the run dir: skipped (sweep.resume=true)")
            continue
        what = f"{estimate.trials} trial{'s' * (estimate.trials != 1)}"
        if estimate.trial_flops:
            least, most = estimate.trial_flops
            each = flops_text(most) if least == most else f"{flops_text(least)}-{flops_text(most)}"
            what += f" of {each} FLOPs"
        lines.append(f"{head}{estimate.search} search, {estimate.scheduler} scheduler: {what}")
        pad = " " * len(head)
        lines.append(pad + "; ".join(estimate.searched))
        if estimate.points:
            lines.append(f"{pad}first the given points: {'; '.join(estimate.points)}")
        if estimate.rungs:
            lines.append(
                f"{pad}{estimate.scheduler} may stop a trial at "
                f"{', '.join(fraction_text(f) for f in estimate.rungs)} of its budget "
                + f"(keeps the best 1/{spec.reduction_factor:g} at each)"
                + (
                    f"; a fork at each rung cools down over {spec.rung_cooldown:g} of the "
                    "steps so far"
                    if spec.rung_cooldown
                    else ""
                )
            )
        if estimate.lr_rule != "none":
            rule = {
                "sqrt": "LRs follow the batch size by sqrt(B / B0)",
                "linear": "LRs follow the batch size by B / B0",
                "retune": "LRs searched again in a band around the frozen ones",
            }[estimate.lr_rule]
            lines.append(pad + rule)
        if estimate.extend_trials:
            lines.append(
                f"{pad}then {estimate.extend_trials} more trial{'s' * (estimate.extend_trials != 1)} "
                "past a range's end, where the best sits at one"
            )
    totals = sweep_totals(plan, plans, state)
    lines.append(f"  in all: {totals.text()}")
    baseline = totals.baseline
    if speed is not None and slots is not None and not target:
        seconds = plan_seconds(plan, plans, speed, slots, baseline)
        lines.append(
            f"  time: ~{duration_text(seconds)} of trials here if every trial runs to its "
            f"end, less where a scheduler stops trials (a trial on {speed.threads} thread"
            f"{'s' * (speed.threads != 1)} trains {flops_text(speed.train_flops_per_s)} "
            "FLOP/s, measured alone just now: side by side trials ran up to ~10% slower; "
            "Ray's start and the end's outputs come on top)"
        )
    if caps := caps_text(spec):
        lines.append(f"  {caps}")
    if slots is not None:
        lines.append(
            f"  {slots} trial{'s' * (slots != 1)} at once on the local cluster "
            f"(sweep.cpus_per_trial={spec.cpus_per_trial:g}, "
            f"sweep.gpus_per_trial={spec.gpus_per_trial:g}"
            + (f", sweep.concurrency={spec.concurrency}" if spec.concurrency else "")
            + ")"
        )
    else:
        lines.append("  trials at once: as many as the cluster's resources allow")
    if out is not None:
        lines.append(f"  run dir: {out}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Totals:
    """What the stages left, the baseline and the confirmation runs take together."""

    runs: int
    extras: tuple[str, ...]  # the runs besides the stages' trials, in words
    most_flops: float | None  # every run to its end (None: a user's function)
    baseline: bool  # the baseline is still to run

    def text(self) -> str:
        text = f"at most {self.runs} runs"
        if self.extras:
            text += f" (with {', '.join(self.extras)})"
        if self.most_flops is not None:
            text += f", {flops_text(self.most_flops)} training FLOPs if no trial is stopped early"
        return text


def sweep_totals(plan: SweepPlan, plans: list[StageEstimate], state: SweepState | None) -> Totals:
    spec, base, target = plan.spec, plan.base, plan.target
    runs = sum(p.trials + p.extend_trials for p in plans if not p.finished)
    extras = []
    baseline = bool(spec.baseline) and (state is None or state.baseline is None)
    if baseline:
        runs += 1
        extras.append("the baseline")
    if spec.confirm_seeds:
        runs += 2 * spec.confirm_seeds
        extras.append(f"{2 * spec.confirm_seeds} confirmation runs")
    most = None
    if not target:
        left = [p for p in plans if not p.finished]
        # a round past a range's end trains trials like the stage's own, forks included
        most = sum(p.most_flops + p.extend_trials * p.trial_flops[1] * p.fork_factor for p in left)
        # the baseline is the base config; a confirmation pairs the best config (one of
        # the stages' trials) with the baseline on each seed
        base_flops = planned_flops(load_run_config(sweep_run(base, {})))
        best_flops = max([base_flops] + [p.trial_flops[1] for p in plans])
        most += (int(baseline) + spec.confirm_seeds) * base_flops
        most += spec.confirm_seeds * best_flops
    return Totals(runs, tuple(extras), most, baseline)


def opening_line(plan: SweepPlan, state: SweepState | None = None) -> str:
    """The sweep's first line: what it will take at most, the plan's totals without timing
    anything (the dry run's minutes need a few steps trained; the progress line's ETA
    follows the real trials)."""
    spec = plan.spec
    plans = estimates_left(plan, state)
    left = [estimate.name for estimate in plans if not estimate.finished]
    stages = f"{len(left)} stage{'s' * (len(left) != 1)} ({', '.join(left)})"
    totals = sweep_totals(plan, plans, state)
    caps = caps_text(spec)
    return (
        f"sweep '{spec.name}': {stages}, {totals.text()}"
        + (f"; {caps}" if caps else "")
        + "; sweep.dry_run=true prints the whole plan"
    )


def caps_text(spec: SweepSpec) -> str:
    """The sweep's own caps, which may end it before the plan's at-most figures."""
    caps = [
        f"sweep.{key}={hydra_value(getattr(spec, key))}"
        for key in ("max_trials", "max_flops", "max_seconds")
        if getattr(spec, key) is not None
    ]
    return f"capped by {', '.join(caps)}" if caps else ""


def plan_seconds(
    plan: SweepPlan, plans: list[StageEstimate], speed: Speed, slots: int, baseline: bool
) -> float:
    """Wall time of the stages left if every trial runs to its end: the stages one after
    another, each starting its processes, then its trials `slots` at a time, the baseline
    in the first stage's (it takes the first idle slot), then each stage's round past a
    range's end and the confirmation runs."""
    spec, base = plan.spec, plan.base
    once = run_cost(evaluating_once(base))  # the baseline evaluates once, at its end
    total = 0.0
    for number, estimate in enumerate(p for p in plans if not p.finished):
        jobs = [speed.trial_seconds(cost, estimate.fork_factor) for cost in estimate.costs]
        if number == 0 and baseline:
            jobs.append(speed.trial_seconds(once, 1.0))
        total += STAGE_START_S + makespan(jobs, slots)
        if estimate.extend_trials:
            dearest = max(jobs[: len(estimate.costs)])
            total += makespan([dearest] * estimate.extend_trials, slots)
    if spec.confirm_seeds:
        total += makespan([speed.trial_seconds(once, 1.0)] * 2 * spec.confirm_seeds, slots)
    return total


def _unit(spec: SweepSpec) -> str:
    if spec.budget.tokens_per_trial is not None:
        return f"trains {spec.budget.tokens_per_trial:,.0f} tokens"
    if spec.budget.flops_per_trial is not None:
        return f"trains {flops_text(spec.budget.flops_per_trial)} FLOPs (or a stage's own budget)"
    return "trains its config's budget"


def evaluating_once(base: dict) -> dict:
    """`base` evaluated once, at its end: the baseline's run (only its last value counts)."""
    return {**base, "trainer": {**base["trainer"], "num_evals": 1}}
