"""User functions for the crash tests: they log every (trial id, step) they execute."""

import math
import os
import time


def counted(config: dict, report) -> None:
    from ray import tune

    trial = tune.get_context().get_trial_id()
    lr = config["optimizer"]["matrix_lr"]
    for step in range(1, 4):
        time.sleep(float(os.environ.get("TRIAL_SLEEP", "0.5")))
        with open(os.environ["COUNT_FILE"], "a") as f:
            f.write(f"{trial} {step}\n")
        report({"val_bpb": 3.0 + abs(math.log10(lr) + 1.7) + 1.0 / step, "step": step})


def fails_once(config: dict, report) -> None:
    """Raises on its first execution (per trial), succeeds when retried."""
    from ray import tune

    marker = os.path.join(os.environ["MARKER_DIR"], tune.get_context().get_trial_id())
    report({"val_bpb": 4.0, "step": 1})
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("transient failure (first attempt)")
    report({"val_bpb": 3.0, "step": 2})


def always_fails(config: dict, report) -> None:
    raise ValueError("a bug in user code")
