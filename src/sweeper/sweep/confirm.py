"""The best config and the baseline trained again on fresh seeds (`sweep.confirm_seeds`).

A sweep picks its best trial out of many runs on one seed, so its value is partly luck (the
winner's curse). Runs on seeds the sweep never used, paired by seed, show whether the
improvement stands above the seed-to-seed noise; the stats use the fresh seeds only.
"""

from __future__ import annotations

import copy
import statistics
import time

from sweeper.sweep.baseline import launch_once
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.stages import SEED_KEY, finite_number
from sweeper.sweep.state import SweepState, as_json


def fresh_seeds(base: dict, count: int, state: SweepState | None = None) -> list[int]:
    """The `count` seeds after the one the sweep trained on (`trainer.seed`), passing over
    any a stage's trials trained on (a grid with trainer.seed as an axis)."""
    used = {int(base["trainer"]["seed"])}
    for stage in state.stages if state else []:
        used |= {int(r["params"][SEED_KEY]) for r in stage["records"] if SEED_KEY in r["params"]}
    seeds, candidate = [], int(base["trainer"]["seed"])
    while len(seeds) < count:
        candidate += 1
        if candidate not in used:
            seeds.append(candidate)
    return seeds


def with_seed(config: dict, seed: int) -> dict:
    config = copy.deepcopy(config)
    config["trainer"]["seed"] = seed
    return config


def kept_runs(state: SweepState) -> dict:
    """The confirmation runs in the state, {seed: {"best"|"baseline": {value, status}}},
    if they were trained for the sweep's current best config (else none)."""
    kept = state.confirmation or {}
    if not state.stages or kept.get("best_config") != as_json(state.stages[-1]["base_after"]):
        return {}
    return kept["runs"]


def missing_runs(plan: SweepPlan, state: SweepState) -> list[tuple[int, str]]:
    """(seed, "best"|"baseline") of each confirmation run `sweep.confirm_seeds` asks for
    that the state does not hold: none before a stage has a best, the baseline's only
    where the baseline has a value."""
    count = plan.spec.confirm_seeds
    if not count or not any(stage["best"] for stage in state.stages):
        return []
    which = ["best"] + (["baseline"] if (state.baseline or {}).get("value") is not None else [])
    runs = kept_runs(state)
    seeds = fresh_seeds(plan.base, count, state)
    return [(s, w) for s in seeds for w in which if w not in runs.get(str(s), {})]


def run_confirmation(plan: SweepPlan, state: SweepState) -> None:
    """Trains what `sweep.confirm_seeds` asks for and the state does not hold yet (a resumed
    sweep, or one that raised `confirm_seeds`, trains only the missing runs), saving the
    state after each run. Runs kept for another best config are dropped."""
    todo = missing_runs(plan, state)
    if not todo:
        return
    import ray

    base = plan.base
    best = as_json(state.stages[-1]["base_after"])
    runs = kept_runs(state)
    configs = {"best": best, "baseline": base}
    seeds = fresh_seeds(base, plan.spec.confirm_seeds, state)
    what = " and the baseline" if any(which == "baseline" for _, which in todo) else ""
    shown = ", ".join(str(s) for s in seeds)
    runs_shown = f"{len(todo)} run{'s' * (len(todo) > 1)}"
    print(f"confirm: training the best config{what} on fresh seeds {shown} ({runs_shown})")
    jobs = {launch_once(with_seed(configs[which], s), plan): (s, which) for s, which in todo}
    pending = list(jobs)
    # wall time of all confirmation runs, across resumes (the stages' is the summary's own)
    before = (state.confirmation or {}).get("elapsed_s", 0.0) if runs else 0.0
    started = time.time()
    while pending:
        (done,), pending = ray.wait(pending, num_returns=1)
        seed, which = jobs[done]
        try:
            result = ray.get(done)
        except Exception as error:  # a failed run must not lose the sweep's results
            result = {"value": None, "status": "failed", "error": str(error).splitlines()[0]}
        runs.setdefault(str(seed), {})[which] = {k: result[k] for k in ("value", "status")}
        elapsed = time.time() - started
        state.set_confirmation({"best_config": best, "runs": runs, "elapsed_s": before + elapsed})
        value = result["value"]
        # a user's function may complete without reporting the metric
        outcome = f"{value:.4f}" if finite_number(value) else result["status"]
        finished = len(todo) - len(pending)
        print(
            f"confirm: {finished}/{len(todo)} runs done ({which}, seed {seed}: {outcome}) "
            f"| {elapsed:.0f}s elapsed"
        )


def _spread(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None for fewer than two values)."""
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def confirmation_summary(plan: SweepPlan, state: SweepState) -> dict | None:
    """Per-seed values and their spread for summary.json, over the seeds that
    `sweep.confirm_seeds` asks for and that have run. The improvement is paired by seed
    (baseline minus best for `min`), over the seeds where both runs completed."""
    runs = kept_runs(state)
    seeds = fresh_seeds(plan.base, plan.spec.confirm_seeds, state)
    seeds = [str(s) for s in seeds if str(s) in runs]
    if not seeds:
        return None

    def values(which: str) -> list[float | None]:
        of_seeds = [runs[seed].get(which) or {} for seed in seeds]
        return [run.get("value") if run.get("status") == "completed" else None for run in of_seeds]

    best, baseline = values("best"), values("baseline")
    sign = 1.0 if plan.spec.mode == "min" else -1.0
    gains = [
        sign * (b - a) for a, b in zip(best, baseline) if finite_number(a) and finite_number(b)
    ]
    best_mean, best_std = _spread([v for v in best if finite_number(v)])
    base_mean, base_std = _spread([v for v in baseline if finite_number(v)])
    gain_mean, gain_std = _spread(gains)
    return {
        "seeds": [int(s) for s in seeds],
        "best": best,
        "baseline": baseline,
        "best_mean": best_mean,
        "best_std": best_std,
        "baseline_mean": base_mean,
        "baseline_std": base_std,
        "improvement_mean": gain_mean,
        "improvement_std": gain_std,
        "better_on": sum(gain > 0 for gain in gains),
        # runs that ended without a value: diverged or failed
        "no_value": [
            f"{which} on seed {seed} ({run['status']})"
            for seed in seeds
            for which, run in runs[seed].items()
            if run["status"] != "completed" or not finite_number(run["value"])
        ],
        "paired": len(gains),
        "elapsed_s": state.confirmation.get("elapsed_s"),
    }


def confirmation_lines(summary: dict, metric: str) -> list[str]:
    """The summary's lines on the fresh seeds."""

    def spread(mean, std) -> str:
        if mean is None:
            return "-"
        return f"{mean:.4f}" + (f" +- {std:.4f}" if std is not None else "")

    seeds = ", ".join(str(s) for s in summary["seeds"])
    line = f"fresh seeds {seeds}: best {metric} {spread(summary['best_mean'], summary['best_std'])}"
    if summary["baseline_mean"] is not None:
        line += f", baseline {spread(summary['baseline_mean'], summary['baseline_std'])}"
    if summary["paired"]:
        gain = spread(summary["improvement_mean"], summary["improvement_std"])
        line += f" -> {gain} better, on {summary['better_on']} of {summary['paired']} seeds"
    lines = [line]
    if summary["no_value"]:
        lines.append(f"note: no value from {', '.join(summary['no_value'])}")
    finite = [v for v in summary["best"] if finite_number(v)]
    if len(finite) > 1 and len(set(finite)) == 1:
        lines.append(
            "note: every fresh seed gave the same value: does the training read trainer.seed?"
        )
    return lines
