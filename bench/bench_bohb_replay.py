"""BOHB replayed over a grid of recorded learning curves: what its own model (hpbandster's)
adds to its brackets on the search bench's problem, with the rungs' rankings as recorded
and with an oracle's, over hundreds of random searches instead of the live bench's ten.

The live bench (bench_search.py) runs BOHB for real, but one seed costs minutes and one
seed's outcome swings between 0.2x and never. Here every configuration a method asks for is
read off a 16 x 16 grid of real training runs (the bench's trial: tiny preset, 64 steps,
matrix LR in [0.001, 0.3] and embedding LR in [0.01, 3], both log), at each of its 8
reports: bilinear in log LR between the grid's runs, or (--nearest) the nearest run's
curve, which keeps each run's own scatter instead of averaging it away. The grid is kept
in bench/data/lr_grid.json (recording it again takes ~10 minutes on 2 cores; its 15
low-LR runs that a patience of 1 had stopped were re-run at the default 6 and learn); 200
replayed searches take ~10 minutes (hpbandster's KDE sampling).

    python bench/bench_bohb_replay.py --searches 200 [--nearest]

Each method's compute to reach a random search's best (in full trials, as a fraction of
the random search's 16) is compared with the same brackets proposing at random
(`hyperband`, `sh`): the difference is what BOHB's model adds. Rungs that rank trials by
their final value (`oracle`) show what it would add with a perfect early signal. ASHA is
replayed with bench_search.replay_asha. Neither replay models Ray's timing, and both are
harder than the live bench (ASHA reaches within 1/3 in ~30% of replayed searches, against
6 seeds of 10 live), so compare methods within one replay, not with live figures.
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import multiprocessing
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

MATRIX_LR = (0.001, 0.3)
EMBEDDING_LR = (0.01, 3.0)
TRIAL = [  # the search bench's trial (bench_search.COMMON), one torch thread as in a sweep
    "model=tiny",
    "trainer.device_batch_size=8",
    "trainer.total_batch_size=1024",
    "trainer.eval_tokens=8192",
    "trainer.budget_tokens=65536",
    "trainer.num_evals=8",
    "trainer.threads=1",
]
REPORTS = 8  # reports per trial: steps 8, 16, ..., 64


# --- the grid: real training runs ------------------------------------------------------
def _train_one(point: tuple[float, float]) -> list[float]:
    from omegaconf import OmegaConf

    from sweeper.config.compose import compose
    from sweeper.train.loop import train

    matrix_lr, embedding_lr = point
    overrides = [
        *TRIAL,
        f"optimizer.matrix_lr={matrix_lr}",
        f"optimizer.embedding_lr={embedding_lr}",
    ]
    tree = OmegaConf.to_container(compose(overrides), resolve=True)
    for key in ("sweep", "ray", "mlflow", "trainable", "hydra", "fit"):
        tree.pop(key, None)
    values = [h["val_bpb"] for h in train(tree, verbose=False)["history"]]
    return values + [float("nan")] * (REPORTS - len(values))  # a diverged run ends early


def record_grid(n: int, path: Path) -> dict:
    matrix = np.geomspace(*MATRIX_LR, n)
    embedding = np.geomspace(*EMBEDDING_LR, n)
    points = [(float(m), float(e)) for m in matrix for e in embedding]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        curves = []
        for i, curve in enumerate(pool.imap(_train_one, points), 1):
            curves.append(curve)
            print(f"\rgrid: {i}/{len(points)} runs", end="", flush=True)
    print()
    grid = {"matrix_lr": matrix.tolist(), "embedding_lr": embedding.tolist(), "curves": curves}
    path.write_text(json.dumps(grid))
    return grid


class Landscape:
    """val_bpb at report k (0..7) of any (matrix LR, embedding LR), bilinear in log LR.
    A diverged run (NaN) reads as the worst value recorded, as a sweep's penalty would."""

    def __init__(self, grid: dict, nearest: bool = False) -> None:
        self.nearest = nearest
        self.x = np.log(grid["matrix_lr"])
        self.y = np.log(grid["embedding_lr"])
        values = np.array(grid["curves"], dtype=float).reshape(len(self.x), len(self.y), -1)
        self.values = np.where(np.isfinite(values), values, np.nanmax(values))

    def __call__(self, matrix_lr: float, embedding_lr: float) -> np.ndarray:
        """The whole curve (REPORTS values) of one configuration."""
        if self.nearest:
            i = int(np.argmin(abs(self.x - np.log(matrix_lr))))
            return self.values[i, int(np.argmin(abs(self.y - np.log(embedding_lr))))]
        fx = np.interp(np.log(matrix_lr), self.x, np.arange(len(self.x)))
        fy = np.interp(np.log(embedding_lr), self.y, np.arange(len(self.y)))
        i, j = min(int(fx), len(self.x) - 2), min(int(fy), len(self.y) - 2)
        a, b = fx - i, fy - j
        v = self.values
        return (
            (1 - a) * (1 - b) * v[i, j]
            + a * (1 - b) * v[i + 1, j]
            + (1 - a) * b * v[i, j + 1]
            + a * b * v[i + 1, j + 1]
        )


def draw(rng: np.random.Generator) -> tuple[float, float]:
    """One configuration, log-uniform in both LRs (the bench's random search)."""
    return (
        float(np.exp(rng.uniform(*np.log(MATRIX_LR)))),
        float(np.exp(rng.uniform(*np.log(EMBEDDING_LR)))),
    )


# --- BOHB: Ray's HyperBandForBOHB brackets, hpbandster's model, two trials at a time ------
# Written here, not run through Ray: Tune cannot drive a trial from a table. The rules are
# the sweeps' (src/sweeper/sweep/hyperband.py): brackets of eta 3 over budgets of 1/9, 1/3
# and 1 (reached at reports 1, 3 and 8, as the live bench's rounding puts them), the most
# aggressive bracket first, the oldest bracket goes on first, a rung is decided once all of
# its bracket's trials are there, and the result that reaches a rung is what the model sees.
ETA, UNITS = 3, 9


def report_of(units: int) -> int:
    return -(-units * REPORTS // UNITS)  # the first report at or past the budget


@dataclass
class Bracket:
    size: int  # trials it is given (n0)
    rungs: list[int]  # reports at which its rungs fall, the last is the full trial
    trials: list[dict] = field(default_factory=list)

    def filled(self) -> bool:
        return len(self.trials) >= self.size


@dataclass
class Variant:
    name: str
    brackets: int = 3  # the most aggressive kept (sweep.brackets)
    oracle: bool = False  # rungs rank trials by their final value
    model_from: int = 1  # smallest budget (units of 1/9) whose results the model sees
    model: dict = field(default_factory=dict)  # hpbandster's settings (sweep.bohb)


def replay_bohb(
    landscape: Landscape, variant: Variant, target: float, seed: int, max_trials: int
) -> float:
    """Compute (in full trials) BOHB spends until a completed trial reaches `target`."""
    import ConfigSpace as CS
    from hpbandster.optimizers.config_generators.bohb import BOHB

    space = CS.ConfigurationSpace(seed=seed)
    space.add(
        [
            CS.UniformFloatHyperparameter("matrix_lr", *MATRIX_LR, log=True),
            CS.UniformFloatHyperparameter("embedding_lr", *EMBEDDING_LR, log=True),
        ]
    )
    np.random.seed(seed)  # hpbandster draws from numpy's global generator
    model = BOHB(space, **variant.model)
    s_max = round(np.log(UNITS) / np.log(ETA))
    cycle = list(range(s_max, s_max - variant.brackets, -1))
    brackets: list[Bracket] = []
    running: list[tuple] = []  # (end time, worker, start report, tiebreak, trial)
    segments: list[tuple[int, int, int]] = []  # (start time, first report, last report)
    given = 0

    def tell(trial: dict, report: int, bracket: Bracket) -> None:
        units = UNITS * ETA ** -(len(bracket.rungs) - 1 - bracket.rungs.index(report))
        if units < variant.model_from:
            return
        loss = trial["curve"][-1] if variant.oracle else trial["curve"][report - 1]
        job = type("Job", (), {})()
        job.result, job.exception = {"loss": float(loss)}, None
        job.kwargs = {"budget": float(units), "config": trial["config"]}
        model.new_result(job)

    def decide(bracket: Bracket, flush: bool = False) -> None:
        """Halve a rung once every trial going on has reached it."""
        going = [t for t in bracket.trials if not t["stopped"] and t["at"] < bracket.rungs[-1]]
        if not going or (not bracket.filled() and not flush):
            return
        if any(t["running"] or t["at"] != going[0]["at"] for t in going):
            return
        at = going[0]["at"]
        score = (lambda t: t["curve"][-1]) if variant.oracle else (lambda t: t["curve"][at - 1])
        going.sort(key=score)
        keep = -(-len(going) // ETA)
        for t in going[keep:]:
            t["stopped"] = True
        for t in going[:keep]:
            t["waiting"] = True

    def next_trial() -> tuple[dict, Bracket] | None:
        nonlocal given
        for bracket in brackets:  # the oldest bracket goes on first
            for t in bracket.trials:
                if t["waiting"]:
                    t["waiting"] = False
                    return t, bracket
        if given >= max_trials:
            return None
        if not brackets or brackets[-1].filled():
            s = cycle[len(brackets) % len(cycle)]
            first = UNITS // ETA**s
            rungs = [report_of(first * ETA**k) for k in range(s + 1)]
            brackets.append(Bracket(size=-(-(s_max + 1) * ETA**s // (s + 1)), rungs=rungs))
        bracket = brackets[-1]
        first = UNITS * ETA ** -(len(bracket.rungs) - 1)
        config = model.get_config(budget=float(first))[0]
        trial = {
            "config": config,
            "curve": landscape(config["matrix_lr"], config["embedding_lr"]),
            "at": 0,
            "stopped": False,
            "waiting": False,
            "running": False,
        }
        bracket.trials.append(trial)
        given += 1
        return trial, bracket

    def start(now: int, worker: int) -> bool:
        picked = next_trial()
        if picked is None:
            return False
        trial, bracket = picked
        rung = next(r for r in bracket.rungs if r > trial["at"])
        trial["running"], trial["bracket"] = True, bracket
        heapq.heappush(running, (now + rung - trial["at"], worker, trial["at"], id(trial), trial))
        segments.append((now, trial["at"], rung))
        return True

    idle = {0, 1}

    def fill(now: int) -> None:
        for worker in sorted(idle):
            if start(now, worker):
                idle.discard(worker)

    fill(0)
    while running:
        now, worker, _, _, trial = heapq.heappop(running)
        idle.add(worker)
        bracket = trial["bracket"]
        trial["at"] = next(r for r in bracket.rungs if r > trial["at"])
        trial["running"] = False
        tell(trial, trial["at"], bracket)
        if trial["at"] == REPORTS and trial["curve"][-1] <= target + 1e-9:
            spent = sum(min(last, first + now - begun) - first for begun, first, last in segments)
            return spent / REPORTS
        decide(bracket)
        fill(now)
        if not running:  # nothing runs or waits: decide the rungs among the trials there are
            for b in brackets:
                decide(b, flush=True)
            fill(now)
    return float("inf")


# budgets 1/9, 1/3 and 1 in all of them (the live bench's sweep.grace_fraction=0.111)
VARIANTS = {
    "bohb": Variant("bohb"),  # all three brackets, hpbandster's defaults
    # the live bench's bohb_exploit: a tenth of proposals random, the good KDE at its width
    "bohb_exploit": Variant("bohb_exploit", model={"random_fraction": 0.1, "bandwidth_factor": 1}),
    "bohb_sh": Variant("bohb_sh", brackets=1),  # successive halving (sweep.brackets=1)
    # the model learns only from budgets of 1/3 and 1, where rungs rank better
    "bohb_sh_late": Variant("bohb_sh_late", brackets=1, model_from=3),
    # the same brackets with every proposal random: what the model adds, or costs
    "hyperband": Variant("hyperband", model={"random_fraction": 1.0}),
    "sh": Variant("sh", brackets=1, model={"random_fraction": 1.0}),
}


def _one_search(job: tuple) -> dict[str, float]:
    """One random search of `samples` and what each method spends to reach its best."""
    from bench_search import replay_asha

    grid, nearest, names, i, samples, budget_samples = job
    logging.getLogger("hpbandster").setLevel(logging.ERROR)
    landscape = Landscape(grid, nearest)
    rng = np.random.default_rng(i)
    target = min(landscape(*draw(rng))[-1] for _ in range(samples))
    own = [landscape(*draw(rng)) for _ in range(budget_samples)]
    pool = [[(k + 1.0, v) for k, v in enumerate(curve)] for curve in own]
    found = {}
    for oracle in (False, True):
        spent = replay_asha(pool, list(range(len(pool))), target, 0.125, 3, oracle)
        found[f"asha{' oracle' if oracle else ''}"] = spent / samples
    for name in names:
        for oracle in (False, True):
            variant = Variant(**{**VARIANTS[name].__dict__, "oracle": oracle})
            spent = replay_bohb(landscape, variant, target, 1000 + i, budget_samples)
            found[f"{name}{' oracle' if oracle else ''}"] = spent / samples
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--searches", type=int, default=200, help="random searches replayed")
    parser.add_argument("--samples", type=int, default=16, help="random search's trials")
    parser.add_argument("--budget-samples", type=int, default=48)
    parser.add_argument(
        "--grid",
        type=Path,
        default=REPO / "bench" / "data" / "lr_grid.json",
        help="recorded curves (recorded here first when the file does not exist)",
    )
    parser.add_argument(
        "--nearest", action="store_true", help="each configuration reads its nearest run"
    )
    parser.add_argument("--grid-size", type=int, default=16)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    if args.grid.exists():
        grid = json.loads(args.grid.read_text())
    else:
        args.grid.parent.mkdir(parents=True, exist_ok=True)
        grid = record_grid(args.grid_size, args.grid)
    names = [v for v in args.variants.split(",") if v]
    jobs = [
        (grid, args.nearest, names, i, args.samples, args.budget_samples)
        for i in range(args.searches)
    ]
    ratios: dict[str, list[float]] = {}
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        for i, found in enumerate(pool.imap(_one_search, jobs), 1):
            for name, ratio in found.items():
                ratios.setdefault(name, []).append(ratio)
            print(f"\rreplayed {i}/{args.searches} random searches", end="", file=sys.stderr)
    print(file=sys.stderr)
    how = "nearest run" if args.nearest else "bilinear"
    print(
        f"| method ({args.searches} searches of {args.samples}, {how}) | median | <= 1/3 | never |"
    )
    print("|---|---:|---:|---:|")
    for name, values in ratios.items():
        median = statistics.median(values)
        within = sum(v <= 1 / 3 for v in values) / len(values)
        never = sum(v == float("inf") for v in values) / len(values)
        shown = "never" if median == float("inf") else f"{median:.2f}x"
        print(f"| {name} | {shown} | {within:.0%} | {never:.0%} |")


if __name__ == "__main__":
    main()
