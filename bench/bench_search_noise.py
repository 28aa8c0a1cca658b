"""Seed noise at the search bench's trial settings: how much val_bpb moves when one
configuration is trained again on another `trainer.seed` (another initialisation and data
order), against how far apart the good configurations are on average.

bench_search.py's searches train every trial on seed 0, so they compare configurations on a
shared seed. If the seeds reorder the good configurations, random search's best is the
configuration seed 0 favoured, not one an early-stopping rule could have seen coming: its
`--within` then asks for the best plus this noise.

    python bench/bench_search_noise.py 0.09:0.3 0.12:0.3 --seeds 8   # matrix_lr:embedding_lr
"""

from __future__ import annotations

import argparse
import itertools
import statistics

from bench_search import COMMON, sweep_reports


def seed_grid_overrides(matrix_lr: float, embedding_lr: float, seeds: int) -> list[str]:
    """The search bench's trials at one configuration, a grid over `trainer.seed`."""
    return [
        *(arg for arg in COMMON if ".params." not in arg),  # its LR ranges: none searched
        "~sweep.stages.0.params.optimizer",
        f"+sweep.stages.0.params.trainer.seed.grid=[{','.join(map(str, range(seeds)))}]",
        "sweep.stages.0.search=grid",
        "sweep.stages.0.scheduler=fifo",
        "sweep.stages.0.extend_trials=0",
        f"optimizer.matrix_lr={matrix_lr}",
        f"optimizer.embedding_lr={embedding_lr}",
    ]


def by_seed(matrix_lr: float, embedding_lr: float, seeds: int, tokens: int) -> dict[int, float]:
    """{seed: final val_bpb} of one configuration."""
    overrides = seed_grid_overrides(matrix_lr, embedding_lr, seeds)
    rows = sweep_reports([*overrides, f"sweep.budget.tokens_per_trial={tokens}"])
    return {int(r["seed"]): float(r["val_bpb"]) for r in rows if r["final"] == "True"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="matrix_lr:embedding_lr pairs")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=65536)
    args = parser.parse_args()
    values = {}
    for pair in args.configs:
        matrix_lr, embedding_lr = (float(v) for v in pair.split(":"))
        values[pair] = runs = by_seed(matrix_lr, embedding_lr, args.seeds, args.tokens)
        finals = list(runs.values())
        print(
            f"{pair}: mean {statistics.mean(finals):.4f}, sd over seeds "
            f"{statistics.stdev(finals):.4f}, range {min(finals):.4f}-{max(finals):.4f}",
            flush=True,
        )
    # a pair's difference on each seed: what the seed does to their order, the shared part
    # of its luck taken out
    for a, b in itertools.combinations(values, 2):
        shared = sorted(set(values[a]) & set(values[b]))
        diffs = [values[a][s] - values[b][s] for s in shared]
        wins = sum(d < 0 for d in diffs)
        print(
            f"{a} - {b}: mean {statistics.mean(diffs):+.4f}, sd {statistics.stdev(diffs):.4f};"
            f" {a} better on {wins} of {len(diffs)} seeds"
        )
    winners = [min(values, key=lambda c: values[c][s]) for s in sorted(values[args.configs[0]])]
    print("best on each seed: " + ", ".join(winners))


if __name__ == "__main__":
    main()
