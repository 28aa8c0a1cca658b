"""Experiment tracking of sweeps. The engine talks to a tracker through four calls:

    tracker = make_tracker(cfg, spec, out_dir)   # before Ray starts: a bad server fails fast
    callbacks = tracker.stage_callbacks(stage_name, base, ctx, search, scheduler)  # tune.Callbacks
    tracker.log_baseline(baseline_dict)
    tracker.finish(summary, out_dir)             # parent run: artifacts, final status; closes all

`NullTracker` does nothing (tracking off); `make_tracker` picks the real one.
"""

from __future__ import annotations

from typing import Any


class NullTracker:
    def stage_callbacks(
        self, stage: str, base: dict, ctx: Any, search: str, scheduler: str
    ) -> list:
        return []

    def log_baseline(self, baseline: dict) -> None:
        return None

    def finish(self, summary: dict, out_dir: Any, status: str = "FINISHED") -> None:
        return None


def make_tracker(cfg: Any, spec: Any, out_dir: Any):
    """The tracker for `cfg.mlflow` (mlflow.enabled=false: none)."""
    mlflow_cfg = cfg.get("mlflow") or {}
    if not mlflow_cfg.get("enabled", True):
        return NullTracker()
    try:
        from sweeper.tracking.mlflow_tracker import MlflowTracker
    except ImportError:
        return NullTracker()
    return MlflowTracker(cfg, spec, out_dir)
