"""Search efficiency on the real model: the compute ASHA and BOHB need to reach the best
val_bpb of a 16-trial random search, as a fraction of the random search's compute.

Random search and random+ASHA share the seed, so they propose the same 16 configurations:
the difference is only what early stopping saves. BOHB, and `tpe_asha` (the sweeps'
default: TPE with ASHA, not in the default --methods), propose their own. Compute is
counted in time order over every report of every trial (wall_time), so a pruned trial
costs what it trained before it was stopped.

    python bench/bench_search.py --seeds 5          # target: <= 1/3 of random's compute

Five seeds, not three: which of random's 16 configurations is the best, and how early ASHA
meets it, varies so much between seeds (0.12x to 1.05x) that a median of three moves by
more than the target's margin.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "+sweep=lr",
    "model=tiny",
    "trainer.device_batch_size=8",
    "trainer.total_batch_size=1024",
    "trainer.eval_tokens=8192",
    "sweep.baseline=false",
    "mlflow.enabled=false",
    "sweep.stages.0.params.optimizer.matrix_lr.log_uniform=[0.001,0.3]",
    "sweep.stages.0.params.optimizer.embedding_lr.log_uniform=[0.01,3.0]",
]
METHODS = {
    "random": ["sweep.stages.0.search=random", "sweep.stages.0.scheduler=fifo"],
    "asha": ["sweep.stages.0.search=random", "sweep.stages.0.scheduler=asha"],
    "bohb": ["sweep.stages.0.search=bohb", "sweep.stages.0.scheduler=bohb"],
    # the sweeps' default: TPE's first 10 trials are random, then its model proposes
    "tpe_asha": ["sweep.stages.0.search=tpe", "sweep.stages.0.scheduler=asha"],
}


def run(method: str, seed: int, samples: int, tokens: int, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            sys.executable,
            "-m",
            "sweeper",
            *COMMON,
            *METHODS[method],
            f"sweep.seed={seed}",
            f"sweep.stages.0.num_samples={samples}",
            f"sweep.budget.tokens_per_trial={tokens}",
            f"hydra.run.dir={tmp}/run",
            *extra,
        ]
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        with open(Path(tmp) / "run" / "reports.csv") as f:
            return list(csv.DictReader(f))


def compute_to_reach(reports: list[dict], target: float) -> tuple[float | None, float, float]:
    """(FLOPs spent when a completed trial first reaches `target` (None: never), total
    FLOPs, best completed value)."""
    spent, last, reached = 0.0, {}, None
    best = min(
        (
            float(r["val_bpb"])
            for r in reports
            if r["final"] == "True" and r["status"] == "completed"
        ),
        default=float("inf"),
    )
    for r in sorted(reports, key=lambda r: float(r["wall_time"])):
        flops = float(r["flops"])
        spent += flops - last.get(r["trial_id"], 0.0)
        last[r["trial_id"]] = flops
        done = r["final"] == "True" and r["status"] == "completed"
        if reached is None and done and float(r["val_bpb"]) <= target + 1e-9:
            reached = spent
    return reached, spent, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=16, help="random search's trials")
    parser.add_argument(
        "--budget-samples",
        type=int,
        default=48,
        help="trials ASHA/BOHB may draw; compute is counted until they reach",
    )
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument(
        "--methods", default="asha,bohb", help=f"compared to random search: {', '.join(METHODS)}"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="extra overrides for every method, e.g. sweep.grace_fraction=0.111",
    )
    args = parser.parse_args()
    methods = args.methods.split(",")
    ratios: dict[str, list[float]] = {method: [] for method in methods}
    for seed in range(args.seeds):
        random = run("random", seed, args.samples, args.tokens, args.overrides)
        _, random_total, target = compute_to_reach(random, float("-inf"))
        line = f"seed {seed}: random best {target:.4f} with {random_total:.3g} FLOPs"
        for method in methods:
            reports = run(method, seed, args.budget_samples, args.tokens, args.overrides)
            reached, total, best = compute_to_reach(reports, target)
            ratio = reached / random_total if reached is not None else float("inf")
            ratios[method].append(ratio)
            line += (
                f" | {method}: best {best:.4f}, total {total / random_total:.2f}x, "
                f"reached at {'never' if reached is None else f'{ratio:.2f}x'}"
            )
        print(line, flush=True)
    for method, values in ratios.items():
        print(
            f"{method}: median compute to reach random search's best = "
            f"{statistics.median(values):.2f}x of random's ({args.seeds} seeds: "
            f"{', '.join('never' if v == float('inf') else f'{v:.2f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
