"""Trial functions for the orchestration benchmarks. `sleeper` sleeps instead of training, so
the ideal sweep time is known exactly; `cruncher` does a fixed amount of CPU work, so what
reporting costs the training shows in its own wall time. Both time their report() calls."""

import json
import os
import time


def _log(record) -> None:
    log = os.environ.get("BENCH_REPORT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")


def sleeper(config: dict, report) -> None:
    """Sleeps `BENCH_TRIAL_SECONDS` in `BENCH_REPORTS` equal slices, reporting after each."""
    seconds = float(os.environ.get("BENCH_TRIAL_SECONDS", "1.0"))
    reports = int(os.environ.get("BENCH_REPORTS", "4"))
    lr = config["optimizer"]["matrix_lr"]
    start_trial = time.perf_counter()
    timings = []
    for i in range(1, reports + 1):
        time.sleep(seconds / reports)
        start = time.perf_counter()
        report({"val_bpb": 3.0 + abs(lr - 0.02) + 1.0 / i, "step": i, "tokens": i})
        timings.append(time.perf_counter() - start)
    _log({"report_s": timings, "trial_s": time.perf_counter() - start_trial})


def cruncher(config: dict, report) -> None:
    """`BENCH_WORK_UNITS` one-thread 256x256 matmuls (~0.5 ms each here) in `BENCH_REPORTS`
    equal slices, reporting after each; logs the trial's wall time from first to last."""
    import torch

    torch.set_num_threads(1)
    units = int(os.environ.get("BENCH_WORK_UNITS", "4000"))
    reports = int(os.environ.get("BENCH_REPORTS", "4"))
    lr = config["optimizer"]["matrix_lr"]
    x = torch.randn(256, 256) / 16
    start_trial = time.perf_counter()
    timings = []
    for i in range(1, reports + 1):
        for _ in range(units // reports):
            x = torch.tanh(x @ x)
        start = time.perf_counter()
        report({"val_bpb": 3.0 + abs(lr - 0.02) + 1.0 / i, "step": i, "tokens": i})
        timings.append(time.perf_counter() - start)
    _log({"report_s": timings, "trial_s": time.perf_counter() - start_trial})
