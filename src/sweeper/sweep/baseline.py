"""Runs of a whole config outside Tune, holding one trial's resources on Ray: the baseline
(the unmodified config under the same budget) and the confirmation runs."""

from __future__ import annotations

import json
import math
import tempfile
import time

from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.trainable import Diverged, penalise, placed, plain_numbers
from sweeper.user_function import load_target

RUN_TIMES = ("started_ms", "ended_ms")  # train_once's, for its MLflow run


def train_once(base: dict, metric: str, target: str | None, threads: int, gpus: float) -> dict:
    """One run of a config outside Tune, placed as a trial is (the baseline, confirmations).
    Its result holds when it started and ended (ms): the driver logs it to MLflow later."""
    started_ms = int(time.time() * 1000)
    result = _train_once(base, metric, target, threads, gpus)
    return {**result, RUN_TIMES[0]: started_ms, RUN_TIMES[1]: int(time.time() * 1000)}


def _train_once(base: dict, metric: str, target: str | None, threads: int, gpus: float) -> dict:
    import torch

    if target:
        seen: list[dict] = []

        def report(metrics: dict, state=None) -> None:
            seen.append(plain_numbers(metrics, metric))
            if penalise(seen[-1], metric, math.nan)[1]:  # ended as a trial would be
                raise Diverged

        try:
            load_target(target)(base, report)
        except Diverged:
            return {"value": None, "status": "diverged"}
        return {"value": seen[-1].get(metric) if seen else None, "status": "completed"}

    base = placed(base, threads, gpus)  # as a trial is: the comparison is like for like
    if base["trainer"]["workers"] > 1:
        from sweeper.train.distributed import train_ddp

        with tempfile.TemporaryDirectory() as folder:
            train_ddp(
                base,
                cpus_per_worker=threads,
                storage_path=folder,
                name="baseline",
                inside_tune=False,
                result_path=f"{folder}/result.json",
            )
            with open(f"{folder}/result.json") as f:
                result = json.load(f)
            if result.get("out_of_memory"):  # the ranks recorded it quietly (distributed.py)
                raise RuntimeError(result["error"])
    else:
        from sweeper.train.loop import train

        torch.set_num_threads(threads)
        result = train(base, verbose=False)
    return {
        "value": result.get(metric),
        "status": result["status"],
        "tokens": result["tokens"],
        "flops": result["flops"],
        "params": result["params"],
        "steps": result.get("steps"),
    }


def launch_once(config: dict, plan: SweepPlan):
    """`train_once` as a Ray task holding one trial's resources; returns its ObjectRef."""
    import ray

    spec = plan.spec
    ddp = plan.workers > 1
    # a DDP run only launches a TorchTrainer, whose ranks hold the resources
    remote = ray.remote(
        num_cpus=0 if ddp else spec.cpus_per_trial,
        num_gpus=0 if ddp else spec.gpus_per_trial,
    )(train_once)
    return remote.remote(config, spec.metric, plan.target, spec.trial_threads, spec.gpus_per_trial)


class Baseline:
    """The baseline run on Ray, holding one trial's resources. It starts in the first slot
    a stage leaves idle (callbacks.IdleSlot), or after the stages if none did."""

    def __init__(self, base: dict, plan: SweepPlan):
        self.base, self.plan = base, plan
        self.job = None

    def launch(self, where: str) -> None:
        if self.job is not None:
            return
        print(f"baseline: training the unmodified config under the same budget, {where}")
        self.job = launch_once(self.base, self.plan)

    def collect(self, timeout: float | None = None) -> dict | None:
        """Its result; None if `timeout` (what sweep.max_seconds leaves, in seconds) ran
        out first, or had run out before it started: it is stopped, and a resume trains it."""
        import ray

        if timeout is not None and timeout <= 0 and self.job is None:
            return None
        self.launch("after the stages")
        try:
            return ray.get(self.job, timeout=timeout if timeout is None else max(timeout, 0.0))
        except ray.exceptions.GetTimeoutError:
            ray.cancel(self.job, force=True)
            return None
        except Exception as error:  # a failed baseline must not lose the sweep's results
            return {"value": None, "status": "failed", "error": str(error).splitlines()[0]}
