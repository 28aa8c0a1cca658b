"""DDP runs (`trainer.workers > 1`) through Ray Train: a TorchTrainer with one worker per
rank (gloo on CPU, NCCL on GPU) runs the same `train()` on every rank.

Inside a sweep, the Tune trial launches the TorchTrainer and Ray's TuneReportCallback
forwards rank 0's reports (and checkpoints) to Tune, so ASHA and the MLflow run see one
stream (Ray 2.60's Train V2 pattern). `trainer.workers=1` never comes here: a TorchTrainer
costs ~20 s of start-up per trial.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any


def _worker_loop(config: dict) -> None:
    """Runs on every rank: the process group is up (Ray Train set it up)."""
    import ray.train
    import torch

    from sweeper.checkpoint import load_latest_state, save_state
    from sweeper.train import train

    rank = ray.train.get_context().get_world_rank()
    torch.set_num_threads(config["threads"])
    resume_state = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # a paused or retried trial: restores on any world size
        with checkpoint.as_directory() as folder:
            resume_state = load_latest_state(folder)
    penalise = config.get("penalise")

    def report(metrics: dict, state=None) -> None:
        metrics, diverged = penalise(metrics) if penalise else (metrics, False)
        # every rank reports (Ray Train synchronises on it); only rank 0 checkpoints
        if state is not None and rank == 0 and not diverged:
            with tempfile.TemporaryDirectory() as folder:
                save_state(folder, state())
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
        else:
            ray.train.report(metrics)

    result = train(config["run"], report, resume_state=resume_state, verbose=config["verbose"])
    if rank == 0 and config.get("result_path"):
        with open(config["result_path"], "w") as f:
            json.dump(result, f, indent=2)


def train_ddp(
    run_cfg: dict,
    *,
    cpus_per_worker: float,
    storage_path: str,
    name: str,
    inside_tune: bool,
    penalise=None,
    result_path: str | None = None,
    verbose: bool = False,
    loop=_worker_loop,
) -> Any:
    """Fit a TorchTrainer with `trainer.workers` ranks; returns Ray Train's Result."""
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
    trainer = TorchTrainer(
        loop,
        train_loop_config={
            "run": run_cfg,
            "threads": max(1, int(cpus_per_worker)),
            "penalise": penalise,
            "result_path": result_path,
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
            failure_config=ray.train.FailureConfig(max_failures=0),  # Tune owns retries
        ),
        resume_from_checkpoint=resume,
    )
    return trainer.fit()
