"""The staged sweep: `python -m sweeper +sweep=NAME`, from its plan.

for each stage: Tune run (stage.py) -> best trial -> freeze its values into the config the
next stage starts from. A baseline run of the unmodified config trains under the same
budget in the first slot a stage leaves idle (callbacks.IdleSlot). At the end: summary,
reports.csv, plots and the loss-vs-compute fit in the run dir (report/summary.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import ray

from sweeper.config.sweep import StageSpec
from sweeper.report.markdown import command_overrides
from sweeper.report.summary import (
    counts_text,
    kept_note,
    print_stage_table,
    status_tally,
    write_all,
)
from sweeper.sweep import extend as extension
from sweeper.sweep.algorithms import metric_reader
from sweeper.sweep.baseline import Baseline
from sweeper.sweep.callbacks import IDLE_WORK
from sweeper.sweep.cluster import start_ray
from sweeper.sweep.confirm import run_confirmation
from sweeper.sweep.estimate import evaluating_once, finished, opening_line
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.preflight import resumable_state
from sweeper.sweep.stage import StageCapped, run_stage
from sweeper.sweep.stages import keeps_its_start, pick_best
from sweeper.sweep.state import SweepState, spent_flops
from sweeper.sweep.trainable import EarlierRun, trial_config
from sweeper.tracking import make_tracker, start_tracker

# Ray's OOM kill of a worker, the CPU allocator's refusal, torch's CUDA OutOfMemoryError
OUT_OF_MEMORY_SIGNS = ("low on memory", "can't allocate memory", "OutOfMemoryError")


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


class MetricNotReported(SweepFailed):
    """No trial of a stage reported the sweep's metric: every later stage would rank
    nothing the same way, so the sweep stops at once with what the trials did report."""

    def __init__(self, stage: str, metric: str, reported: list[str], target, read_by=None):
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
    """Every trial of every stage diverged or failed: the outputs are written (the learning
    curves show where each went wrong), but there is no best config to give. (Trials a cap
    of the user's cut short before they reported leave no best either: no failure.)"""

    def __init__(self, state: SweepState, out: Path):
        counts = counts_text(status_tally(state.all_records()))
        Exception.__init__(
            self,
            f"no trial of the sweep has a value to rank ({counts}), so it has no best "
            f"config: for diverged trials lower the LR ranges; each trial's reports are in "
            f"{out}/reports.csv",
        )


def run_sweep(plan: SweepPlan, out_dir: str) -> float | None:
    """Runs the sweep in `out_dir` (a resume goes on from its state); its best value."""
    spec = plan.spec
    out = Path(out_dir).resolve()
    # before MLflow and Ray: a state of another sweep is refused with nothing written
    state = resumable_state(out, plan) if spec.resume else None
    if spec.resume and state is None:
        print(f"sweep.resume=true but no sweep state in {out}: starting a new sweep")
    if state is not None and finished(plan, state):
        tracker = make_tracker(plan, out)
        # nothing left to train: the outputs are written again without starting Ray
        print("sweep.resume=true: every stage of this sweep finished earlier; writing its outputs")
    else:
        print(opening_line(plan, state), flush=True)
        tracker = start_tracking_and_ray(plan, out)
    if state is None:
        state = SweepState.new(
            out, spec.name, plan.base, plan.definition, launched=command_overrides(out)
        )
    try:
        train_everything(plan, out, state, tracker)
    except BaseException as error:
        # Ctrl+C or a crash: close the tracker's runs honestly, keep the state on disk
        interrupted = isinstance(error, KeyboardInterrupt)
        if interrupted:
            print(
                f"sweep interrupted: finished stages and trials are saved in {out}; "
                "continue it with the same command plus sweep.resume=true "
                f"hydra.run.dir={out}"
            )
        tracker.finish({}, out, status="KILLED" if interrupted else "FAILED")
        raise
    summary = write_all(out, plan, state)
    tracker.finish(summary, out)
    records = state.all_records()
    if records and all(r["status"] in ("diverged", "failed") for r in records):
        raise NothingToRank(state, out)
    return summary["best"]["value"] if summary.get("best") else None


def start_tracking_and_ray(plan: SweepPlan, out: Path):
    """MLflow's tracker, made beside Ray's start (each takes seconds, mostly waiting)."""
    tracker_ready = start_tracker(plan, out)
    try:
        # (trainer.device=cuda without sweep.gpus_per_trial is refused by the plan)
        gpus = plan.spec.gpus_per_trial
        start_ray(plan.ray, gpus_for=f"sweep.gpus_per_trial={gpus:g}" if gpus else None)
    finally:
        # a tracker's error is the one to report, as when it was made before Ray; it is
        # also never left half made when Ray fails to start
        tracker = tracker_ready()
    if hint := idle_gpus_hint(plan, ray.cluster_resources().get("GPU", 0)):
        print(hint)
    return tracker


def idle_gpus_hint(plan: SweepPlan, gpus: float) -> str | None:
    """A line for a cluster with GPUs whose trials were given none: they train on CPU."""
    trainer = plan.base["trainer"]
    on_cpu = (
        trainer["device"] == "auto" and trainer["workers"] == 1 and not plan.spec.gpus_per_trial
    )
    if plan.target or not gpus or not on_cpu:
        return None
    return (
        f"trials train on CPU (sweep.gpus_per_trial=0) beside {gpus:g} GPUs: "
        "sweep.gpus_per_trial=1 (or 0.5, two trials per GPU) trains them there"
    )


def train_everything(plan: SweepPlan, out: Path, state: SweepState, tracker) -> None:
    """The stages, the baseline (in the first idle slot) and the confirmation runs, each
    saved in the state as it ends; on Ctrl+C the time trained so far is saved too."""
    spec = plan.spec
    started = time.time() - state.elapsed
    baseline = None
    if spec.baseline and state.baseline is None:
        # evaluated once, at the end: only its last value is read, and a run's training
        # does not depend on how often it evaluates (trainable.same_training)
        baseline = Baseline(evaluating_once(plan.base) if not plan.target else plan.base, plan)
        IDLE_WORK[str(out)] = baseline.launch
    reaper = contextlib.nullcontext()
    if plan.workers > 1:
        from sweeper.train.distributed import placement_group_reaper

        reaper = placement_group_reaper()
    try:
        with reaper:
            run_stages(plan, out, state, started, tracker)
        if baseline is not None:
            result = baseline.collect(timeout=seconds_left(spec, started))
            if result is None:
                print(
                    f"baseline: sweep.max_seconds={spec.max_seconds:g} ran out before it "
                    "finished: this sweep has none (a resume with more time trains it)"
                )
            else:
                state.set_baseline(result)
                tracker.log_baseline(state.baseline, baseline.base)
        run_confirmation(plan, state)
    except KeyboardInterrupt:
        # the time the interrupted stage trained counts, as its trials go on from it
        state.elapsed = time.time() - started
        state.save()
        raise
    finally:
        IDLE_WORK.pop(str(out), None)


def run_stages(plan: SweepPlan, out: Path, state: SweepState, started: float, tracker) -> None:
    """The stages in order, each starting from the best config of the ones before."""
    spec = plan.spec
    reopen_capped_stage(plan, state)
    current = state.base_after_finished_stages() or plan.base
    for index, stage in enumerate(spec.stages):
        if state.stage_done(stage.name):
            print(f"[{stage.name}] finished in an earlier run: skipped")
            continue
        remaining_trials = (
            None if spec.max_trials is None else spec.max_trials - state.trial_count()
        )
        remaining_seconds = seconds_left(spec, started)
        if remaining_trials is not None and remaining_trials <= 0:
            reached = f"sweep.max_trials={spec.max_trials}"
        elif remaining_seconds is not None and remaining_seconds <= 0:
            reached = f"sweep.max_seconds={spec.max_seconds:g}"
        else:
            reached = None
        if reached:
            print(
                f"[{stage.name}] skipped, and the stages after it: {reached} is reached. To go "
                f"on, raise it and add sweep.resume=true hydra.run.dir={out}"
            )
            return
        capped = False
        try:
            records, reports = run_stage(
                plan,
                index,
                current,
                out,
                state,
                remaining_trials,
                remaining_seconds,
                tracker,
                reusable=reusable_run(plan, stage, state, current),
            )
        except StageCapped as cut:
            records, reports, capped = cut.records, cut.reports, True
        if capped and not records:  # a resume restores the stage's Tune run
            state.elapsed = time.time() - started
            state.save()
            print(time_cap_reached(stage.name, out))
            return
        if not records:
            return
        current, go_on = finish_stage(
            plan, index, current, records, reports, capped, out, state, started, tracker
        )
        if not go_on:
            return


def finish_stage(plan, index, start, records, reports, capped, out, state, started, tracker):
    """Ranks the stage's trials (and a round past a range's end), freezes its best into the
    config the next stage starts from, and saves it; (that config, whether to go on)."""
    spec, stage = plan.spec, plan.stages[index]
    best = pick_best(records, spec.metric, spec.mode)
    check_something_ranked(plan, stage, records, best, out)
    edges = extension.range_edges(plan, stage.name, start, best)
    extended = {}
    if stage.extend_trials and edges and not capped:
        try:
            records, reports, extended = extend(
                plan, index, start, records, reports, best, edges, out, state, started, tracker
            )
        except StageCapped as cut:
            records, reports, capped = cut.records, cut.reports, True
        best = pick_best(records, spec.metric, spec.mode)
        edges = extension.range_edges(plan, stage.name, start, best, extended)
    flop_capped = spec.max_flops is not None and (
        state.total_flops() + spent_flops(records) >= spec.max_flops
    )
    if (capped or flop_capped) and best is not None and best["status"] != "completed":
        best = None  # a value at fewer tokens than the budget: not one to freeze
    incumbent = state.carried()
    keeps_start = keeps_its_start(incumbent, best, spec.mode)
    freezes = best is not None and not keeps_start
    after = frozen_config(plan, stage, best, start) if freezes else start
    carried = best if freezes else incumbent
    elapsed = time.time() - started
    state.finish_stage(
        stage.name, records, reports, best, after, elapsed, extended, carried, capped
    )
    print_stage_table(stage.name, records, best, spec, edges)
    if keeps_start:
        print(f"[{stage.name}] {kept_note(spec, incumbent, best, start)}\n")
    elif best is None and (capped or flop_capped):
        print(
            f"[{stage.name}] no trial trained its whole budget before the "
            f"{'time' if capped else 'FLOP'} cap: nothing frozen\n"
        )
    elif best is None:
        print(
            f"[{stage.name}] no trial has a value to rank "
            f"({counts_text(status_tally(records))}): "
            "nothing frozen, the next stage starts from the same config\n"
        )
    if state.total_flops() >= (spec.max_flops or math.inf):
        print("the sweep's FLOP cap is reached: no further stages")
        return after, False
    if capped:
        print(time_cap_reached(stage.name, out))
        return after, False
    return after, True


def check_something_ranked(plan, stage: StageSpec, records, best, out: Path) -> None:
    """Stops the sweep where no trial reported the metric, or every trial failed: every
    later stage would fail the same way."""
    metric = plan.spec.metric
    if best is None and (instead := reported_instead(records)) is not None:
        every_report = any(r["status"] == "failed" for r in records if r.get("reported"))
        reader = metric_reader(stage.search, stage.scheduler)
        raise MetricNotReported(
            stage.name, metric, instead, plan.target, reader if every_report else None
        )
    if all(r["status"] == "failed" for r in records):
        raise SweepFailed(stage.name, records[0]["error"], out)


def reported_instead(records: list[dict]) -> list[str] | None:
    """What the stage's trials reported where not one of them reported the metric (a
    user's function with its own name for it), else None."""
    ran = [r for r in records if r["status"] != "failed" or "reported" in r]
    if not ran or any("reported" not in r for r in ran):
        return None
    return sorted({key for r in ran for key in r["reported"]})


def seconds_left(spec, started: float) -> float | None:
    """What sweep.max_seconds leaves of a sweep that started at `started`; None without it."""
    return None if spec.max_seconds is None else spec.max_seconds - (time.time() - started)


def time_cap_reached(stage: str, out: Path) -> str:
    return (
        f"the sweep's time cap is reached: no further stages. A resume goes on with stage "
        f"'{stage}' (its stopped trials from their last report, then those it has yet to "
        f"start): raise sweep.max_seconds and add sweep.resume=true hydra.run.dir={out}"
    )


def reopen_capped_stage(plan: SweepPlan, state: SweepState) -> None:
    """A resume given more time reopens the stage the cap ran out in: its Tune run goes on
    from where the cap stopped it, the stopped trials from their last checkpoints."""
    if not state.reopens_capped_stage(plan.spec.max_seconds):
        return
    last = state.stages[-1]
    state.reopen_last_stage()
    cut = sum(bool(r.get("capped")) for r in last["records"])
    stopped = {0: "", 1: ", and the trial it stopped trains on"}.get(
        cut, f", and the {cut} trials it stopped train on"
    )
    print(f"[{last['name']}] the time cap ran out during this stage: it goes on{stopped}")


def extend(plan, index, start, records, reports, best, edges, out, state, started, tracker):
    """The stage's round past the ends where its best sat (sweep/extend.py): both rounds'
    records and reports, and what it searched ({param: [low, high]} of a range, the new
    values of a list; empty when no round ran)."""
    stage = plan.stages[index]
    after = trial_config(best["params"], start, plan.trial_context(stage, start))
    round_two, spent = extension.plan_round(
        plan, stage, start, after, edges, records, state, started
    )
    if round_two is None:
        return records, reports, {}
    try:
        extra_records, extra_reports = run_stage(
            plan,
            index,
            after,
            out,
            state,
            plan.planned_trials(round_two, after),
            seconds_left(plan.spec, started),
            tracker,
            stage=round_two,
            suffix=extension.EXPERIMENT_SUFFIX,
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


def frozen_config(plan: SweepPlan, stage: StageSpec, best: dict, start: dict) -> dict:
    """The config `best` trained, rebuilt from the stage's start: a trial of the round past
    the ends trained from the first round's best (`extend`), and is rebuilt from it the
    same way, so the reproduce line and the next stages get the same LRs to the bit."""
    if "extended_from" in best:
        start = trial_config(best["extended_from"], start, plan.trial_context(stage, start))
        return trial_config(best["round_params"], start, plan.trial_context(stage, start))
    return trial_config(best["params"], start, plan.trial_context(stage, start))


def reusable_run(plan: SweepPlan, stage: StageSpec, state: SweepState, start: dict):
    """The finished run a trial of `stage` may replay instead of training it again: the
    incumbent that `start` was frozen from. A grid holding the frozen value (lr_bs: batch
    8192 after an LR stage at 8192) would train that run again, to the same bits. Only in
    a fifo stage (no rungs to rank it at), for sweeper's own training (a user's function
    need not be deterministic), and for a run that trained its whole budget on one seed."""
    incumbent = state.carried()
    if (
        plan.target
        or stage.scheduler != "fifo"
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
