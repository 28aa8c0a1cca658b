"""`python -m sweeper [+sweep=NAME] [key=value ...]`: one training run, or a sweep.

The overrides are composed and validated first (a mistake is one line, exit 2, nothing
written); then Hydra runs the job in its run dir as usual.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import threading
from pathlib import Path

from sweeper.config.compose import chosen_budgets, compose, other_budgets_cleared
from sweeper.config.errors import ConfigError, fail, one_line
from sweeper.config.paths import config_dir
from sweeper.config.schema import check_optimizer_reads, check_platform_sections, load_run_config
from sweeper.signals import (
    end_quietly_when_output_closes,
    interrupts_held,
    skip_the_collection_at_exit,
    stop_on_sigterm_as_on_ctrl_c,
)

# Hydra's flags that print something of their own and run nothing
HYDRA_FLAGS = ("--help", "-h", "--hydra-help", "--version", "--info", "-i")
HYDRA_FLAGS += ("--shell-completion", "-sc")
# flags that would point Hydra at another primary config than conf/config.yaml, which every
# check here composes: refused, with the way to add configs of one's own instead
CONFIG_SOURCE_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
CONFIG_SOURCE_FLAGS += ("--experimental-rerun",)
# Hydra's flags that print the composed config instead of running it: the config they print
# is checked as a run's would be, so that `--cfg job` shows no config a run would refuse
PRINT_FLAGS = {"--cfg": 1, "-c": 1, "--package": 1, "-p": 1, "--resolve": 0}
MULTIRUN_FLAGS = ("-m", "--multirun")
RUN_FLAGS = ("-r", "--run")  # Hydra's default mode, said out loud
# Hydra runs one of these modes per command
MODE_FLAGS = (
    (RUN_FLAGS, "--run"),
    (MULTIRUN_FLAGS, "--multirun"),
    (("--cfg", "-c"), "--cfg"),
    (("--info", "-i"), "--info"),
    (("--shell-completion", "-sc"), "--shell-completion"),
)
MAX_CHECKED_JOBS = 64  # ~0.3 s each
# how often a run evaluates: in a sweep, sweep.reports_per_trial decides
EVAL_CADENCE_KEYS = ("trainer.num_evals", "trainer.eval_every")


def run_job(cfg) -> float | None:
    """Hydra's task function: the run (or sweep) in the Hydra run dir."""
    from hydra.core.hydra_config import HydraConfig

    out_dir = HydraConfig.get().runtime.output_dir
    if "sweep" in cfg:
        from sweeper.sweep.runner import SweepFailed, run_sweep

        try:
            return run_sweep(cfg, out_dir)
        except ConfigError as error:  # found inside the job (an unreachable MLflow server)
            fail(str(error))
        except SweepFailed as error:  # not the command's fault: exit 1, not 2
            print(f"error: {error}", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt:
            sys.exit(130)  # the engine said where the state is and how to resume
    from sweeper.sweep.plan import trainable_target

    if target := trainable_target(cfg):
        return run_user_function(cfg, target, out_dir)
    return run_single(cfg, out_dir)


def run_single(cfg, out_dir: str) -> float | None:
    """One run of sweeper's own training (on `trainer.workers` DDP ranks), tracked in
    MLflow as one run: its result.json, curves.png and, where asked, its checkpoint."""
    from sweeper.tracking.run_logger import start_run_logger

    try:
        run = load_run_config(cfg)
    except ConfigError as error:  # a multirun job past MAX_CHECKED_JOBS is checked here
        fail(str(error))
    # a resumed run keeps checkpointing: it was started with checkpoints on
    run.trainer.checkpoint_every_eval |= run.trainer.resume
    logger = start_run_logger(cfg, run.to_dict(), out_dir, run.trainer.resume)
    try:
        if run.trainer.workers > 1:
            result = run_ddp(cfg, out_dir, run.trainer.checkpoint_every_eval, logger)
        else:
            from sweeper.train.loop import train
            from sweeper.train.run_checkpoint import load_resume_state

            resume_state = load_resume_state(out_dir) if run.trainer.resume else None
            report = single_run_report(run, out_dir, logger)
            result = train(run, report, resume_state=resume_state)
    except ConfigError as error:  # found inside the job (a multirun's late job): bad input
        end_logging(logger, "failed", {"error": str(error)})
        fail(str(error))
    except (Exception, KeyboardInterrupt) as error:
        # the run did not finish: its result.json says so (status=failed), so a script that
        # reads it never mistakes an old file or a missing one for this run's outcome
        failed = {"status": "failed", "error": failure_text(error)}
        write_result(out_dir, failed)
        interrupted = isinstance(error, KeyboardInterrupt)
        end_logging(logger, "interrupted" if interrupted else "failed", failed)
        if interrupted:
            print(
                f"interrupted: status failed -> {out_dir}/result.json{resume_hint(out_dir)}",
                file=sys.stderr,
            )
            sys.exit(130)
        from sweeper.train.device import out_of_memory

        if asked := out_of_memory(error):  # a batch too big for the machine: not a bug
            exit_out_of_memory(cfg, asked, out_dir)
        raise
    if run.trainer.workers == 1:  # a DDP run's rank 0 writes its own (distributed.py)
        write_result(out_dir, result)
    elif result.get("out_of_memory"):  # the ranks recorded it and returned quietly
        end_logging(logger, "failed", result)
        exit_out_of_memory(cfg, result["out_of_memory"], out_dir)
    from sweeper.report.run_plot import PLOT_NAME, plot_run

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
    from sweeper.train.run_checkpoint import checkpoint_saver

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


def resume_hint(out_dir: str) -> str:
    """Where an interrupted run left a checkpoint: the step and the command that goes on."""
    from hydra.core.hydra_config import HydraConfig

    from sweeper.train.run_checkpoint import has_checkpoint, read_record, resume_command

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
    from sweeper.sweep.plan import load_user_function, user_function_config
    from sweeper.sweep.trainable import BadReportError, Diverged, plain_numbers
    from sweeper.tracking.run_logger import start_run_logger

    metric = "val_bpb"  # what result.json and the last line give, as a sweep's default metric
    reports: list[dict] = []
    config = user_function_config(cfg)
    logger = start_run_logger(cfg, config, out_dir, resume=False, trainable=target)

    def report(metrics: dict, state=None) -> None:  # `state`: a checkpoint, not kept here
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
        failed = {"status": "failed", "error": failure_text(error)}
        write_result(out_dir, failed)
        interrupted = isinstance(error, KeyboardInterrupt)
        end_logging(logger, "interrupted" if interrupted else "failed", failed)
        if interrupted:
            print(f"interrupted: status failed -> {out_dir}/result.json", file=sys.stderr)
            sys.exit(130)
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
    from sweeper.train.device import resolve_device

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
    text = json.dumps(clean, indent=2, default=str)
    with open(f"{out_dir}/result.json", "w") as f:
        f.write(text)


def run_ddp(cfg, out_dir: str, checkpointing: bool, logger) -> dict:
    """One run on `trainer.workers` DDP ranks: a Ray Train TorchTrainer on Ray. Rank 0
    keeps the checkpoint in the run dir, as a one-process run does, and sends each
    evaluation through a Ray queue to this process, which hands it to the MLflow logger."""
    from omegaconf import OmegaConf
    from ray.util.queue import Queue

    from sweeper.sweep.cluster import start_ray
    from sweeper.train.distributed import train_ddp
    from sweeper.train.run_checkpoint import saved_evaluations_after

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


def validate(overrides: list[str], printing: bool = False):
    """Every check of a run or sweep before Hydra starts it; returns the composed config.
    printing: `--cfg` prints the config and runs nothing, so what only matters to a run
    dir is not checked."""
    from omegaconf import OmegaConf

    cfg = compose(overrides)
    if "sweep" in cfg and not OmegaConf.is_dict(cfg.sweep):  # a sweep file that is a list
        raise ConfigError(
            f"sweep: a sweep file holds a mapping of keys (name, stages, ...), got "
            f"{type(OmegaConf.to_container(cfg.sweep)).__name__ if cfg.sweep is not None else 'null'}"
        )
    check_platform_sections(cfg)
    run = load_run_config(cfg)
    if not is_users_function(cfg):  # a user's function reads its optimizer section its way
        for override in overrides:
            if not override.startswith("~"):  # removing a key sets nothing
                key = override.split("=", 1)[0].lstrip("+")
                check_optimizer_reads(run.optimizer.name, key, override)
    run_dir = None if printing else hydra_run_dir(overrides)
    chdir = hydra_run_dir(overrides, key="hydra.job.chdir")
    chdir = chdir.lower() if chdir in ("True", "False") else chdir  # as YAML writes a bool
    if chdir is not None and chdir.strip().lower() not in ("false", "null", "0", "no", "off"):
        # it was checked here, from where the command starts: a relative data.path or
        # MLflow store would name another file, or none, from inside the run dir
        raise ConfigError(
            f"hydra.job.chdir={chdir}: sweeper writes into the run dir itself and reads "
            "relative paths (data.path, the MLflow store) from where it starts; leave it false"
        )
    if run_dir is not None:
        check_run_dir(run_dir)
    if run.trainer.resume:
        check_single_run_resume(cfg, run, run_dir, printing)
    elif run_dir and "sweep" not in cfg:
        from sweeper.train.run_checkpoint import check_new_run_dir

        check_new_run_dir(run_dir)
    joins_a_cluster = bool(cfg.get("ray", {}).get("address"))
    if run.trainer.device == "cuda" and not (joins_a_cluster and "sweep" in cfg):
        import torch

        if not torch.cuda.is_available():  # trials that run here would all fail on it
            raise ConfigError(
                "trainer.device=cuda but torch sees no CUDA device here; "
                "use trainer.device=auto or cpu"
            )
    if "sweep" not in cfg:  # a sweep writes its own budget into every trial and checks it
        from sweeper.train.budget import check_budget

        check_budget(run)
        if not is_users_function(cfg) and not (joins_a_cluster and run.trainer.workers > 1):
            from sweeper.train.budget import check_model_fits
            from sweeper.train.device import resolve_device

            # here, where the run will train; CPU DDP ranks each hold a copy in its memory
            ranks = run.trainer.workers if resolve_device(run.trainer.device).type == "cpu" else 1
            check_model_fits(
                run, copies=ranks, copies_are="DDP ranks", fewer=lambda n: f"trainer.workers={n}"
            )
    if run.data.name == "shards":
        from sweeper.train.data import check_shards

        check_shards(run.data, run.model.seq_len)
    elif run.data.name == "stdlib" and not is_users_function(cfg):  # it reads its own data
        from sweeper.train.data import check_stdlib_split

        check_stdlib_split(run.data.val_every_n_files, run.model.seq_len)
    if run.trainer.workers > 1 and "sweep" not in cfg and not joins_a_cluster:
        from sweeper.sweep.cluster import local_cluster_size

        # Ray Train would wait for ever for ranks the local cluster cannot place
        cpus = local_cluster_size(cfg.ray)[0]
        need = run.trainer.workers * (run.trainer.threads or 1)
        if need > cpus:
            raise ConfigError(
                f"trainer.workers={run.trainer.workers} ranks x {run.trainer.threads or 1} "
                f"CPU (trainer.threads) need {need} CPUs, but the local Ray cluster has "
                f"{cpus:g} (ray.num_cpus)"
            )
    if not joins_a_cluster and ("sweep" in cfg or run.trainer.workers > 1):
        from sweeper.sweep.cluster import check_local_cluster

        check_local_cluster(cfg.ray)
    if joins_a_cluster and ("sweep" in cfg or run.trainer.workers > 1):
        from sweeper.sweep.cluster import probe

        probe(str(cfg.ray.address))  # an unreachable cluster: one line, nothing written
    resumes = "sweep" in cfg and bool(cfg.sweep.get("resume"))
    if resumes and not run_dir and not printing:  # Hydra would make a new dir: a new sweep
        raise ConfigError(
            "sweep.resume=true continues the sweep in the run dir it names: add "
            "hydra.run.dir=<the interrupted sweep's dir> (its path is in the line it printed "
            "when it stopped)"
        )
    if resumes and run_dir and not printing and not os.path.isdir(run_dir):
        # Hydra would make it and a whole new sweep would start: a mistyped path reads so
        raise ConfigError(
            f"sweep.resume=true: hydra.run.dir={run_dir} does not exist, so holds no sweep "
            "to resume; name the interrupted sweep's dir"
        )
    if "sweep" not in cfg:
        check_single_run(cfg)
    if run_dir and not resumes:
        from pathlib import Path

        from sweeper.sweep.state import STATE_NAME

        # a new sweep or a single run there would overwrite the old sweep's record (Hydra
        # rewrites .hydra/; a sweep, its state too), and with it the way to resume it
        if (Path(run_dir) / STATE_NAME).exists():
            what = "continue it with sweep.resume=true, or " if "sweep" in cfg else ""
            raise ConfigError(
                f"hydra.run.dir={run_dir} holds a sweep already ({STATE_NAME}): "
                f"{what}choose another hydra.run.dir"
            )
        # and a new run or sweep there would write over a single run's record (a resumed
        # run goes on from its checkpoint, checked above)
        if (Path(run_dir) / "result.json").exists() and not run.trainer.resume:
            raise ConfigError(
                f"hydra.run.dir={run_dir} holds a run already (result.json): a new "
                f"{'sweep' if 'sweep' in cfg else 'run'} there would write over its record; "
                "choose another hydra.run.dir"
            )
    if "sweep" in cfg:
        from sweeper.sweep.plan import trainable_target, validate_sweep
        from sweeper.tracking.mlflow_store import check_config

        named = [
            f"trainer.{k}={v}" for k, v in chosen_budgets(overrides).items() if v.lower() != "null"
        ]
        if named and not trainable_target(cfg):  # base_config would drop it unseen
            raise ConfigError(
                f"{named[0]}: a sweep gives every trial the same budget, "
                "sweep.budget.tokens_per_trial (or sweep.budget.flops_per_trial); set that"
            )
        cadence = [o for o in overrides if o.lstrip("+").split("=")[0] in EVAL_CADENCE_KEYS]
        if cadence and not trainable_target(cfg):  # base_config sets num_evals over it
            raise ConfigError(
                f"{cadence[0]}: a sweep's trials evaluate (and report) "
                "sweep.reports_per_trial times, or a stage's own "
                "sweep.stages.N.reports_per_trial; set that"
            )
        spec = validate_sweep(cfg)
        check_config(cfg)  # an unreachable MLflow server: one line, nothing written
        if spec.resume and run_dir:
            # Hydra rewrites the run dir's .hydra/ files as the job starts: a resume of a
            # different sweep is refused before that, with the record of the old one intact
            from pathlib import Path

            from sweeper.sweep.plan import base_config, resumable_state

            found = resumable_state(
                Path(run_dir).resolve(), spec, base_config(cfg, spec, trainable_target(cfg))
            )
            if found is None and (Path(run_dir) / "result.json").exists():
                # a single run's dir: a new sweep would start there, over its record
                raise ConfigError(
                    f"sweep.resume=true: hydra.run.dir={run_dir} holds a single run "
                    "(result.json), not a sweep; name the interrupted sweep's dir"
                )
    return cfg


def print_plan(cfg, overrides: list[str]) -> None:
    """`sweep.dry_run=true`: the sweep's plan (sweep/plan.py), with nothing started."""
    from pathlib import Path

    from sweeper.sweep.cluster import local_cluster_size
    from sweeper.sweep.estimate import plan_text
    from sweeper.sweep.plan import base_config, slots_for, trainable_target, validate_sweep

    spec = validate_sweep(cfg)
    target = trainable_target(cfg)
    base = base_config(cfg, spec, target)
    slots = None
    if not cfg.get("ray", {}).get("address"):
        workers = 1 if target else int(cfg.trainer.workers)
        slots = slots_for(spec, workers, *local_cluster_size(cfg.ray))
    state, out = None, None
    if run_dir := hydra_run_dir(overrides):
        out = Path(run_dir).resolve()
        if spec.resume:
            from sweeper.sweep.plan import resumable_state

            state = resumable_state(out, spec, base)
    speed = None
    local_cpus = slots is not None and not spec.gpus_per_trial and cfg.trainer.workers == 1
    if state is not None:
        from sweeper.sweep.runner import finished

        local_cpus = local_cpus and not finished(spec, state, base)  # nothing left to time
    if local_cpus and not target:
        from sweeper.report.markdown import flops_text
        from sweeper.sweep.estimate import PROBE_MAX_FLOPS, measure_speed

        # trials on this machine's CPUs: their minutes can be measured here, in seconds
        print("timing a few training steps of the base config here ...", flush=True)
        try:
            speed = measure_speed(base, spec.trial_threads)
            if speed is None:
                most = flops_text(PROBE_MAX_FLOPS)
                print(
                    f"  (not timed: a few steps of this model train over {most} FLOPs, more "
                    "than a dry run spends; the plan gives FLOPs only)"
                )
        except (RuntimeError, OSError, MemoryError) as error:  # the plan stands without it
            print(f"  (not timed: {one_line(error)})")
    print(plan_text(spec, base, target, slots, state, out, speed))


def is_dry_run(cfg) -> bool:
    return "sweep" in cfg and bool(cfg.sweep.get("dry_run"))


def check_single_run_resume(cfg, run, run_dir: str | None, printing: bool) -> None:
    """trainer.resume=true: a single run of sweeper's own training, in a run dir that holds
    its checkpoint (run_checkpoint.check_resumable_run)."""
    from sweeper.sweep.plan import trainable_target
    from sweeper.train.run_checkpoint import check_resumable_run

    if "sweep" in cfg:
        raise ConfigError(
            "trainer.resume=true goes on with a single run; a sweep resumes with sweep.resume=true"
        )
    if target := trainable_target(cfg):
        raise ConfigError(
            f"trainer.resume=true goes on with sweeper's own training, which "
            f"trainable._target_={target} replaces; it keeps no checkpoint of sweeper's"
        )
    if printing:
        return
    if not run_dir:  # Hydra would make a new, empty dir
        raise ConfigError(
            "trainer.resume=true continues the run in the run dir it names: add "
            "hydra.run.dir=<the interrupted run's dir> (its path is in the line it printed "
            "when it stopped)"
        )
    check_resumable_run(run_dir, run.to_dict())


def is_users_function(cfg) -> bool:
    from sweeper.sweep.plan import trainable_target

    return trainable_target(cfg) is not None


def check_run_dir(run_dir: str, key: str = "hydra.run.dir") -> None:
    """hydra.run.dir (or `key`) as given: a directory there, or one that can be made there."""
    if not run_dir.strip():  # Hydra would run in the working directory, over its files
        raise ConfigError(f"{key} is empty; name a directory for the run's files")
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"{key}={run_dir} is a file, not a directory")
    ancestor = os.path.dirname(os.path.abspath(run_dir))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{key}={run_dir} cannot be made: {ancestor} is a file")
    if not os.path.isdir(run_dir) and not can_make_a_dir_in(ancestor):
        raise ConfigError(f"{key}={run_dir} cannot be made: {ancestor} is not writable")


def can_make_a_dir_in(parent: str) -> bool:
    """Whether a directory can be made in `parent`, by making one and removing it: the
    permission bits (os.access) pass for root where the kernel still refuses (/sys, /proc,
    read-only mounts), and Hydra's own mkdir then fails with a traceback."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(dir=parent))
    except OSError:
        return False
    return True


def check_multirun_dir(overrides: list[str]) -> None:
    """hydra.sweep.dir as a -m command sets it: an earlier multirun's dir would have its
    jobs' records (result.json, a sweep's state, .hydra/) written over, job by job. Hydra's
    default dir is new each time (it holds the time); a resumed job goes on from its own."""
    sweep_dir = hydra_run_dir(overrides, key="hydra.sweep.dir")
    if sweep_dir is None:
        return
    check_run_dir(sweep_dir, key="hydra.sweep.dir")
    resumes = any(
        o.lstrip("+").split("=")[0] in ("sweep.resume", "trainer.resume")
        and o.split("=", 1)[1].lower() == "true"
        for o in overrides
    )
    earlier = Path(sweep_dir) / "multirun.yaml"  # what Hydra writes there first
    if earlier.exists() and not resumes:
        raise ConfigError(
            f"hydra.sweep.dir={sweep_dir} holds an earlier multirun ({earlier.name}): its "
            "jobs' records would be written over; choose another hydra.sweep.dir"
        )


def check_single_run(cfg) -> None:
    """What a sweep checks is still checked in a single run: a user's function (run once,
    as a sweep's reproduce line does) must import and take (config, report), and a
    tracking URI no MLflow store takes is wrong wherever it is written. A single run logs
    to MLflow as a sweep's trials do, so its store is probed as a sweep's is (reachable,
    writable)."""
    from sweeper.sweep.plan import load_user_function, trainable_target
    from sweeper.tracking.mlflow_store import check_config_in_a_process

    if target := trainable_target(cfg):
        load_user_function(target)
    check_config_in_a_process(cfg)


def without_print_flags(args: list[str]) -> list[str]:
    """args less Hydra's PRINT_FLAGS and the value each takes (`--cfg job`, `--cfg=job`)."""
    kept, skip = [], 0
    for arg in args:
        if skip:
            skip -= 1
        elif arg.split("=")[0] in PRINT_FLAGS:
            skip = 0 if "=" in arg else PRINT_FLAGS[arg]
        else:
            kept.append(arg)
    return kept


def hydra_run_dir(overrides: list[str], key: str = "hydra.run.dir") -> str | None:
    """hydra.run.dir (or `key`) as the job will read it (cli.hydra_setting), as a string;
    None at Hydra's default, a new dir each time."""
    from sweeper.config.compose import hydra_setting

    value = hydra_setting(overrides, key)
    return None if value is None else str(value)


def multirun_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs a `-m` run launches: Hydra's basic sweeper's own expansion of `a,b`,
    `range()` and `choice()` into one override list per job. Empty where another sweeper
    plugin is chosen (its syntax is its own): those jobs are checked as they start."""
    if any(o.lstrip("+").startswith("hydra/sweeper=") for o in overrides):
        return []
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from sweeper.config.compose import check_syntax

    check_syntax(overrides)  # a syntax error named by its override, as without -m
    try:
        # glob() lists a config group's options, which takes Hydra's config loader (the
        # same one Hydra's own sweeper expands it with)
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
            batches = BasicSweeper.split_arguments(parsed, None)
    except HydraException as error:
        raise ConfigError(str(error).splitlines()[0]) from None
    for override in parsed:
        if override.is_sweep_override() and not list(override.sweep_string_iterator()):
            raise ConfigError(f"{override.input_line}: sweeps over no value, so no job would run")
    return [job for batch in batches for job in batch]


def main() -> None:
    skip_the_collection_at_exit()
    stop_on_sigterm_as_on_ctrl_c()
    args = sys.argv[1:]
    if source := next((a for a in args if a.split("=")[0] in CONFIG_SOURCE_FLAGS), None):
        fail(
            f"{source.split('=')[0]}: sweeper composes its own conf/; add config files of "
            "your own with hydra.searchpath=[file://DIR] (e.g. DIR/sweep/NAME.yaml for "
            "+sweep=NAME)"
        )
    modes = {mode for a in args for flags, mode in MODE_FLAGS if a.split("=")[0] in flags}
    for at, arg in enumerate(args):  # argparse's refusal is its whole usage block
        flag, _, value = arg.partition("=")
        if flag in ("--cfg", "-c"):
            value = value or (args[at + 1] if at + 1 < len(args) else "")
            if value not in ("job", "hydra", "all"):
                fail(f"{' '.join(filter(None, [flag, value]))}: Hydra prints job, hydra or all")
    completes = "--shell-completion" in modes
    if completes and not any(a.split("=")[0] in ("install", "uninstall", "query") for a in args):
        fail(  # Hydra raises a ValueError: a traceback
            "--shell-completion: add what to do, install=SHELL, uninstall=SHELL or query=..., "
            "e.g. --shell-completion install=bash"
        )
    if len(modes) > 1:  # Hydra's own check raises a ValueError: a traceback
        fail(f"{' and '.join(sorted(modes))}: Hydra takes only one of them at a time")
    multirun = any(a in MULTIRUN_FLAGS for a in args)
    mode_flags = [a for a in args if a in MULTIRUN_FLAGS + RUN_FLAGS]
    overrides = without_print_flags([a for a in args if a not in mode_flags])
    printing = len(overrides) < len(args) - len(mode_flags)
    if cleared := other_budgets_cleared(overrides):  # Hydra composes from sys.argv too
        # beside the user's own overrides: Hydra's parser takes them as one run of words,
        # and one after a flag (`... --cfg job trainer.X=null`) is refused
        at = sys.argv.index(overrides[-1]) + 1
        sys.argv[at:at] = cleared
        overrides += cleared
    asks_hydra = any(a.split("=")[0] in HYDRA_FLAGS for a in overrides)
    if printing or asks_hydra:  # prints and runs nothing: `--help | head` ends quietly
        end_quietly_when_output_closes()
    if not asks_hydra:
        try:
            # a multirun's jobs are checked before Hydra makes its multirun dir; the first
            # MAX_CHECKED_JOBS of a huge product, the rest as each job starts (run_job)
            jobs = multirun_jobs(overrides) if multirun else [overrides]
            if multirun and not printing:  # a job's overrides: Hydra's dirs resolve there
                check_multirun_dir(jobs[0] if jobs else overrides)
            checked = [(job, validate(job, printing)) for job in jobs[:MAX_CHECKED_JOBS]]
            if not printing and any(is_dry_run(cfg) for _, cfg in checked):
                if len(jobs) > MAX_CHECKED_JOBS:
                    raise ConfigError(
                        f"sweep.dry_run=true: {len(jobs)} multirun jobs; plan at most "
                        f"{MAX_CHECKED_JOBS} at once"
                    )
                for number, (job, cfg) in enumerate(checked):
                    if multirun:
                        print(f"{'' if number == 0 else chr(10)}job {number}: {' '.join(job)}")
                    if is_dry_run(cfg):
                        print_plan(cfg, job)
                    else:
                        print("  a single run (sweep.dry_run plans sweeps)")
                return
        except ConfigError as error:
            fail(str(error))
    import hydra

    hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")(run_job)()


if __name__ == "__main__":
    main()
