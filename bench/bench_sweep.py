"""Orchestration overhead of a whole sweep (Hydra, Ray Tune, callbacks, outputs):

    overhead = sweep wall time / (sum of trial time / concurrency)

with trials that sleep a known time (bench/trial_functions.py), run through
`python -m sweeper` as a user would. Also the mean time a report() call takes.

    python bench/bench_sweep.py --trials 100 --seconds 1 --repeats 3
    python bench/bench_sweep.py --trials 8 --seconds 30 --repeats 3

`--per-report` measures what reporting costs CPU-bound training, whatever thread or process
does the work: trials doing a fixed amount of CPU work run once with `--reports` reports
each and once with a single report; the cost of one report is the difference in mean trial
wall time divided by the extra reports.

    python bench/bench_sweep.py --per-report --trials 20 --reports 40 --repeats 3
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


def one_sweep(
    trials: int,
    seconds: float,
    concurrency: int,
    extra: list[str],
    function: str = "sleeper",
    reports: int = 4,
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "reports.jsonl"
        env = dict(
            os.environ,
            BENCH_TRIAL_SECONDS=str(seconds),
            BENCH_REPORTS=str(reports),
            BENCH_REPORT_LOG=str(log),
            PYTHONPATH=os.pathsep.join([str(REPO / "bench"), str(REPO / "src")]),
        )
        args = [
            sys.executable,
            "-m",
            "sweeper",
            "+sweep=lr",
            f"trainable._target_=trial_functions.{function}",
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
        records = [json.loads(line) for line in log.read_text().splitlines()]
    calls = [t for record in records for t in record["report_s"]]
    ideal = trials * seconds / concurrency
    return {
        "total": total,
        "sweep": summary["elapsed_s"],
        "ideal": ideal,
        "trials": summary["trials"],
        "report_ms": 1000 * statistics.mean(calls),
        "trial_s": statistics.mean(record["trial_s"] for record in records),
    }


def per_report(args) -> None:
    """Cost of one report to CPU-bound training, from trial wall times with many vs 1."""
    costs = []
    for i in range(args.repeats):
        many = one_sweep(args.trials, 0, args.concurrency, args.overrides, "cruncher", args.reports)
        one = one_sweep(args.trials, 0, args.concurrency, args.overrides, "cruncher", 1)
        cost = (many["trial_s"] - one["trial_s"]) / (args.reports - 1)
        costs.append(cost)
        print(
            f"run {i + 1}: trial {many['trial_s']:.3f}s with {args.reports} reports, "
            f"{one['trial_s']:.3f}s with 1 | report() call {many['report_ms']:.2f} ms | "
            f"cost per report {1000 * cost:.2f} ms"
        )
    print(
        f"{args.trials} CPU-bound trials x {args.reports} reports, concurrency "
        f"{args.concurrency}: cost per report {1000 * statistics.median(costs):.2f} ms (median)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reports", type=int, default=4, help="reports per trial")
    parser.add_argument("--per-report", action="store_true", help="CPU-bound cost per report")
    parser.add_argument("overrides", nargs="*", help="extra overrides, e.g. mlflow.enabled=false")
    args = parser.parse_args()
    if args.per_report:
        return per_report(args)
    runs = []
    for i in range(args.repeats):
        run = one_sweep(
            args.trials, args.seconds, args.concurrency, args.overrides, reports=args.reports
        )
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
