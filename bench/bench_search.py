"""Search efficiency on the real model: the compute ASHA and BOHB need to reach the best
val_bpb of a 16-trial random search, as a fraction of the random search's compute.

Random search and random+ASHA share the seed, so they propose the same 16 configurations:
the difference is only what early stopping saves. BOHB, `asha_own` (random+ASHA seeded
apart) and `tpe_asha` (the sweeps' default: TPE with ASHA) propose their own. Compute is
counted in time order over every report of every trial (wall_time), so a pruned trial
costs what it trained before it was stopped.

    python bench/bench_search.py --seeds 5          # target: <= 1/3 of random's compute
    python bench/bench_search.py --space lr3 --methods bohb_sh,bohb_sh_random  # + head LR

The first rung is at 1/8 of a trial (sweep.grace_fraction=0.125): a bench trial is 64
optimizer steps, so that is 8 steps, where the sweeps' default quarter puts lr_bs's first
rung (25-step trials) at 6. With a quarter here (16 steps) ASHA's median was 0.44x: each
stopped trial costs twice as much, and even an oracle's ranking cannot make up for that
(the replay below: 0.34-0.38x at a quarter).

Five seeds, not three: which of random's 16 configurations is the best, and how early ASHA
meets it, varies so much between seeds (0.12x to 1.05x) that a median of three moves by
more than the target's margin. Ten are not enough either: on the same code ASHA's median
was 0.25x over seeds 0-9 and 0.43x over seeds 10-19 (0.37x over 0-29), so run new seeds
(--first-seed) before trusting a setting chosen on old ones.

--within D asks for random search's best plus D bits per byte: a trial's seed moves val_bpb
by more than the good configurations differ (bench_search_noise.py), so the best of 16 on one
seed is partly that seed's luck.

--replay replays two ASHA rules over the random runs' curves, with no trials run: Ray's,
which stops trials and lets a rung's first arrivals through unranked, and the published one
(Li et al., 2020), which pauses them and promotes only the top of each rung. (The published
rule was built into the sweeps once, measured to give no gain beside TPE, and removed.)
"""

from __future__ import annotations

import argparse
import csv
import heapq
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "+sweep=lr",
    "model=tiny",
    "trainer.device_batch_size=8",
    "trainer.total_batch_size=1024",
    "trainer.eval_tokens=8192",
    "sweep.baseline=false",
    "mlflow.enabled=false",
    "sweep.grace_fraction=0.125",  # 8 of 64 steps (see above); hyperband/bohb round to 1/3
    "sweep.rung_cooldown=0",  # the schedulers as published, as every figure here was measured
    "sweep.stages.0.params.optimizer.matrix_lr.log_uniform=[0.001,0.3]",
    "sweep.stages.0.params.optimizer.embedding_lr.log_uniform=[0.01,3.0]",
]
SPACES = {
    "lr2": [],  # the two LRs above
    # a third dimension that matters: the output head's LR moves val_bpb from 3.08 (0.004,
    # the default) to 3.85 (0.0005) and 3.59 (0.128) at the 2-D optimum, where the scalars'
    # LR moves it by 0.07 over 0.002-0.2
    "lr3": ["+sweep.stages.0.params.optimizer.unembedding_lr.log_uniform=[0.0005,0.1]"],
    # the two LRs over 3.5 decades each, as a first sweep spans them when the LR's scale is
    # unknown (a new model or optimizer): the band of good LRs is a smaller part of the space
    "wide": [
        "sweep.stages.0.params.optimizer.matrix_lr.log_uniform=[0.0003,1.0]",
        "sweep.stages.0.params.optimizer.embedding_lr.log_uniform=[0.003,10.0]",
    ],
}
METHODS = {
    "random": ["sweep.stages.0.search=random", "sweep.stages.0.scheduler=fifo"],
    "asha": ["sweep.stages.0.search=random", "sweep.stages.0.scheduler=asha"],
    # the same, drawing its own configurations (see OWN_DRAWS): random search's best is then
    # not among ASHA's first 16 trials, as it never is for BOHB's
    "asha_own": ["sweep.stages.0.search=random", "sweep.stages.0.scheduler=asha"],
    "bohb": ["sweep.stages.0.search=bohb", "sweep.stages.0.scheduler=bohb"],
    # BOHB leaning on its model: budgets of 1/9, 1/3 and 1 (its first 9 trials at 1/9 give
    # the model its 6 points soonest), a tenth of proposals random instead of a third, and
    # proposals drawn from the good KDE at its own width instead of 3x
    "bohb_exploit": [
        "sweep.stages.0.search=bohb",
        "sweep.stages.0.scheduler=bohb",
        "sweep.grace_fraction=0.111",
        "sweep.bohb.random_fraction=0.1",
        "sweep.bohb.bandwidth_factor=1",
    ],
    # BOHB with more budget levels, hpbandster's model as it comes: reports every 1/16 of a
    # trial so the smallest rung is 4 steps, and the first bracket starts 27 (eta 3) or 16
    # (eta 2) trials, which gives the model its points within that bracket
    "bohb_deep3": [
        "sweep.stages.0.search=bohb",
        "sweep.stages.0.scheduler=bohb",
        "sweep.reports_per_trial=16",
        "sweep.grace_fraction=0.037",
    ],
    "bohb_deep2": [
        "sweep.stages.0.search=bohb",
        "sweep.stages.0.scheduler=bohb",
        "sweep.reports_per_trial=16",
        "sweep.grace_fraction=0.0625",
        "sweep.reduction_factor=2",
    ],
    # BOHB with two budget levels, 1/8 and the whole trial (eta 8): Ray's largest bracket
    # starts 8 trials at 1/8 and completes the best (2 trials' compute), then the second
    # bracket runs 2 of the model's proposals to the end, so the model's first full trials
    # finish at a quarter of random search's compute, where three levels (1/9, 1/3, 1) finish
    # theirs at 0.35x
    "bohb_flat8": [
        "sweep.stages.0.search=bohb",
        "sweep.stages.0.scheduler=bohb",
        "sweep.reduction_factor=8",
    ],
    "bohb_flat8_exploit": [
        "sweep.stages.0.search=bohb",
        "sweep.stages.0.scheduler=bohb",
        "sweep.reduction_factor=8",
        "sweep.bohb.random_fraction=0.1",
        "sweep.bohb.bandwidth_factor=1",
    ],
    # BOHB as successive halving (sweep.brackets=1): every bracket starts 9 trials at 1/9,
    # 3 go on to 1/3 and 1 to the end, with hpbandster's model as it comes
    "bohb_sh": [
        "sweep.stages.0.search=bohb",
        "sweep.stages.0.scheduler=bohb",
        "sweep.grace_fraction=0.111",
        "sweep.brackets=1",
    ],
    # the control for bohb_sh: the same scheduler and brackets, every proposal random
    # (hpbandster draws at random when a uniform draw falls under random_fraction)
    "bohb_sh_random": [
        "sweep.stages.0.search=bohb",
        "sweep.stages.0.scheduler=bohb",
        "sweep.grace_fraction=0.111",
        "sweep.brackets=1",
        "sweep.bohb.random_fraction=1",
    ],
    # bohb_exploit ranking cooled-down forks at its rungs, as the sweeps do by default
    # (sweep.rung_cooldown): the forks' training is counted in its compute
    "bohb_exploit_forks": [
        "sweep.stages.0.search=bohb",
        "sweep.stages.0.scheduler=bohb",
        "sweep.grace_fraction=0.111",
        "sweep.bohb.random_fraction=0.1",
        "sweep.bohb.bandwidth_factor=1",
        "sweep.rung_cooldown=0.25",
    ],
    "asha_forks": [
        "sweep.stages.0.search=random",
        "sweep.stages.0.scheduler=asha",
        "sweep.rung_cooldown=0.25",
    ],
    # the sweeps' default: TPE's first 10 trials are random, then its model proposes
    "tpe_asha": ["sweep.stages.0.search=tpe", "sweep.stages.0.scheduler=asha"],
}


# methods whose searcher is seeded apart from the random search they are compared with
OWN_DRAWS = {"asha_own": 1000}


def run(
    method: str, seed: int, samples: int, tokens: int, extra: list[str], space: str = "lr2"
) -> list[dict]:
    seed += OWN_DRAWS.get(method, 0)
    return sweep_reports(
        [
            *COMMON,
            *SPACES[space],
            *METHODS[method],
            f"sweep.seed={seed}",
            f"sweep.stages.0.num_samples={samples}",
            f"sweep.budget.tokens_per_trial={tokens}",
            *extra,
        ]
    )


def sweep_reports(overrides: list[str]) -> list[dict]:
    """Every report of `python -m sweeper overrides`, run in a throwaway dir (reports.csv)."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "sweeper", *overrides, f"hydra.run.dir={tmp}/run"]
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        with open(Path(tmp) / "run" / "reports.csv") as f:
            return list(csv.DictReader(f))


def saved_run(path: Path | None, train: Callable[[], list[dict]]) -> list[dict]:
    """`train()`'s reports, kept at `path` (CSV): a run saved there before is read back and
    not trained again. Written whole or not at all, so a stopped bench leaves no half run."""
    if path is not None and path.exists():
        with open(path) as f:
            return list(csv.DictReader(f))
    reports = train()
    if path is not None and reports:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        with open(partial, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(reports[0]))
            writer.writeheader()
            writer.writerows(reports)
        partial.replace(path)
    return reports


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
        # a trial's training so far, with its rung forks' (sweep.rung_cooldown) where it has any
        flops = float(r["flops"]) + float(r.get("fork_flops") or 0.0)
        spent += flops - last.get(r["trial_id"], 0.0)
        last[r["trial_id"]] = flops
        done = r["final"] == "True" and r["status"] == "completed"
        if reached is None and done and float(r["val_bpb"]) <= target + 1e-9:
            reached = spent
    return reached, spent, best


# --- replay: ASHA's rule over random search's recorded curves ---------------------------
# Written here, not taken from Ray: this asks what ASHA would have spent on curves already
# recorded, under a ranking we choose (the recorded values, or an oracle's final values), with
# no trials run; Ray's scheduler can only be driven by live trials.
def curves(reports: list[dict]) -> list[list[tuple[float, float]]]:
    """Each completed trial's (flops, val_bpb) reports, trials in the order they started."""
    by_trial: dict[str, list[dict]] = {}
    for r in sorted(reports, key=lambda r: float(r["wall_time"])):
        by_trial.setdefault(r["trial_id"], []).append(r)
    return [
        [(float(r["flops"]), float(r["val_bpb"])) for r in rows]
        for rows in by_trial.values()
        if rows[-1]["status"] == "completed"
    ]


def replay_rungs(full: float, grace: float, rf: float) -> list[float]:
    """ASHA's rungs below a trial of `full` FLOPs: grace x full, then x rf each."""
    rungs, at = [], grace * full
    while at < full * (1 - 1e-9):
        rungs.append(at)
        at *= rf
    return rungs


def replay_asha(
    pool: list, order: list[int], target: float, grace: float, rf: float, oracle: bool
) -> float:
    """Compute (in full trials) async ASHA spends, 2 trials at a time, until a completed trial
    reaches `target`. Ray's rule: at a rung, a trial goes on if no value is recorded there
    yet or its value is within the best 1/rf of those recorded before it."""
    full = pool[0][-1][0]
    rungs = replay_rungs(full, grace, rf)
    recorded: dict[int, list[float]] = {k: [] for k in range(len(rungs))}
    queue, spent, running = list(order), [], []
    for worker in range(2):
        heapq.heappush(running, (0.0, worker, queue.pop(0), 0))
    reached = float("inf")
    while running:
        now, worker, i, k = heapq.heappop(running)
        if now >= reached:
            break
        curve, start = pool[i], rungs[k - 1] if k else 0.0
        final = curve[-1][1]
        if k < len(rungs):
            value = final if oracle else min(curve, key=lambda r: abs(r[0] - rungs[k]))[1]
            goes_on = not recorded[k] or value <= np.percentile(recorded[k], 100 / rf)
            recorded[k].append(value)
            spent.append((now, rungs[k] - start))
            if goes_on:
                heapq.heappush(running, (now + rungs[k] - start, worker, i, k + 1))
                continue
            now += rungs[k] - start
        else:
            spent.append((now, full - start))
            now += full - start
            if final <= target + 1e-9:
                reached = min(reached, now)
        if queue:
            heapq.heappush(running, (now, worker, queue.pop(0), 0))
    if reached == float("inf"):
        return reached
    return sum(min(cost, max(0.0, reached - begun)) for begun, cost in spent) / full


def replay_asha_promotion(
    pool: list, order: list[int], target: float, grace: float, rf: float, oracle: bool
) -> float:
    """Compute (in full trials) ASHA as published (Li et al., 2020, Algorithm 2) spends, 2
    trials at a time, until a completed trial reaches `target`. A trial pauses at each rung;
    a free worker takes the best trial not yet promoted from the top floor(n/rf) of the
    highest rung that has one, and resumes it to the next rung, else starts the next draw.
    Ray's scheduler stops trials rather than pausing them, so its first trial at a rung
    always goes on; here the first goes on only once rf trials are recorded there. When
    the draws run out, the top ceil(n/rf) of a rung go on, so a rung's last leader finishes."""
    full = pool[0][-1][0]
    rungs = replay_rungs(full, grace, rf)
    levels = [*rungs, full]
    recorded: list[dict[int, float]] = [{} for _ in rungs]
    promoted: list[set[int]] = [set() for _ in rungs]
    queue, spent, running, idle = list(order), [], [], []

    def next_job() -> tuple[int, int] | None:
        for k in reversed(range(len(rungs))):
            ranked = sorted(recorded[k], key=recorded[k].get)
            keep = int(len(ranked) // rf) if queue else math.ceil(len(ranked) / rf)
            for i in ranked[:keep]:
                if i not in promoted[k]:
                    promoted[k].add(i)
                    return i, k + 1
        return (queue.pop(0), 0) if queue else None

    def start(now: float, worker: int) -> None:
        job = next_job()
        if job is None:
            idle.append(worker)
            return
        i, level = job
        begin = levels[level - 1] if level else 0.0
        spent.append((now, levels[level] - begin))
        heapq.heappush(running, (now + levels[level] - begin, worker, i, level))

    for worker in range(2):
        start(0.0, worker)
    reached = float("inf")
    while running:
        now, worker, i, level = heapq.heappop(running)
        if now >= reached:
            break
        curve = pool[i]
        if level < len(rungs):
            at_rung = min(curve, key=lambda r: abs(r[0] - rungs[level]))[1]
            recorded[level][i] = curve[-1][1] if oracle else at_rung
        elif curve[-1][1] <= target + 1e-9:
            reached = min(reached, now)
        waiting, idle[:] = [worker, *idle], []
        for free in waiting:
            start(now, free)
    if reached == float("inf"):
        return reached
    return sum(min(cost, max(0.0, reached - begun)) for begun, cost in spent) / full


REPLAY_RULES = {"ray": replay_asha, "promotion": replay_asha_promotion}


def replay_report(
    pool: list, samples: int, draws: int, grace: float, rf: float, within: float = 0.0
) -> str:
    """Median compute to reach a random search's best (plus `within`), over random searches
    of `samples` curves drawn from the pool (ASHA then draws `draws` - `samples` more), as a
    fraction of that random search's compute: for Ray's rule and the published one, each
    with the recorded rung values and with an oracle's."""
    line = f"replay grace {grace:g}, rf {rf:g}{f', within {within:g}' if within else ''}:"
    for rule, replay in REPLAY_RULES.items():
        for oracle in (False, True):
            rng = np.random.default_rng(0)  # the same searches for every rule and ranking
            ratios = []
            for _ in range(400):
                order = [int(i) for i in rng.permutation(len(pool))[:draws]]
                target = min(pool[i][-1][1] for i in order[:samples]) + within
                ratios.append(replay(pool, order, target, grace, rf, oracle) / samples)
            ranking = "oracle" if oracle else "recorded"
            line += f" | {rule} {ranking} {np.median(ratios):.2f}x"
            line += f" ({np.mean(np.array(ratios) <= 1 / 3):.0%} within 1/3)"
    return line


def rank_report(pool: list) -> str:
    """How well each report of random search's trials ranks them by their final value
    (Spearman's rho over every completed trial): the ceiling of what a rung can know."""
    from scipy.stats import spearmanr

    longest = max(len(curve) for curve in pool)
    pool = [curve for curve in pool if len(curve) == longest]  # the same reports in each
    final = [curve[-1][1] for curve in pool]
    full = pool[0][-1][0]
    cells = []
    for k in range(len(pool[0]) - 1):
        at_k = [curve[k][1] for curve in pool]
        cells.append(f"{pool[0][k][0] / full:.3g}: {spearmanr(at_k, final).statistic:.2f}")
    return f"rank correlation with the final value ({len(pool)} trials), by fraction: " + (
        ", ".join(cells)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds run from this one")
    parser.add_argument("--samples", type=int, default=16, help="random search's trials")
    parser.add_argument(
        "--budget-samples",
        type=int,
        default=48,
        help="trials ASHA/BOHB may draw; compute is counted until they reach",
    )
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument(
        "--space", choices=SPACES, default="lr2", help="lr2: matrix and embedding LR; lr3: + head"
    )
    parser.add_argument(
        "--methods", default="asha,bohb", help=f"compared to random search: {', '.join(METHODS)}"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="extra overrides for every method, e.g. sweep.grace_fraction=0.111",
    )
    parser.add_argument(
        "--within",
        type=float,
        default=0.0,
        help="reach random search's best plus this many bits per byte (its seed noise: "
        "bench/bench_search_noise.py)",
    )
    parser.add_argument(
        "--replay",
        default="0.25:3,0.125:3",
        help="grace:reduction_factor pairs to replay ASHA over the random runs' curves",
    )
    parser.add_argument(
        "--save",
        type=Path,
        help="keep every run's reports here (SEED-METHOD.csv); a run already there is read "
        "back, not trained again (pool seeds, try another --within, go on after a stop). "
        "The name holds only the seed and method: one DIR per --space, --tokens and overrides",
    )
    args = parser.parse_args()
    methods = args.methods.split(",")

    def run_and_save(method: str, seed: int, samples: int) -> list[dict]:
        path = args.save / f"{seed}-{method}.csv" if args.save else None
        return saved_run(
            path, lambda: run(method, seed, samples, args.tokens, args.overrides, args.space)
        )

    pool: list = []
    ratios: dict[str, list[float]] = {method: [] for method in methods}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        random = run_and_save("random", seed, args.samples)
        _, random_total, target = compute_to_reach(random, float("-inf"))
        pool += curves(random)
        line = f"seed {seed}: random best {target:.4f} with {random_total:.3g} FLOPs"
        for method in methods:
            reports = run_and_save(method, seed, args.budget_samples)
            reached, total, best = compute_to_reach(reports, target + args.within)
            ratio = reached / random_total if reached is not None else float("inf")
            ratios[method].append(ratio)
            line += (
                f" | {method}: best {best:.4f}, total {total / random_total:.2f}x, "
                f"reached at {'never' if reached is None else f'{ratio:.2f}x'}"
            )
        print(line, flush=True)
    for method, values in ratios.items():
        print(
            f"{method}: median compute to reach random search's best"
            f"{f' + {args.within:g}' if args.within else ''} = "
            f"{statistics.median(values):.2f}x of random's ({args.seeds} seeds: "
            f"{', '.join('never' if v == float('inf') else f'{v:.2f}' for v in values)})"
        )
    print(rank_report(pool), flush=True)
    draws = min(args.budget_samples, len(pool))
    for pair in filter(None, args.replay.split(",")):
        grace, rf = (float(v) for v in pair.split(":"))
        print(replay_report(pool, args.samples, draws, grace, rf, args.within), flush=True)


if __name__ == "__main__":
    main()
