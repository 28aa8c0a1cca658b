"""The training process's side of a single run's MLflow logging.

`start_run_logger` starts `python -m sweeper.tracking.run_tracker`, a process that opens the
MLflow run and sends its calls; this side writes it one JSON line per event and never waits
on MLflow. Why a process of its own: MLflow's client (with pandas and SQLAlchemy) would stay
resident in the run and count in a CPU run's peak memory, and its import slows the start.

The logger runs in a session of its own, so a Ctrl+C reaches only the run, which then tells
it how the run ended; if the run dies without a word, its stdin closes and it ends the MLflow
run as failed.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

from sweeper.signals import interrupts_held
from sweeper.tracking.mlflow_queue import finite

# why: longer than the logger's own close, which waits at most 120 s for its queue
FINISH_TIMEOUT_S = 150.0


class RunLogger:
    def __init__(
        self,
        mlflow_cfg: dict,
        run_config: dict,
        out_dir: str,
        resume: bool,
        trainable: str | None = None,
    ):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sweeper.tracking.run_tracker"],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.alive = True
        start = {"mlflow": mlflow_cfg, "run_config": run_config, "out_dir": str(out_dir)}
        self._send({"start": {**start, "resume": resume, "trainable": trainable}})

    def report(self, metrics: dict) -> None:
        """One evaluation's figures (the numbers; NaN and inf are left out)."""
        self._send({"report": {name: v for name, v in metrics.items() if finite(v)}})

    def finish(self, status: str, result: dict | None = None) -> None:
        """Ends the MLflow run with `status` and waits until the logger has sent it all
        (or given up: it then says where the unsent calls are kept)."""
        result = result or {}
        kept = {k: result[k] for k in ("history", "reason", "error") if result.get(k)}
        self._send({"finish": {"status": status, "result": kept}})
        sys.stdout.flush()  # the run's lines before the logger's last one, in order
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=FINISH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def _send(self, message: dict) -> None:
        if not self.alive or self.process.stdin is None:
            return
        try:
            with interrupts_held():  # half a line would break the logger's reading of the rest
                self.process.stdin.write(json.dumps(message) + "\n")
                self.process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):  # the logger has gone: its note said why
            self.alive = False


def start_run_logger(
    cfg, run_config: dict, out_dir: str, resume: bool, trainable: str | None = None
) -> RunLogger | None:
    """The logger of a single run, or None with `mlflow.enabled=false`. `trainable`: the
    user's function that the run calls instead of sweeper's training."""
    from omegaconf import OmegaConf

    mlflow_cfg = cfg.get("mlflow") or {}
    if not mlflow_cfg.get("enabled", True):
        return None
    if OmegaConf.is_config(mlflow_cfg):
        mlflow_cfg = OmegaConf.to_container(mlflow_cfg, resolve=True)
    return RunLogger(dict(mlflow_cfg), run_config, out_dir, resume, trainable)
