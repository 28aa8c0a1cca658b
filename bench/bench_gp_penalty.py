"""How Optuna's GP search copes with diverged trials, by what it is told for them.

    python bench/bench_gp_penalty.py [--seeds 20] [--trials 24]

A stand-in for the LR stage, cheap enough to run many seeds: val_bpb as a bowl in
log10(matrix LR) and log10(embedding LR) over the sweeps' ranges ([0.001, 0.3] and
[0.01, 3]), optimum at matrix LR 0.06 and embedding LR 0.6, and every run with matrix LR
above 0.12 diverging (the optimum sits at half the divergence edge, as real LRs' do; a
quarter of the space diverges). Each seed runs the sweeps' GP searcher (search=gp, its
random start-up as in a sweep) for --trials trials, telling a diverged trial as:

- `1e9`: the default penalty of a user's function, as told before this bench;
- `8`: sweeper's own training's penalty (log2 of the vocabulary, in bits per byte);
- `worst`: what the sweeps tell now (+inf, which Optuna's GP clips to the worst finite
  value of each fit; `sweep/optuna_search.py`).

Prints each arm's median and mean regret (best val_bpb found minus the optimum's) and how
many of its trials diverged. TPE ranks values, so every arm is the same for it: `--search
tpe` shows that.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

from ray.tune.search.optuna import OptunaSearch

from sweeper.sweep.algorithms import _optuna_sampler, build_searcher
from sweeper.sweep.space import parse_space, to_optuna

SPACE = {
    "matrix_lr": {"log_uniform": [0.001, 0.3]},
    "embedding_lr": {"log_uniform": [0.01, 3.0]},
}
BEST = 2.5
ARMS = {"1e9": 1e9, "8": 8.0, "worst": None}


def val_bpb(config: dict) -> float:
    if config["matrix_lr"] > 0.12:
        return math.nan
    a = math.log10(config["matrix_lr"] / 0.06)
    b = math.log10(config["embedding_lr"] / 0.6)
    return BEST + 0.3 * a * a + 0.1 * b * b


def searcher(search: str, arm: str, seed: int, trials: int):
    space = parse_space(SPACE)
    if ARMS[arm] is None:  # the sweeps' own searcher
        return build_searcher(
            search, space, metric="val_bpb", mode="min", seed=seed, num_samples=trials
        )[0]
    sampler = _optuna_sampler(search, seed, trials)
    return OptunaSearch(space=to_optuna(space), sampler=sampler, metric="val_bpb", mode="min")


def one_search(search: str, arm: str, seed: int, trials: int) -> tuple[float, int]:
    alg = searcher(search, arm, seed, trials)
    best, diverged = math.inf, 0
    for i in range(trials):
        config = alg.suggest(str(i))
        value = val_bpb(config)
        if math.isnan(value):  # what the trainable reports: the penalty, status diverged
            diverged += 1
            result = {"val_bpb": ARMS[arm] or 8.0, "status": "diverged"}
        else:
            best = min(best, value)
            result = {"val_bpb": value}
        alg.on_trial_complete(str(i), result=result)
    return best - BEST, diverged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--search", choices=["gp", "tpe"], default="gp")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Clip non-finite values")
    print(f"search={args.search}, {args.trials} trials, seeds 0-{args.seeds - 1}")
    for arm in ARMS:
        started = time.perf_counter()
        runs = [one_search(args.search, arm, seed, args.trials) for seed in range(args.seeds)]
        regrets = [r for r, _ in runs]
        print(
            f"told {arm:>5}: regret median {statistics.median(regrets):.4f}, "
            f"mean {statistics.mean(regrets):.4f}, worst {max(regrets):.4f}; "
            f"diverged trials median {statistics.median(d for _, d in runs):.0f} of "
            f"{args.trials} ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
