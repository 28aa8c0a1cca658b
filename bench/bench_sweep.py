"""Orchestration overhead of a whole sweep (Hydra, Ray Tune, callbacks, outputs):

    overhead = sweep wall time / (sum of trial time / concurrency)

with trials that sleep a known time (bench/trial_functions.py), run through
`python -m sweeper` as a user would. Also the mean cost of one report() call.

    python bench/bench_sweep.py --trials 100 --seconds 1 --repeats 3
    python bench/bench_sweep.py --trials 8 --seconds 30 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_sweep(trials: int, seconds: float, concurrency: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "reports.jsonl"
        env = dict(
            os.environ,
            BENCH_TRIAL_SECONDS=str(seconds),
            BENCH_REPORT_LOG=str(log),
            PYTHONPATH=os.pathsep.join([str(REPO / "bench"), str(REPO / "src")]),
        )
        args = [
            sys.executable,
            "-m",
            "sweeper",
            "+sweep=lr",
            "trainable._target_=trial_functions.sleeper",
            "sweep.stages.0.search=random",
            "sweep.stages.0.scheduler=fifo",
            f"sweep.stages.0.num_samples={trials}",
            "sweep.baseline=false",
            f"sweep.concurrency={concurrency}",
            f"ray.num_cpus={concurrency}",
            f"hydra.run.dir={tmp}/run",
            *extra,
        ]
        start = time.perf_counter()
        proc = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tmp)
        total = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        calls = [t for line in log.read_text().splitlines() for t in json.loads(line)]
    ideal = trials * seconds / concurrency
    return {
        "total": total,
        "sweep": summary["elapsed_s"],
        "ideal": ideal,
        "trials": summary["trials"],
        "report_ms": 1000 * statistics.mean(calls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="extra overrides, e.g. mlflow.enabled=false")
    args = parser.parse_args()
    runs = []
    for i in range(args.repeats):
        run = one_sweep(args.trials, args.seconds, args.concurrency, args.overrides)
        runs.append(run)
        print(
            f"run {i + 1}: {run['trials']} trials | sweep {run['sweep']:.1f}s "
            f"(command {run['total']:.1f}s) | ideal {run['ideal']:.1f}s | "
            f"report() {run['report_ms']:.2f} ms"
        )
    sweep = statistics.median(r["sweep"] for r in runs)
    total = statistics.median(r["total"] for r in runs)
    ideal = runs[0]["ideal"]
    print(
        f"{args.trials} x {args.seconds:g}s trials, concurrency {args.concurrency}: "
        f"overhead {sweep / ideal:.2f}x (sweep, after Ray start) | "
        f"{total / ideal:.2f}x (whole command incl. Ray start) | "
        f"report() {statistics.median(r['report_ms'] for r in runs):.2f} ms"
    )


if __name__ == "__main__":
    main()
