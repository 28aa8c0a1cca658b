"""Trial functions for the orchestration benchmarks: they sleep instead of training, so the
ideal sweep time is known exactly, and they time their own report() calls."""

import json
import os
import time


def sleeper(config: dict, report) -> None:
    """Sleeps `bench.trial_seconds` in `bench.reports` equal slices, reporting after each."""
    seconds = float(os.environ.get("BENCH_TRIAL_SECONDS", "1.0"))
    reports = int(os.environ.get("BENCH_REPORTS", "4"))
    lr = config["optimizer"]["matrix_lr"]
    timings = []
    for i in range(1, reports + 1):
        time.sleep(seconds / reports)
        start = time.perf_counter()
        report({"val_bpb": 3.0 + abs(lr - 0.02) + 1.0 / i, "step": i, "tokens": i})
        timings.append(time.perf_counter() - start)
    log = os.environ.get("BENCH_REPORT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(timings) + "\n")
