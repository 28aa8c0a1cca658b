"""Timing of the scaling-law fitter on Epoch's 240 Chinchilla points.

    python bench/bench_fit.py [--runs 5] [--exhaustive]

Reports the median wall time of --runs repetitions of: a single-start parametric fit, the
default grid fit (4500 starts evaluated, best 64 refined), 1000 bootstrap refits, and (with
--exhaustive, one run) refining all 4500 starts. Uses ../shared/reference-data when present,
else 240 synthetic points drawn from Hoffmann et al.'s law (times are then only indicative).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from sweeper.scaling import bootstrap_chinchilla, fit_chinchilla

EPOCH = (
    Path(__file__).resolve().parents[2]
    / "shared"
    / "reference-data"
    / "chinchilla_epoch_svg_extracted.csv"
)
SINGLE_START = [6.0, 7.0, 0.5, 0.3, 0.3]


def load_points() -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    if EPOCH.is_file():
        with open(EPOCH, newline="") as fh:
            rows = list(csv.DictReader(fh))
        n = np.array([float(r["Model Size"]) for r in rows])
        c = np.array([float(r["Training FLOP"]) for r in rows])
        loss = np.array([float(r["loss"]) for r in rows])
        keep = np.argsort(loss, kind="stable")[:-5]
        return n[keep], c[keep] / (6 * n[keep]), loss[keep], "Epoch Chinchilla (240 points)"
    rng = np.random.default_rng(0)
    n = 10 ** rng.uniform(7.5, 10.5, 240)
    d = 10 ** rng.uniform(9.5, 11.5, 240)
    loss = (1.69 + 406.4 / n**0.34 + 410.7 / d**0.28) * np.exp(rng.normal(0, 0.01, 240))
    return n, d, loss, "synthetic (240 points; reference data absent)"


def timed(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--exhaustive", action="store_true", help="also time refining all starts")
    args = p.parse_args()
    n, d, loss, source = load_points()
    fit = fit_chinchilla(n, d, loss)
    cases = [
        ("single-start fit", lambda: fit_chinchilla(n, d, loss, x0=SINGLE_START), 1.0, args.runs),
        (
            "grid fit (4500 starts, best 64 refined)",
            lambda: fit_chinchilla(n, d, loss),
            None,
            args.runs,
        ),
        (
            "1000 bootstrap refits",
            lambda: bootstrap_chinchilla(n, d, loss, fit, n_boot=1000),
            60.0,
            args.runs,
        ),
    ]
    if args.exhaustive:
        cases.append(
            (
                "grid fit, all 4500 refined",
                lambda: fit_chinchilla(n, d, loss, n_refine=None),
                None,
                1,
            )
        )
    print(f"data: {source}; CPU: {cpu_model()} ({os.cpu_count()} cores)")
    print(
        f"fit: E={fit.E:.4f} A={fit.A:.1f} B={fit.B:.0f} alpha={fit.alpha:.4f} "
        f"beta={fit.beta:.4f} |grad|={fit.grad_norm:.1e}"
    )
    print(f"{'case':42s} {'runs':>4s} {'median s':>9s} {'target s':>9s} {'ratio':>7s}")
    for name, fn, target, runs in cases:
        t = timed(fn, runs)
        tgt = f"{target:9.1f}" if target else f"{'-':>9s}"
        ratio = f"{t / target:7.3f}" if target else f"{'-':>7s}"
        print(f"{name:42s} {runs:4d} {t:9.3f} {tgt} {ratio}")


if __name__ == "__main__":
    main()
