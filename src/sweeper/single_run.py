"""One training run, in the Hydra run dir: sweeper's own training (on `trainer.workers` DDP
ranks), or a user's function run once. Each is tracked in MLflow as one run and leaves its
result.json, whole, whether it completed, diverged, failed or was interrupted."""

from __future__ import annotations

import functools
import json
import math
import sys
import threading
from pathlib import Path

from sweeper.config.errors import ConfigError, fail
from sweeper.config.schema import RunConfig
from sweeper.files import write_json_atomic
from sweeper.report.run_plot import PLOT_NAME, plot_run
from sweeper.signals import interrupts_held
from sweeper.sweep.cluster import start_ray
from sweeper.sweep.trainable import BadReportError, Diverged, plain_numbers
from sweeper.tracking.run_logger import start_run_logger
from sweeper.train.device import out_of_memory, resolve_device
from sweeper.train.distributed import train_ddp
from sweeper.train.loop import train
from sweeper.train.run_checkpoint import (
    checkpoint_saver,
    has_checkpoint,
    load_resume_state,
    read_record,
    resume_command,
    saved_evaluations_after,
)
from sweeper.user_function import load_user_function, user_function_config


def run_single(cfg, run: RunConfig, out_dir: str) -> float | None:
    """One run of sweeper's own training (on `trainer.workers` DDP ranks), tracked in
    MLflow as one run: its result.json, curves.png and, where asked, its checkpoint."""
    # a resumed run keeps checkpointing: it was started with checkpoints on
    run.trainer.checkpoint_every_eval |= run.trainer.resume
    logger = start_run_logger(cfg, run.to_dict(), out_dir, run.trainer.resume)
    try:
        if run.trainer.workers > 1:
            result = run_ddp(cfg, out_dir, run.trainer.checkpoint_every_eval, logger)
        else:
            resume_state = load_resume_state(out_dir) if run.trainer.resume else None
            report = single_run_report(run, out_dir, logger)
            result = train(run, report, resume_state=resume_state)
    except ConfigError as error:  # found inside the job (a multirun's late job): bad input
        end_logging(logger, "failed", {"error": str(error)})
        fail(str(error))
    except (Exception, KeyboardInterrupt) as error:
        record_failure(logger, out_dir, error, lambda: resume_hint(out_dir))
        if asked := out_of_memory(error):  # a batch too big for the machine: not a bug
            exit_out_of_memory(cfg, asked, out_dir)
        raise
    if run.trainer.workers == 1:  # a DDP run's rank 0 writes its own (distributed.py)
        write_result(out_dir, result)
    elif result.get("out_of_memory"):  # the ranks recorded it and returned quietly
        end_logging(logger, "failed", result)
        exit_out_of_memory(cfg, result["out_of_memory"], out_dir)
    try:
        drawn = plot_run(result, run, Path(out_dir) / PLOT_NAME)
    except Exception as error:  # a figure that cannot be drawn must not fail a finished run
        drawn = None
        print(f"note: {PLOT_NAME} not drawn: {failure_text(error)}", file=sys.stderr)
    end_logging(logger, result["status"], result)
    memory = result.get("peak_memory_gib")
    print(
        f"{result['status']}: val_bpb {result['val_bpb']:.4f}"
        + (f", peak memory {memory:.2f} GiB" if memory else "")
        + f" -> {out_dir}/result.json"
        + (f", {PLOT_NAME}" if drawn else "")
    )
    return result["val_bpb"]


def single_run_report(run, out_dir: str, logger):
    """train()'s report hook in a single run: each evaluation to MLflow, and the training
    state to the run dir's checkpoint where the run keeps one."""
    keep = checkpoint_saver(out_dir, run.to_dict()) if run.trainer.checkpoint_every_eval else None

    def report(metrics: dict, state=None) -> None:
        if logger is not None:
            logger.report(metrics)
        if keep is not None and state is not None:
            keep(metrics, state)

    return report


def end_logging(logger, status: str, result: dict) -> None:
    if logger is not None:
        logger.finish(status, result)


def record_failure(logger, out_dir: str, error: BaseException, hint=lambda: "") -> None:
    """A run that did not finish: its result.json says so (status=failed), so a script that
    reads it never mistakes an old file or a missing one for this run's outcome. An
    interrupt exits 130, after its line (and `hint()`); any other error returns."""
    failed = {"status": "failed", "error": failure_text(error)}
    write_result(out_dir, failed)
    interrupted = isinstance(error, KeyboardInterrupt)
    end_logging(logger, "interrupted" if interrupted else "failed", failed)
    if interrupted:
        print(f"interrupted: status failed -> {out_dir}/result.json{hint()}", file=sys.stderr)
        sys.exit(130)


def resume_hint(out_dir: str) -> str:
    """Where an interrupted run left a checkpoint: the step and the command that goes on."""
    from hydra.core.hydra_config import HydraConfig

    if not has_checkpoint(out_dir):
        return ""
    try:
        step = read_record(out_dir)["step"]
    except ConfigError:  # the state without its record: resuming would refuse it too
        return ""
    command = resume_command(list(HydraConfig.get().overrides.task), out_dir)
    return f"; continue from step {step} with: {command}"


def run_user_function(cfg, target: str, out_dir: str) -> float | None:
    """A user's function run once, on the tree a sweep's trial of it is given, each
    report printed and sent to MLflow: what the reproduce line of a sweep of that function
    runs. Its last report goes to result.json."""
    metric = "val_bpb"  # what result.json and the last line give, as a sweep's default metric
    reports: list[dict] = []
    config = user_function_config(cfg)
    logger = start_run_logger(cfg, config, out_dir, resume=False, trainable=target)

    # a checkpoint it hands is not kept: a single run of it is not paused or retried
    def report(metrics: dict, state=None, checkpoint=None) -> None:
        metrics = plain_numbers(metrics, metric)  # a metric that is no number: BadReportError
        reports.append(metrics)
        shown = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
        )
        print(f"report {len(reports)}: {shown}", flush=True)
        if logger is not None:
            logger.report(metrics)
        value = metrics.get(metric)
        if isinstance(value, float) and not math.isfinite(value):
            raise Diverged  # as a sweep's trial of it ends

    report.checkpoint = None
    try:
        load_user_function(target)(config, report)
    except Diverged:
        value = reports[-1][metric]
        diverged = {
            "status": "diverged",
            "reason": f"{metric} was {value}",
            "reports": len(reports),
        }
        write_result(out_dir, diverged)
        end_logging(logger, "diverged", diverged)
        print(f"diverged: {metric} was {value} at report {len(reports)} -> {out_dir}/result.json")
        return None
    except BadReportError as error:
        failed = {"status": "failed", "error": str(error)}
        write_result(out_dir, failed)
        end_logging(logger, "failed", failed)
        print(
            f"error: report {len(reports) + 1}: {error} -> {out_dir}/result.json", file=sys.stderr
        )
        sys.exit(1)
    except BaseException as error:
        record_failure(logger, out_dir, error)
        raise
    last = reports[-1] if reports else {}
    write_result(out_dir, {"status": "completed", "reports": len(reports), **last})
    end_logging(logger, "completed", last)
    value = last.get("val_bpb")
    shown = f"val_bpb {value:.4f} " if isinstance(value, float) else ""
    count = f"{len(reports)} report{'s' * (len(reports) != 1)}"
    print(f"completed: {shown}after {count} -> {out_dir}/result.json")
    return value


def exit_out_of_memory(cfg, asked: str, out_dir: str) -> None:
    t = cfg.trainer
    if t.workers > 1:  # flush what Ray still streams from the ranks before the last line
        import ray

        ray.shutdown()
    print(
        f"error: out of memory (asked for {asked} more): trainer.device_batch_size="
        f"{t.device_batch_size} x model.seq_len={cfg.model.seq_len} tokens per "
        f"micro-batch do not fit on {resolve_device(t.device)}; lower trainer.device_batch_size "
        f"(gradient accumulation keeps trainer.total_batch_size) -> {out_dir}/result.json",
        file=sys.stderr,
    )
    sys.exit(1)


def failure_text(error: BaseException) -> str:
    """What result.json says ended a run; an interrupt's exception has no message."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl+C, or SIGTERM from kill)"
    return f"{type(error).__name__}: {error}"


def write_result(out_dir: str, result: dict) -> None:
    """result.json, valid JSON whatever a user's function reported (NaN: null, an object
    JSON has no form for: its text), written whole or not at all."""
    clean = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in result.items()
    }
    write_json_atomic(Path(out_dir) / "result.json", clean)


def run_ddp(cfg, out_dir: str, checkpointing: bool, logger) -> dict:
    """One run on `trainer.workers` DDP ranks: a Ray Train TorchTrainer on Ray. Rank 0
    keeps the checkpoint in the run dir, as a one-process run does, and sends each
    evaluation through a Ray queue to this process, which hands it to the MLflow logger."""
    from omegaconf import OmegaConf
    from ray.util.queue import Queue

    start_ray(cfg.ray, log_to_driver=True)
    # Why a queue actor: rank 0 may run on another node, and Ray Train passes a report to
    # the driver only through Tune. No CPU: the ranks hold all of a small machine's.
    reports = Queue(actor_options={"num_cpus": 0}) if logger is not None else None
    logged_step = 0  # the last evaluation handed to the logger

    def forward_reports() -> None:
        nonlocal reports, logged_step
        try:
            if reports is not None and (waiting := reports.qsize()):
                for metrics in reports.get_nowait_batch(waiting):
                    logger.report(metrics)
                    logged_step = metrics.get("step", logged_step)
        except Exception:  # the queue is gone with the cluster: the result has the history
            reports = None

    def report_saved_evaluations() -> None:
        # After an interrupt: between the last look at the queue and the cluster's end, rank
        # 0 may have sent an evaluation and saved its checkpoint, and the queue went with the
        # cluster. The checkpoint's record holds them: a checkpoint's step is in MLflow.
        if logger is not None and checkpointing:
            for metrics in saved_evaluations_after(out_dir, logged_step):
                logger.report(metrics)

    run_cfg = OmegaConf.to_container(cfg, resolve=True)
    run_cfg["trainer"]["checkpoint_every_eval"] = checkpointing
    threads = run_cfg["trainer"]["threads"] or 1
    fit = functools.partial(
        train_ddp,
        run_cfg,
        cpus_per_worker=threads,
        storage_path=f"{out_dir}/ray",
        name="ddp",
        inside_tune=False,
        result_path=f"{out_dir}/result.json",
        run_dir=out_dir,
        reports=reports,
        verbose=True,
    )
    interruptible(fit, forward_reports, report_saved_evaluations)
    with open(f"{out_dir}/result.json") as f:
        return json.load(f)


def interruptible(fit, tick, after_interrupt=lambda: None) -> None:
    """Runs a TorchTrainer's fit() so that Ctrl+C (or SIGTERM) ends it as it ends a
    one-process run: KeyboardInterrupt here, and a failed result.json. `tick()` runs
    every half second while it trains, once more at the end and before an interrupt
    takes the cluster down; `after_interrupt()` runs once the cluster is down.

    Why a thread: called from the main thread, Ray Train puts its own SIGINT handler in
    place, which aborts the run and exits with code 1, without a word and before the
    run's result.json is written. It leaves the signal alone in any other thread."""
    import ray

    outcome: dict = {}

    def target() -> None:
        try:
            fit()
        except BaseException as error:  # raised again in the main thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name="sweeper-ddp-fit", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(timeout=0.5)
            with interrupts_held():  # what a tick took off the queue reaches the logger
                tick()
    except KeyboardInterrupt:
        tick()  # what rank 0 sent before the interrupt
        ray.shutdown()  # the ranks stop with the cluster; rank 0's checkpoint is whole
        after_interrupt()
        raise
    tick()
    if "error" in outcome:
        raise outcome["error"]
