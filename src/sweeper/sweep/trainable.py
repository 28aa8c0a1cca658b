"""The Ray Tune function trainable: one trial of a sweep, inside a Ray worker.

It receives only plain values: the sampled parameters (the Tune config) and, through
`tune.with_parameters`, the stage's base config as a nested dict composed on the driver.
No Hydra state crosses into the worker (hydra#1126, #2772).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from sweeper.checkpoint import load_latest_state, save_state
from sweeper.sweep.space import to_builtin
from sweeper.sweep.stages import apply_params, follow_batch_size, get_dotted


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
    sampled: tuple[str, ...] = field(default_factory=tuple)
    storage: str | None = None  # the sweep's Ray storage path (DDP trials put their runs there)


class Diverged(Exception):
    """A user's function reported a non-finite metric: the trial ends as diverged."""


def trial_config(params: dict[str, Any], base: dict, ctx: TrialContext) -> dict:
    """The full run config of a trial: base + sampled values (+ LRs following the batch)."""
    config = apply_params(base, params)
    if ctx.lr_rule in ("sqrt", "linear") and ctx.base_batch:
        config = follow_batch_size(
            config, ctx.lr_rule, ctx.base_batch, list(ctx.lr_keys), set(params)
        )
    return config


def load_target(target: str):
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


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
    return metrics, diverged


def run_trial(config: dict, base: dict, ctx: TrialContext) -> None:
    from ray import tune

    params = to_builtin(dict(config))
    run_cfg = trial_config(params, base, ctx)

    def report(metrics: dict, state=None) -> None:
        metrics, diverged = penalise(metrics, ctx.metric, ctx.penalty)
        metrics["wall_time"] = time.time()  # orders reports across trials (bench/bench_search.py)
        if state is None or diverged:
            tune.report(metrics)
        else:
            with tempfile.TemporaryDirectory() as folder:
                save_state(folder, state())
                tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))
        if diverged and ctx.target:
            raise Diverged

    if ctx.target:
        with contextlib.suppress(Diverged):  # ended by the report above, as diverged
            load_target(ctx.target)(run_cfg, report)
        return

    run_cfg["trainer"]["threads"] = ctx.threads
    run_cfg["trainer"]["checkpoint_every_eval"] = ctx.checkpoint
    if run_cfg["trainer"]["workers"] > 1:
        from sweeper.distributed import train_ddp

        train_ddp(
            run_cfg,
            cpus_per_worker=ctx.threads,
            storage_path=ctx.storage,
            name=f"ddp_{tune.get_context().get_trial_id()}",
            inside_tune=True,
            penalise=functools.partial(penalise, metric=ctx.metric, penalty=ctx.penalty),
        )
        return

    import torch

    from sweeper.train import train

    torch.set_num_threads(ctx.threads)
    resume_state = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:  # a paused (Hyperband/BOHB) or retried trial
        with checkpoint.as_directory() as folder:
            resume_state = load_latest_state(folder)
    train(run_cfg, report, resume_state=resume_state, verbose=False)


def batch_of(base: dict) -> float | None:
    return get_dotted(base, "trainer.total_batch_size")
