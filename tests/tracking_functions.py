"""Users' functions for the MLflow tracking tests (`trainable._target_=tests.tracking_functions.X`).

They read their knobs from a `probe` section the test adds to the config
(`+probe.reports=6 +probe.sleep=0.2 +probe.dir=/tmp/...`): Ray's workers are started once
per test module, so environment variables set by a single test would not reach them.
"""

import math
import os
import time


def _probe(config: dict) -> dict:
    return {"reports": 4, "sleep": 0.0, "dir": None, **(config.get("probe") or {})}


def curve(config: dict, report) -> None:
    """A learning curve whose floor depends on the LR (lowest at 0.01); `probe.sleep`
    seconds per report; adds a line to `started` in `probe.dir` at its first report."""
    probe = _probe(config)
    lr = config["optimizer"]["matrix_lr"]
    for step in range(1, int(probe["reports"]) + 1):
        time.sleep(float(probe["sleep"]))
        value = 1.0 + (math.log10(lr) + 2.0) ** 2 + 1.0 / step
        accuracy = 1.0 - 1.0 / (step + 1)  # a number of the user's own
        metrics = {"val_bpb": value, "step": step * 10, "tokens": step * 100, "lr": lr}
        report({**metrics, "acc": accuracy, "acc@1": accuracy})  # MLflow refuses the last name
        if probe["dir"] and step == 1:  # a line per trial that has reported
            with open(os.path.join(probe["dir"], "started"), "a") as started:
                started.write(f"{lr}\n")


def fails_once(config: dict, report) -> None:
    """The first trial to get here fails after two reports; its retry (from scratch: a
    user's function has no checkpoint) reports every step again and completes."""
    probe = _probe(config)
    marker = os.path.join(probe["dir"], "failed_once")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        first = True
    except FileExistsError:
        first = False
    lr = config["optimizer"]["matrix_lr"]
    for step in range(1, int(probe["reports"]) + 1):
        report({"val_bpb": 2.0 + lr + 1.0 / step, "step": step, "tokens": step * 100})
        if first and step == 2:
            raise RuntimeError("a failure on the first attempt (a test of retries)")


def without_steps(config: dict, report) -> None:
    """Reports a figure of its own name and no step, three times; and one whose name MLflow
    refuses."""
    for count in range(1, 4):
        report({"my_loss": 4.0 / count, "note": "text is not a metric", "acc@1": 0.5})
