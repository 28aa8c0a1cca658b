"""The training process's side of a single run's MLflow logging.

`start_run_logger` starts `python -m sweeper.tracking.run_tracker`, a process that opens
the MLflow run and sends its calls (run_tracker.RunTracker); this side writes it one JSON
line per event on its stdin and never waits on MLflow.

Why a process of its own, as W&B runs its logging in a service process: MLflow's client
(with pandas, SQLAlchemy and alembic) adds ~0.17 GiB to the process that imports it,
which a CPU run's peak memory would report as the run's own (0.36 -> 0.53 GiB for the
tiny model), and its import and a new store cost 1-2 s of the run's start. A sweep's trials
do not import it either: the driver logs for them.

The logger is started in a session of its own, so a Ctrl+C in the terminal reaches only
the run, which then tells the logger how it ended. If the run dies without a word, the
logger sees its stdin close and ends the MLflow run as failed.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys

from sweeper.signals import interrupts_held

FINISH_TIMEOUT_S = 150.0  # the queue's own close gives a dead server ~2 tries in 120 s


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
        numbers = {
            name: value
            for name, value in metrics.items()
            if isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
        }
        self._send({"report": numbers})

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
