"""Experiment tracking of sweeps. The engine talks to a tracker through four calls:

    tracker = make_tracker(plan, out_dir)   # or start_tracker(plan, out_dir)() beside Ray's
    callbacks = tracker.stage_callbacks(stage_name, base, ctx, search, scheduler)  # tune.Callbacks
    tracker.log_baseline(baseline_dict)
    tracker.finish(summary, out_dir)             # parent run: artifacts, final status; closes all

`NullTracker` does nothing (tracking off); `make_tracker` picks the real one. A single run
(no sweep) has its own: `run_logger.start_run_logger`, which hands its events to a
`run_tracker.RunTracker` in a process of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class NullTracker:
    def stage_callbacks(
        self, stage: str, base: dict, ctx: Any, search: str, scheduler: str
    ) -> list:
        return []

    def log_baseline(self, baseline: dict, config: dict | None = None) -> None:
        return None

    def finish(self, summary: dict, out_dir: Any, status: str = "FINISHED") -> None:
        return None

    def announce(self) -> None:
        return None


def make_tracker(plan: Any, out_dir: Any, announce: bool = True):
    """The tracker for the plan's mlflow section (mlflow.enabled=false: none); `announce`:
    print the line that says where its runs go (else `tracker.announce()` does)."""
    if not plan.mlflow.get("enabled", True):
        return NullTracker()
    try:
        from sweeper.tracking.mlflow_tracker import MlflowTracker
    except ImportError:
        return NullTracker()
    return MlflowTracker(plan, out_dir, announce)


def start_tracker(plan: Any, out_dir: Any) -> Callable[[], Any]:
    """make_tracker in a helper thread, beside Ray's start; returns the call that waits for
    the tracker (and raises its error). Why: MLflow's import and a new store take seconds,
    and the store's fail-fast checks ran before the job (`mlflow_store.check_store`)."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-start")
    future = executor.submit(make_tracker, plan, out_dir, announce=False)
    executor.shutdown(wait=False)

    def ready():
        tracker = future.result()
        tracker.announce()  # here, not in the thread: the start's lines keep their order
        return tracker

    return ready
