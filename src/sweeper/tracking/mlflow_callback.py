"""The Tune callback that carries a stage's trial events to the sweep's MLflow tracker."""

from __future__ import annotations

from typing import Any

from ray import tune

from sweeper.sweep.results import trial_status

LIVE: dict[str, Any] = {}  # run dir -> its MlflowTracker: how unpickled callbacks find it


class MlflowCallback(tune.Callback):
    """Forwards a stage's trial events to the live tracker of its run dir. It holds only
    plain values: Tune pickles it, and a restored stage's copy finds the new driver's
    tracker through `LIVE` (none: tracking is off now)."""

    def __init__(self, run_dir: str, stage: str, base: dict, ctx, search: str, scheduler: str):
        self.run_dir, self.stage, self.base, self.ctx = run_dir, stage, base, ctx
        self.search, self.scheduler = search, scheduler

    def _call(self, method: str, *args) -> None:
        tracker = LIVE.get(self.run_dir)
        if tracker is None and len(LIVE) == 1:  # a stage restored from a moved run dir
            (tracker,) = LIVE.values()
        if tracker is None or tracker.finished:
            return
        try:
            getattr(tracker, method)(self, *args)
        except Exception as error:  # logging must never stop the sweep
            print(f"[mlflow] {method} failed: {error!r}", flush=True)

    def on_trial_start(self, iteration, trials, trial, **info):
        self._call("trial_started", trial)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._call("trial_result", trial, result)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._call("trial_ended", trial, final_status(trial))

    def on_trial_error(self, iteration, trials, trial, **info):
        self._call("trial_ended", trial, "failed", error_line(trial))

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._call("trial_retried", trial)

    def on_experiment_end(self, trials, **info):
        self._call("stage_ended", trials)


def final_status(trial) -> str:
    """completed | pruned | diverged, or interrupted: a trial Tune stopped on Ctrl+C (or
    at the sweep's time cap) has no `done` in its last result; a scheduler's stop sets it."""
    result = trial.last_result or {}
    status = trial_status(result, None)
    return "interrupted" if status == "pruned" and not result.get("done") else status


def error_line(trial) -> str:
    try:
        error = trial.get_error()
    except Exception:
        error = None
    text = str(error).strip() if error is not None else ""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "error"
