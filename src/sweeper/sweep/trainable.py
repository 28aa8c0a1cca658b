"""The Ray Tune function trainable: one trial of a sweep, inside a Ray worker. It receives
only plain values (the sampled parameters, and the stage's base config composed on the
driver): no Hydra state crosses into the worker (hydra#1126, #2772)."""

from __future__ import annotations

import contextlib
import functools
import math
import queue
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sweeper.sweep.space import to_builtin
from sweeper.sweep.stages import apply_params, fit_micro_batch, follow_batch_size, get_dotted
from sweeper.sweep.stall import StallWatch, raise_in_thread
from sweeper.train.activations import ACTIVATION_COLUMNS
from sweeper.train.checkpoint import load_latest_state, save_state
from sweeper.user_function import load_target


@dataclass(frozen=True)
class TrialContext:
    """What every trial of a stage shares; built on the driver."""

    metric: str
    penalty: float
    target: str | None = None  # "pkg.module.fn" of a user's function; None: sweeper's train
    lr_rule: str = "none"
    base_batch: float | None = None
    lr_keys: tuple[str, ...] = ()
    checkpoint: bool = False  # write a resumable checkpoint at each report
    threads: int = 1
    gpus: float = 0.0  # sweep.gpus_per_trial
    sampled: tuple[str, ...] = field(default_factory=tuple)
    storage: str | None = None  # the sweep's Ray storage path (DDP trials put their runs there)
    rungs: tuple[float, ...] = ()  # where the scheduler ranks trials, as fractions of the budget
    rung_cooldown: float = 0.0  # sweep.rung_cooldown: the cooled-down fork ranked there
    # "the asha scheduler", "the tpe search": what reads the metric from every report, so
    # that Ray refuses a report without it (None: fifo with random or grid, which rank only
    # a trial's last report)
    metric_read_by: str | None = None
    stall_seconds: float | None = None  # sweep.stall_seconds: see sweep/stall.py

    @property
    def ranks_forks(self) -> bool:
        """Whether the scheduler ranks cooled-down forks (RUNG_METRIC) at its rungs."""
        return bool(self.rung_cooldown and self.rungs)


# the metric a stage's scheduler ranks when sweep.rung_cooldown forks trials at its rungs
RUNG_METRIC = "rung_val_bpb"


@dataclass(frozen=True)
class EarlierRun:
    """A run the sweep finished in an earlier stage, whose config a trial of this stage may
    repeat: the config the stage starts from is its incumbent's (runner.reusable_run)."""

    config: dict  # the run config it trained (its evaluation count aside)
    source: str  # "stage/trial_id", as records and MLflow name it
    reports: tuple[dict, ...]  # its rows of reports.csv, in order


# keys of a run config that change when and how often a run evaluates, not what it trains
# (test_train: a run evaluated at every step ends bit for bit as one evaluated once)
EVALUATION_KEYS = frozenset({"num_evals", "eval_every"})


def same_training(config: dict, other: dict) -> bool:
    """Whether two run configs of sweeper's training train the same run, bit for bit: the
    same values everywhere but in how often they evaluate."""

    def training(run: dict) -> dict:
        trainer = {k: v for k, v in run["trainer"].items() if k not in EVALUATION_KEYS}
        return {**run, "trainer": trainer}

    return to_builtin(training(config)) == to_builtin(training(other))


def replay(earlier: EarlierRun, metric: str, report) -> None:
    """Reports `earlier`'s evaluations again, as its own run would: the values it reported,
    each marked `reused_from`, and no compute spent (see state.spent_flops)."""
    rows = earlier.reports
    for i, row in enumerate(rows):
        metrics = {c: row[c] for c in REPLAYED_COLUMNS if row.get(c) is not None}
        metrics.update(
            {
                metric: row.get(metric),
                "status": row["status"] if i == len(rows) - 1 else "running",
                "reused_from": earlier.source,
            }
        )
        report(metrics)


# how far a step moved each parameter group's weights (optim.update_ratios), reported by
# sweeper's own training; the groups of GPT.param_groups (adamw has no unembedding group)
UPDATE_RATIO_COLUMNS = tuple(
    f"update_ratio_{group}" for group in ("matrix", "embedding", "unembedding", "scalar")
)
# what a trial's report holds, as reports.csv keeps it (results.collect_results)
REPORT_COLUMNS = (
    "step",
    "tokens",
    "flops",
    "params",
    "val_bpb",
    "train_loss",
    "lr",
    "grad_norm",
    "grad_norm_max",
    *UPDATE_RATIO_COLUMNS,
    *ACTIVATION_COLUMNS,
    "tokens_per_s",
    "mfu",
    "peak_memory_gib",
    "wall_time",
)
# what a replayed report carries: the run's own, without the wall clock (a replay happens
# now) and without an earlier stage's rung forks (this stage has no rungs)
REPLAYED_COLUMNS = tuple(c for c in REPORT_COLUMNS if c != "wall_time")


class Diverged(Exception):
    """A user's function reported a non-finite metric: the trial ends as diverged."""


class MissingMetricError(Exception):
    """A user's function reported without the sweep's metric in a stage whose scheduler or
    search reads it from every report (`of`), or returned without a report (`never`).
    Ray's own check would end the whole sweep; this ends the trial, and its message tells the
    driver what the function did report (`keys_in`)."""

    NO_REPORT = "the function returned without a report"

    @classmethod
    def of(cls, metric: str, read_by: str, keys: list[str]) -> MissingMetricError:
        # the message is its only argument: Ray re-raises a trial's error from a copy
        held = ", ".join(keys) or "nothing"
        return cls(f"{metric} not in a report, which {read_by} ranks; the report held: {held}")

    @classmethod
    def never(cls, metric: str) -> MissingMetricError:
        return cls(f"{metric} in no report: {cls.NO_REPORT}")

    @classmethod
    def keys_in(cls, error: str) -> list[str] | None:
        """The keys a report held, from the text of a trial's error ([] if it made none);
        None: another error."""
        if "MissingMetricError: " not in error:
            return None
        match = re.search(r"MissingMetricError: .*; the report held: (.*)$", error, re.MULTILINE)
        if match is None or match.group(1).strip() == "nothing":
            return []
        return match.group(1).strip().split(", ")


class BadReportError(Exception):
    """A user's function reported its metric as something other than a number."""


def plain_numbers(metrics: dict, metric: str) -> dict:
    """A user's report with numpy scalars and one-element arrays or tensors as Python
    numbers (Tune refuses tensors, JSON refuses numpy); a metric that is not a number (a
    string, a bool) is refused in one line, where Ray's ASHA would fail deep in its own
    code. A `status` other than completed or diverged (the platform's words) is kept as
    `user_status`."""
    plain = {}
    for key, value in metrics.items():
        item = getattr(value, "item", None)
        if callable(item) and not isinstance(value, str | bytes):
            with contextlib.suppress(ValueError, RuntimeError):  # more than one element
                value = item()
        plain[key] = value
    if plain.get("status") not in (None, "completed", "diverged"):
        # `status` is how a trial ended, to the platform ("ok" made every trial pruned)
        plain["user_status"] = plain.pop("status")
    value = plain.get(metric)
    if metric in plain and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise BadReportError(f"{metric} must be a number, got {value!r} ({type(value).__name__})")
    return plain


def trial_config(params: dict[str, Any], base: dict, ctx: TrialContext) -> dict:
    """The full run config of a trial: base + sampled values (+ LRs following the batch),
    placed as Ray places it (`placed`) for sweeper's own training, so that MLflow records
    the config that trained and the reproduce line trains it again."""
    config = apply_params(base, params)
    if ctx.lr_rule in ("sqrt", "linear") and ctx.base_batch:
        config = follow_batch_size(
            config, ctx.lr_rule, ctx.base_batch, list(ctx.lr_keys), set(params)
        )
    return config if ctx.target else placed(config, ctx.threads, ctx.gpus)


def placed(config: dict, threads: int, gpus: float) -> dict:
    """A run of sweeper's training with a trial's resources: `threads` torch threads (its
    CPU share; float sums, so results, depend on the count), its micro-batch fitted to its
    batch (fit_micro_batch), and, for one process, the device its GPU share allows: Ray 2.60
    no longer hides the GPUs from a worker given none, so `auto` would put every such trial
    on cuda:0, unaccounted. A DDP trial's ranks ask Ray Train for their GPUs themselves."""
    trainer = {**fit_micro_batch(config)["trainer"], "threads": threads}
    if trainer.get("workers", 1) == 1 and trainer.get("device") == "auto":
        trainer["device"] = "cuda" if gpus else "cpu"
    return {**config, "trainer": trainer}


def penalise(metrics: dict, metric: str, penalty: float) -> tuple[dict, bool]:
    """A diverged report gets a finite penalty: NaN is never stopped by Ray's ASHA (its
    comparisons are false) and Optuna marks NaN trials failed, learning nothing."""
    metrics = to_builtin(dict(metrics))
    value = metrics.get(metric)
    diverged = metrics.get("status") == "diverged" or (
        isinstance(value, float) and not math.isfinite(value)
    )
    if diverged:
        metrics.setdefault("reason", f"{metric} was {value}")
        metrics.update({metric: penalty, "status": "diverged"})
        if RUNG_METRIC in metrics:  # what the scheduler ranks, with rung forks on
            metrics[RUNG_METRIC] = penalty
    return metrics, diverged


class BackgroundReporter:
    """Hands a trial's results to Tune, in order, from a helper thread (at most `backlog`
    wait): Tune's report() blocks until the driver has run its callbacks and asks for the
    next (`synchronous_result_reporting` in ray.train._internal.session), with training idle.
    When Tune stops or pauses the trial, training ends at once (stop_thread), losing only
    what it trained after the result Tune decided on, whose checkpoint Tune keeps."""

    def __init__(self, backlog: int = 4):
        self._queue: queue.Queue = queue.Queue(maxsize=backlog)
        self._error: BaseException | None = None
        self._training = threading.current_thread()
        self._thread = threading.Thread(target=self._run, name="sweeper-report", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ray import tune

        while (item := self._queue.get()) is not None:
            metrics, folder = item
            try:
                if self._error is None:  # after a stop or failure, only the folders go
                    checkpoint = tune.Checkpoint.from_directory(folder) if folder else None
                    tune.report(metrics, checkpoint=checkpoint)
            except SystemExit:  # Tune ended the trial (a scheduler's stop or pause)
                self._error = TrialStopped()
                stop_thread(self._training)
            except BaseException as error:
                self._error = error
            finally:
                if folder:
                    shutil.rmtree(folder, ignore_errors=True)

    def report(self, metrics: dict, folder: str | None = None) -> None:
        """Queues one result (and the checkpoint folder it owns from now on)."""
        self._raise_if_failed()
        self._put((metrics, folder))

    def close(self) -> None:
        """Waits until Tune has taken every result: the function's return ends the trial."""
        self._put(None)
        self._thread.join()
        self._raise_if_failed()

    def _put(self, item) -> None:
        while True:
            try:
                self._queue.put(item, timeout=1.0)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    return

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


class TrialStopped(SystemExit):
    """Tune stopped the trial: ends its training thread as Tune's own report() would."""

    def __init__(self):
        super().__init__(0)  # code 0: Ray's runner thread ends quietly, not as an error


def stop_thread(thread: threading.Thread) -> None:
    """Raises TrialStopped in `thread` at its next Python instruction (within one torch op).
    Tune's own report() would sys.exit the training thread; with the BackgroundReporter it
    is busy training, and Tune gives it 2 s to end before it refuses to reuse the actor
    and fails the next trial."""
    if thread.is_alive() and thread.ident is not None:
        raise_in_thread(thread.ident, TrialStopped)


def run_trial(
    config: dict, base: dict, ctx: TrialContext, earlier: EarlierRun | None = None
) -> None:
    params = to_builtin(dict(config))
    run_cfg = trial_config(params, base, ctx)
    reused = earlier is not None and same_training(run_cfg, earlier.config)
    if not reused and not ctx.target and run_cfg["trainer"]["workers"] > 1:
        _run_ddp_trial(run_cfg, ctx)  # Ray Train hands rank 0's results to Tune itself
        return

    reporter = BackgroundReporter()
    watch = StallWatch(ctx.stall_seconds) if ctx.stall_seconds else None
    made = 0  # reports so far

    def report(metrics: dict, state=None, checkpoint: dict | None = None) -> None:
        """One result. `state`: sweeper's own training's state (a function that makes it);
        `checkpoint`: a user's function's own (tensors and plain values), handed back to it
        as `report.checkpoint` when its trial is paused and resumed, or retried."""
        nonlocal made
        made += 1
        if watch is not None:
            watch.beat()
        if ctx.target:
            metrics = plain_numbers(metrics, ctx.metric)
            if ctx.metric_read_by and ctx.metric not in metrics:
                keys = reported_keys(metrics)
                raise MissingMetricError.of(ctx.metric, ctx.metric_read_by, keys)
        metrics, diverged = penalise(metrics, ctx.metric, ctx.penalty)
        metrics["wall_time"] = time.time()  # orders reports across trials (bench/bench_search.py)
        folder = None
        if (state is not None or checkpoint is not None) and not diverged:
            folder = tempfile.mkdtemp(prefix="sweeper-ckpt-")
            save_state(folder, state() if state is not None else checkpoint)
        reporter.report(metrics, folder)
        if diverged and ctx.target:
            raise Diverged

    report.checkpoint = None  # a user's function's own, where its trial goes on from one
    try:
        if reused:  # training it again would give the same bits (runner.reusable_run)
            replay(earlier, ctx.metric, report)
        else:
            _run_one_process_trial(run_cfg, ctx, report)
    finally:
        if watch is not None:
            watch.stop()
        reporter.close()
    if ctx.target and not made:  # Tune would end the sweep on its empty last result
        raise MissingMetricError.never(ctx.metric)


def with_run_settings(run_cfg: dict, ctx: TrialContext) -> None:
    """How the stage runs its trials, not what they train (left out of the recorded
    config, so the reproduce line stays a plain run): checkpoints, evaluations at the
    scheduler's rungs and the forks there."""
    trainer = run_cfg["trainer"]
    trainer["checkpoint_every_eval"] = ctx.checkpoint
    trainer["rungs"] = list(ctx.rungs)
    if ctx.ranks_forks:
        trainer["rung_cooldown"] = ctx.rung_cooldown


def _run_one_process_trial(run_cfg: dict, ctx: TrialContext, report) -> None:
    from ray import tune

    resume_state = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:  # a paused (Hyperband/BOHB) or retried trial
        with checkpoint.as_directory() as folder:
            resume_state = load_latest_state(folder)
    if ctx.target:
        report.checkpoint = resume_state
        with contextlib.suppress(Diverged):  # ended by the report above, as diverged
            load_target(ctx.target)(run_cfg, report)
        return

    import torch

    from sweeper.train.loop import train

    with_run_settings(run_cfg, ctx)
    torch.set_num_threads(ctx.threads)
    train(run_cfg, report, resume_state=resume_state, verbose=False)


def _run_ddp_trial(run_cfg: dict, ctx: TrialContext) -> None:
    from ray import tune

    from sweeper.train.distributed import train_ddp

    with_run_settings(run_cfg, ctx)
    train_ddp(
        run_cfg,
        cpus_per_worker=ctx.threads,
        storage_path=ctx.storage,
        name=f"ddp_{tune.get_context().get_trial_id()}",
        inside_tune=True,
        penalise=functools.partial(penalise, metric=ctx.metric, penalty=ctx.penalty),
    )


def batch_of(base: dict) -> float | None:
    return get_dotted(base, "trainer.total_batch_size")


# keys of a trial's result that Tune or sweeper add: not what the trainable reported
ADDED_KEYS = frozenset(
    {"done", "trial_id", "experiment_tag", "should_checkpoint", "wall_time", "status", "reason"}
)


def reported_keys(metrics: dict) -> list[str]:
    """What a trainable's own reports held, less the keys Tune or sweeper add."""
    from ray.tune.result import AUTO_RESULT_KEYS

    return sorted(k for k in metrics if k not in ADDED_KEYS and k not in AUTO_RESULT_KEYS)
