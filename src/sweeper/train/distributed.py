"""DDP runs (`trainer.workers > 1`) through Ray Train: a TorchTrainer with one worker per
rank (gloo on CPU, NCCL on GPU) runs the same `train()` on every rank.

Inside a sweep, the Tune trial launches the TorchTrainer and Ray's TuneReportCallback
forwards rank 0's reports (and checkpoints) to Tune, so ASHA and the MLflow run see one
stream (Ray 2.60's Train V2 pattern). `trainer.workers=1` never comes here: a TorchTrainer
costs ~20 s of start-up per trial.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import tempfile
import threading
from typing import Any

from sweeper.files import write_json_atomic


def _worker_loop(config: dict) -> None:
    """Runs on every rank: the process group is up (Ray Train set it up)."""
    import ray.train
    import torch
    import torch.distributed as dist

    from sweeper.config.schema import load_run_config
    from sweeper.train.checkpoint import load_latest_state, save_state
    from sweeper.train.device import out_of_memory
    from sweeper.train.loop import train
    from sweeper.train.run_checkpoint import checkpoint_saver, load_resume_state

    # Ray Train logs every report's metrics at INFO through a logger outside `ray.train`
    # (LoggingConfig's level misses it), so a rank's root logger keeps to warnings
    logging.getLogger().setLevel(logging.WARNING)
    rank = ray.train.get_context().get_world_rank()
    torch.set_num_threads(config["threads"])
    resume_state = None
    checkpoint = ray.train.get_checkpoint()
    run_dir = config.get("run_dir")  # a single run's: its checkpoint lives there
    if checkpoint is not None:  # a paused or retried trial: restores on any world size
        with checkpoint.as_directory() as folder:
            resume_state = load_latest_state(folder)
    elif run_dir and config["run"]["trainer"]["resume"]:
        resume_state = load_resume_state(run_dir)
    penalise = config.get("penalise")
    keep = checkpoint_saver(run_dir, load_run_config(config["run"]).to_dict()) if run_dir else None

    reports = config.get("reports")  # a single run's queue to the driver's MLflow logger
    saves_wait = None
    if run_dir and config["run"]["trainer"]["checkpoint_every_eval"]:
        # Rank 0's save of a big model (d20: 5-6.5 GB, fsynced) can outlast the process
        # group's short timeout (trainer.dist_timeout_s, for hung ranks): the other ranks
        # wait for it on a group of their own whose timeout outlasts any save
        saves_wait = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30))

    def report(metrics: dict, state=None) -> None:
        if run_dir:
            # A single run skips ray.train.report (~2 s each, and nobody reads it): rank 0
            # sends each evaluation to the driver, then keeps the checkpoint in the run dir
            # (so a checkpoint's step is in MLflow); the other ranks wait for the save.
            if rank == 0:
                if reports is not None:
                    reports.put_nowait(dict(metrics))
                if state is not None:
                    keep(metrics, state)
            if state is not None and saves_wait is not None:
                dist.barrier(group=saves_wait)
            return
        metrics, diverged = penalise(metrics) if penalise else (metrics, False)
        # every rank reports (Ray Train synchronises on it); only rank 0 checkpoints
        if state is None or rank != 0 or diverged:
            ray.train.report(metrics)
        else:
            with tempfile.TemporaryDirectory() as folder:
                save_state(folder, state())
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))

    try:
        result = train(config["run"], report, resume_state=resume_state, verbose=config["verbose"])
    except Exception as error:
        asked = out_of_memory(error)
        if not (asked and config.get("result_path")):
            raise  # a bug keeps its traceback; inside Tune the trial fails with it
        # A batch too big for the device, in a single run: every rank fails at the same
        # allocation, before any collective. Each returns quietly and rank 0 records it:
        # raising would stream every rank's traceback ahead of the driver's one line.
        result = {
            "status": "failed",
            "error": f"{type(error).__name__}: {error}",
            "out_of_memory": asked,
        }
    if rank == 0 and config.get("result_path"):
        write_json_atomic(config["result_path"], result)


CONTROLLER_FAILURE_LIMIT = 3
WORKER_START_TIMEOUT_S = 180
HEALTH_CHECK_INTERVAL_S = 0.2
REAP_INTERVAL_S = 2.0


def orphaned_placement_groups() -> list:
    """Placement groups whose creating actor died without removing them.

    A stopped Tune trial is killed with its TorchTrainer's controller, and its workers'
    placement group stays reserved: Ray Train's PlacementGroupCleaner asks the State API,
    which needs the dashboard (and asks the newest of several local clusters), so on a
    2-CPU cluster the next DDP trial waited forever. Only the GCS's private accessor gives
    a group's creator; a change in Ray's internals makes this "nothing to remove", never
    an error.
    """
    import ray
    from ray.util.placement_group import PlacementGroup

    try:
        from ray._private.state import state
        from ray.core.generated import gcs_pb2

        table = state._connect_and_get_accessor().get_placement_group_table()
    except Exception:
        return []
    job = ray.get_runtime_context().get_job_id()  # never another job's groups
    orphans = []
    for raw in table:
        info = gcs_pb2.PlacementGroupTableData.FromString(raw)
        by_an_actor = info.creator_actor_id.strip(b"\xff") != b""  # not the driver (nil id)
        if (
            by_an_actor
            and info.creator_actor_dead
            and info.creator_job_id.hex() == job
            and not info.is_detached
            and info.state != gcs_pb2.PlacementGroupTableData.REMOVED
        ):
            orphans.append(PlacementGroup(ray.PlacementGroupID(info.placement_group_id)))
    return orphans


@contextlib.contextmanager
def placement_group_reaper(interval_s: float = REAP_INTERVAL_S):
    """While DDP trials run, remove the placement groups of killed trials every few seconds."""
    from ray.util import remove_placement_group

    stop = threading.Event()

    def reap() -> None:
        while not stop.wait(interval_s):
            with contextlib.suppress(Exception):  # a GCS hiccup: try again next time
                for group in orphaned_placement_groups():
                    remove_placement_group(group)

    thread = threading.Thread(target=reap, name="placement-group-reaper", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=interval_s + 5)


def train_ddp(
    run_cfg: dict,
    *,
    cpus_per_worker: float,
    storage_path: str,
    name: str,
    inside_tune: bool,
    penalise=None,
    result_path: str | None = None,
    run_dir: str | None = None,
    reports=None,
    verbose: bool = False,
    loop=_worker_loop,
) -> Any:
    """Fit a TorchTrainer with `trainer.workers` ranks; returns Ray Train's Result.
    `run_dir`: a single run's, where rank 0 keeps its checkpoint (run_checkpoint.py).
    `reports`: a single run's `ray.util.queue.Queue`, where rank 0 puts each evaluation."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer_cfg = run_cfg["trainer"]
    workers = int(trainer_cfg["workers"])
    use_gpu = trainer_cfg["device"] == "cuda" or (
        trainer_cfg["device"] == "auto" and ray.cluster_resources().get("GPU", 0) >= workers
    )
    callbacks, resume = [], None
    if inside_tune:
        from ray import tune
        from ray.tune.integration.ray_train import TuneReportCallback

        callbacks.append(TuneReportCallback())
        resume = tune.get_checkpoint()
    resources = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    # Ray Train gives its workers 60 s to start; on a busy small machine, starting the
    # Python processes that import torch can take longer. Ray passes this on to its controller.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(WORKER_START_TIMEOUT_S))
    # Ray Train's controller polls the ranks' reports every 2 s by default, and a rank's
    # report waits for it; every 0.2 s a DDP trial's reports cost far less (BENCHMARKS.md).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(HEALTH_CHECK_INTERVAL_S))
    # Ray Train's print patch sends a rank's print() to stderr as well as stdout, so each
    # progress line reached a terminal twice (the ranks inherit this, like the above).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    trainer = TorchTrainer(
        loop,
        train_loop_config={
            "run": run_cfg,
            "threads": max(1, int(cpus_per_worker)),
            "penalise": penalise,
            "result_path": result_path,
            "run_dir": run_dir,
            "reports": reports,
            "verbose": verbose,
        },
        # a short process-group timeout: a hung rank fails the run within a minute,
        # not after NCCL's 10 or gloo's 30 default minutes
        torch_config=TorchConfig(
            backend="nccl" if use_gpu else "gloo", timeout_s=int(trainer_cfg["dist_timeout_s"])
        ),
        scaling_config=ray.train.ScalingConfig(
            num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage_path,
            callbacks=callbacks,
            # its INFO lines (each report's metrics, each worker group step) crowded out
            # the run's own progress; they stay in Ray's log files and the dashboard
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            # Tune owns retries; a worker group that cannot start (its default: retried
            # forever, 60 s at a time) fails the trial after a few tries instead
            failure_config=ray.train.FailureConfig(
                max_failures=0, controller_failure_limit=CONTROLLER_FAILURE_LIMIT
            ),
        ),
        resume_from_checkpoint=resume,
    )
    return trainer.fit()
