"""Driver-side Tune callbacks: the progress display and the sweep-wide FLOP cap."""

from __future__ import annotations

import math
import time
from pathlib import Path

from ray import tune


class ProgressCallback(tune.Callback):
    """One line per finished trial: done (pruned, diverged, failed), running, paused, best
    so far, ETA."""

    def __init__(self, stage: str, planned: int, metric: str, mode: str):
        self.stage, self.planned, self.metric, self.mode = stage, planned, metric, mode
        self.started = time.time()
        self.counts = {"completed": 0, "pruned": 0, "diverged": 0, "failed": 0}
        self.best: float | None = None

    def on_trial_result(self, iteration, trials, trial, result, **info):
        value = result.get(self.metric)
        if result.get("status") == "diverged" or not isinstance(value, int | float):
            return
        if math.isfinite(value) and (
            self.best is None or (value < self.best if self.mode == "min" else value > self.best)
        ):
            self.best = value

    def on_trial_complete(self, iteration, trials, trial, **info):
        result = trial.last_result or {}
        status = result.get("status")
        if status not in ("completed", "diverged"):
            status = "completed" if status is None and result.get("done") else "pruned"
        self._finish(trial, trials, status)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._finish(trial, trials, "failed")
        error_file = Path(trial.local_path or ".") / "error.txt"
        reason = _error_line(error_file)
        print(
            f"[{self.stage}] trial {trial.trial_id} FAILED after its retries: {reason} "
            f"(full error: {error_file}; worker logs: Ray's session logs)",
            flush=True,
        )

    def _finish(self, trial, trials, status: str) -> None:
        # read from Tune's own trial states: HyperBand and BOHB pause trials between rungs,
        # and a paused trial holds no CPU, so it is not "running"
        rest = [t for t in trials if t is not trial]
        running = sum(t.status == t.RUNNING for t in rest)
        paused = sum(t.status == t.PAUSED for t in rest)
        self.counts[status] += 1
        done = sum(self.counts.values())
        elapsed = time.time() - self.started
        left = max(self.planned - done, 0)
        eta = elapsed / done * left if done else float("nan")
        endings = ", ".join(f"{n} {k}" for k, n in self.counts.items() if n and k != "completed")
        best = f"{self.best:.4f}" if self.best is not None else "-"
        print(
            f"[{self.stage}] {done}/{self.planned} trials done"
            f"{f' ({endings})' if endings else ''}, {running} running"
            f"{f', {paused} paused' if paused else ''} | "
            f"best {self.metric} {best} | {elapsed:.0f}s elapsed, ~{eta:.0f}s left",
            flush=True,
        )


class FlopCap(tune.Stopper):
    """Stops the sweep once the training FLOPs of all trials (rung cooldown forks included)
    reach `max_flops`."""

    def __init__(self, max_flops: float, already: float = 0.0):
        self.max_flops, self.already = max_flops, already
        self.latest: dict[str, float] = {}

    def __call__(self, trial_id, result) -> bool:
        self.latest[trial_id] = float(result.get("flops") or 0.0) + float(
            result.get("fork_flops") or 0.0
        )
        return False

    def stop_all(self) -> bool:
        return self.already + sum(self.latest.values()) >= self.max_flops


def _error_line(path: Path) -> str:
    """The error of a failed trial in one line (results.error_summary of its error.txt)."""
    from sweeper.sweep.results import error_summary

    try:
        return error_summary(path.read_text())
    except OSError:
        return "unknown error"
