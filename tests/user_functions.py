"""A user's own training function, swept by tests through `trainable._target_`."""

import math


def noisy_bowl(config: dict, report) -> None:
    """val_bpb is lowest at lr = 0.01 and falls with 'training' like a learning curve."""
    lr = config["optimizer"]["lr"]
    for step in range(1, 5):
        distance = (math.log10(lr) + 2.0) ** 2
        report({"val_bpb": 1.0 + distance + 1.0 / step, "step": step, "tokens": step * 100})


def reports_its_own_loss(config: dict, report) -> None:
    """Reports `loss`, never the sweep's metric (val_bpb by default)."""
    for step in range(1, 3):
        report({"loss": config["optimizer"]["lr"] / step, "step": step})


def explodes(config: dict, report) -> None:
    report({"val_bpb": float("nan"), "step": 1})
    raise AssertionError("a diverged trial must be ended by its report, not run on")


def paced_reports(config: dict, report) -> None:
    """Reports `reports` results `pace_s` apart and logs how long each report() call took."""
    import json
    import time

    durations = []
    for step in range(1, config["reports"] + 1):
        time.sleep(config["pace_s"])
        start = time.perf_counter()
        report({"val_bpb": 1.0 + 1.0 / step, "step": step, "tokens": step * 100})
        durations.append(time.perf_counter() - start)
    with open(config["log"], "w") as f:
        json.dump(durations, f)


def trains_long_after_its_first_report(config: dict, report) -> None:
    """Reports once, then 'trains' for 10 s in short steps; logs how many steps it did."""
    import time

    done = 0
    try:
        report({"val_bpb": 2.0, "step": 1, "tokens": 100})
        while done < 1000:
            time.sleep(0.01)
            done += 1
        report({"val_bpb": 1.0, "step": 2, "tokens": 200})
    finally:
        with open(config["log"], "a") as f:
            f.write(f"{done}\n")


def bowl_in_lr_and_batch(config: dict, report) -> None:
    """noisy_bowl's LR bowl plus a batch-size one, lowest at 512 tokens: a batch stage
    whose grid leaves 512 out finds only worse configs than the one it starts from."""
    lr, batch = config["optimizer"]["lr"], config["trainer"]["total_batch_size"]
    for step in range(1, 5):
        distance = (math.log10(lr) + 2.0) ** 2 + abs(math.log2(batch / 512))
        report({"val_bpb": 1.0 + distance + 1.0 / step, "step": step, "tokens": step * 100})


def reports_past_the_sweeps_count(config: dict, report) -> None:
    """noisy_bowl's bowl over 12 reports, with no compute figure: its budget is its own."""
    lr = config["optimizer"]["lr"]
    for step in range(1, 13):
        value = 1.0 + (math.log10(lr) + 2.0) ** 2 + 1.0 / step
        report({"val_bpb": value, "step": step, "lr_seen": lr})


def returns_without_reporting(config: dict, report) -> float:
    return 2.5  # a user's mistake: the sweep reads reports, not what the function returns


def reports_numpy_and_torch(config: dict, report) -> None:
    """The metric as a numpy scalar, then as a one-element torch tensor."""
    import numpy as np
    import torch

    report({"val_bpb": np.float32(3.0), "step": np.int64(1)})
    report({"val_bpb": torch.tensor(2.5), "step": 2, "status": "ok"})  # its own word


def reports_a_word(config: dict, report) -> None:
    report({"val_bpb": "good", "step": 1})


def diverges_after_a_report(config: dict, report) -> None:
    report({"val_bpb": 3.0, "step": 1})
    report({"val_bpb": float("nan"), "step": 2})
    raise AssertionError("a diverged run must be ended by its report, not run on")


def paced_reports_without_tokens(config: dict, report) -> None:
    """120 reports of a falling val_bpb, 0.5 s apart, and no compute figure: a minute, so
    that a second trial whose worker is slow to start still reports while the first runs
    (the time-cap test stops both once both have reported)."""
    import time

    for step in range(1, 121):
        time.sleep(0.5)
        report({"val_bpb": 2.0 + 1.0 / step, "step": step})


def hangs_after_a_report(config: dict, report) -> None:
    """Reports once, then never returns (a user's function stuck on I/O, say)."""
    import time

    report({"val_bpb": 2.0, "step": 1})
    while True:
        time.sleep(0.1)


def fails_once_after_three_reports(config: dict, report) -> None:
    """Three reports, then a failure the first time (a lost node, say), not when retried."""
    from pathlib import Path

    for step in range(1, 4):
        report({"val_bpb": 2.1 - step / 10, "step": step})
    marker = Path(config["mine"]["marker"])
    if not marker.exists():
        marker.touch()
        raise RuntimeError("the node went away")


def raises_after_a_report(config: dict, report) -> None:
    report({"phase": "warm-up"})  # no number: nothing for MLflow to plot
    raise AssertionError("the function's own bug")


def bowl_in_lr_batch_and_budget(config: dict, report) -> None:
    """A scaling grid's landscape with known laws: at budget C (trainer.budget_flops) the
    best batch is 400 (C / 4e9)^0.3 and the best LR 0.02 (C / 4e9)^-0.2 (B / 512)^0.5, both
    inside lr_bs_scaling-style grids; the loss falls with C. Four reports, the last at C."""
    lr = config["optimizer"]["matrix_lr"]
    batch = config["trainer"]["total_batch_size"]
    budget = config["trainer"]["budget_flops"]
    best_batch = 400 * (budget / 4e9) ** 0.3
    best_lr = 0.02 * (budget / 4e9) ** -0.2 * (batch / 512) ** 0.5
    final = 3.0 - 0.1 * math.log10(budget)
    final += 0.1 * math.log2(lr / best_lr) ** 2 + 0.1 * math.log2(batch / best_batch) ** 2
    for step in range(1, 5):
        flops = budget * step / 4
        report({"val_bpb": final + 0.5 * (4 - step) / step, "flops": flops, "tokens": step * batch})


def bowl_that_diverges_above_lr_0_1(config: dict, report) -> None:
    """noisy_bowl's value, but NaN (a divergence) for lr above 0.1."""
    lr = config["optimizer"]["lr"]
    for step in range(1, 3):
        value = math.nan if lr > 0.1 else 1.0 + (math.log10(lr) + 2.0) ** 2 + 1.0 / step
        report({"val_bpb": value, "step": step, "tokens": step * 100})
        if math.isnan(value):
            return


def goes_on_from_its_checkpoint(config: dict, report) -> None:
    """Five reports with its state as a checkpoint; fails once after the third (a lost
    node), and the retry goes on from the state it was handed back (`resumed_at`)."""
    from pathlib import Path

    import torch

    state = report.checkpoint or {"step": 0, "weights": torch.zeros(3)}
    resumed_at = state["step"]
    assert torch.equal(state["weights"], torch.full((3,), float(resumed_at)))
    for step in range(resumed_at + 1, 6):
        weights = torch.full((3,), float(step))
        report(
            {"val_bpb": 2.0 - step / 10, "step": step, "resumed_at": resumed_at},
            checkpoint={"step": step, "weights": weights},
        )
        marker = Path(config["mine"]["marker"])
        if step == 3 and not marker.exists():
            marker.touch()
            raise RuntimeError("the node went away")


def hangs_above_lr_0_02(config: dict, report) -> None:
    """Reports once; then, above matrix_lr 0.02, never again (a dead data loader, say).
    Each attempt leaves a file in `mine.attempts`."""
    import time
    import uuid
    from pathlib import Path

    lr = config["optimizer"]["matrix_lr"]
    (Path(config["mine"]["attempts"]) / f"{lr}-{uuid.uuid4().hex}").touch()
    report({"val_bpb": 2.0 + lr, "step": 1})
    while lr > 0.02:
        time.sleep(0.1)
    report({"val_bpb": 1.9 + lr, "step": 2})


def blocks_in_c_above_lr_0_02(config: dict, report) -> None:
    """Reports once; then, above matrix_lr 0.02, waits for ever inside a C call (a lock
    nobody releases), where no Python exception can reach it."""
    import threading

    lr = config["optimizer"]["matrix_lr"]
    report({"val_bpb": 2.0 + lr, "step": 1})
    if lr > 0.02:
        held = threading.Lock()
        held.acquire()
        held.acquire()  # never returns
    report({"val_bpb": 1.9 + lr, "step": 2})
