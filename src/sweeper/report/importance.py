"""Which of a stage's parameters mattered: Optuna's fANOVA over the stage's finished trials.

A stage that tunes two or more parameters ends with each one's share of the metric's
variance, as W&B Sweeps and Optuna's dashboard show it. Trials count at one budget only, as
in Optuna's `get_param_importances`: a pruned trial's value was taken earlier in training,
and mixing budgets would credit the parameters with the difference. Where too few trials
finished (ASHA stops most), the budget is the most tokens enough of them reached. A stage's
5-20 trials give a forest little to split on, so each share comes with a bootstrap interval
over the trials: a wide one says the stage cannot tell.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from sweeper.config.schema import BUDGET_KEYS
from sweeper.sweep.space import LIST_KINDS, ParamSpec
from sweeper.sweep.stages import finite_number
from sweeper.sweep.trainable import RUNG_METRIC

# fewer finished trials than this say too little for a forest to split on
MIN_TRIALS = 5
# resamples of the trials behind each interval: ~60 ms each for a stage's 5-20 trials
BOOTSTRAPS = 40
# Optuna's forest costs trees x trials (0.43 s for 64 trees and 100 trials): past
# FULL_FORESTS_UP_TO trials a resample's forest has fewer trees, at least MIN_TREES (the
# interval a little wider); the shares themselves always come from the full forest.
TREES = 64
FULL_FORESTS_UP_TO = 20
MIN_TREES = 16


def _distribution(param: ParamSpec) -> Any:
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    if param.kind in LIST_KINDS:  # choice and grid alike: the values tried
        return CategoricalDistribution(list(param.values))
    if param.log:  # given as its logarithm: see _coordinate
        return FloatDistribution(math.log(param.low), math.log(param.high))
    if param.integer:
        return IntDistribution(param.low, param.high)
    return FloatDistribution(param.low, param.high)


def _coordinate(param: ParamSpec, value: Any) -> Any:
    """Where a value sits in the space fANOVA integrates over. Optuna's evaluator works on
    a log-scale parameter's raw values, so the variance of an LR searched over [1e-4, 1]
    came mostly from its top decade: a value that followed the LR alone gave it 0.18-0.97
    of the variance over 16 random trials (10 draws), against 0.41-0.98 in log space, where
    the search drew it."""
    return math.log(value) if param.log else value


def _inside(param: ParamSpec, value: Any) -> bool:
    """A value the param's distribution holds (a record made elsewhere may not)."""
    if param.kind in LIST_KINDS:
        return value in param.values
    return (
        finite_number(value) and param.low <= value <= param.high and (value > 0 or not param.log)
    )


def _whole_budget_values(records: list[dict]) -> dict[str, float]:
    """trial id -> its metric, for the trials that ran their whole budget."""
    return {
        r["trial_id"]: r["metric"]
        for r in records
        if r["status"] == "completed" and finite_number(r.get("metric"))
    }


def _common_budget_values(reports: list[dict], metric: str) -> tuple[dict[str, float], int]:
    """(trial id -> its value, tokens) at the most tokens that MIN_TRIALS trials all reached
    and reported at; ({}, 0) if none. The value is what the stage's scheduler ranked there
    (the cooled-down fork's, with rung forks on)."""
    # a diverged trial's last report holds the searcher's penalty (1e9 for a user's
    # function), not a value of its config: it would swamp the variance. Its reports
    # before that are values like any other trial's.
    penalised = {}
    for row in reports:
        if row.get("status") == "diverged" and row.get("tokens"):
            penalised[row["trial_id"]] = max(penalised.get(row["trial_id"], 0), row["tokens"])
    at: dict[int, dict[str, float]] = {}
    for row in reports:
        value = row.get(RUNG_METRIC, row.get(metric))
        if penalised.get(row["trial_id"]) == row.get("tokens"):
            continue
        if finite_number(value) and row.get("tokens"):
            at.setdefault(int(row["tokens"]), {})[row["trial_id"]] = value
    reached = [tokens for tokens, values in at.items() if len(values) >= MIN_TRIALS]
    return (at[max(reached)], max(reached)) if reached else ({}, 0)


# run config keys that set how much a trial trains: a stage that searches one is a
# scaling grid, not a search for the best value of the others
BUDGET_PARAMS = frozenset(f"trainer.{key}" for key in BUDGET_KEYS)


def stage_importance(
    params: list[ParamSpec], records: list[dict], reports: Sequence[dict] = (), metric: str = ""
) -> dict | None:
    """{"method", "trials", "tokens" (the budget compared: None for the whole one), "params":
    {name: share of variance, summing to 1, largest first}, "intervals": {name: [low,
    high], 95% percentile bootstrap}} for a stage of two or more searched parameters; None
    for a stage of one. From the trials that ran their whole budget where MIN_TRIALS did;
    else, where a scheduler stopped most trials early, from every trial's value at the most
    tokens MIN_TRIALS of them reached (ASHA's first rung, typically): there the trials were
    compared on equal terms. "params" is None, with a "note", when neither has enough."""
    if len(params) < 2:
        return None
    if budget := next((p.name for p in params if p.name in BUDGET_PARAMS), None):
        # a scaling grid: more compute always wins, so the budget would take nearly every
        # share (0.97 on lr_scaling) and the rest would mix values from unequal budgets
        note = (
            f"the stage searches the budget ({budget}), and a larger one lowers "
            f"{metric or 'the metric'} whatever the rest; the fit compares the rest budget by "
            "budget (fit.json's hparams)"
        )
        return {"method": "fanova", "trials": 0, "tokens": None, "params": None, "note": note}
    searched = {
        r["trial_id"]: r["params"]
        for r in records
        if all(_inside(p, r["params"].get(p.name)) for p in params)
    }
    values = {t: v for t, v in _whole_budget_values(records).items() if t in searched}
    tokens = None
    if len(values) < MIN_TRIALS:
        rows = [row for row in reports if row["trial_id"] in searched]
        earlier, tokens = _common_budget_values(rows, metric)
        if not earlier:
            return {
                "method": "fanova",
                "trials": len(values),
                "tokens": None,
                "params": None,
                "note": f"{len(values)} trial(s) ran their whole budget; it needs {MIN_TRIALS}",
            }
        values = earlier
    result: dict[str, Any] = {"method": "fanova", "trials": len(values), "tokens": tokens}
    points = [
        ({p.name: _coordinate(p, searched[trial][p.name]) for p in params}, value)
        for trial, value in values.items()
    ]
    distributions = {p.name: _distribution(p) for p in params}
    shares = _fanova(points, distributions)
    if shares is None:
        note = f"{metric or 'the metric'} does not vary with the params over these trials"
        return result | {"params": None, "note": note}
    # the trials again, resampled: with a stage's 5-20 trials the forest's shares move a
    # lot with which trials there were, and the interval says how much. A resample of one
    # trial drawn again and again has no variance to share out: it is left out.
    rng = np.random.default_rng(0)
    trees = resample_trees(len(points))
    resampled = [
        _fanova(
            [points[i] for i in rng.integers(len(points), size=len(points))], distributions, trees
        )
        for _ in range(BOOTSTRAPS)
    ]
    resampled = [r for r in resampled if r is not None]
    result["params"] = dict(sorted(shares.items(), key=lambda item: -item[1]))
    result["intervals"] = {
        name: [float(q) for q in np.percentile([r[name] for r in resampled], [2.5, 97.5])]
        if resampled
        else None
        for name in result["params"]
    }
    return result


def resample_trees(trials: int) -> int:
    """Trees in a bootstrap resample's forest: the full 64 up to 20 trials, then as many as
    keep its cost at 20 trials' (64 x 20 / trials), at least 16."""
    if trials <= FULL_FORESTS_UP_TO:
        return TREES
    return max(MIN_TREES, TREES * FULL_FORESTS_UP_TO // trials)


def _fanova(
    points: list[tuple[dict, float]], distributions: dict, trees: int = TREES
) -> dict[str, float] | None:
    """Each parameter's share of the variance of `points` ((params, value) pairs); None
    where no tree finds any (equal values, or a resample of one point drawn again and
    again: Optuna raises "zero total variance")."""
    import optuna
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no INFO line per study
    study = optuna.create_study()  # in memory, gone with this call
    for values, value in points:
        study.add_trial(
            optuna.trial.create_trial(params=values, distributions=distributions, value=value)
        )
    try:
        evaluator = FanovaImportanceEvaluator(n_trees=trees, seed=0)
        shares = get_param_importances(study, evaluator=evaluator)
    except RuntimeError as error:  # equal values, or points no tree can tell apart
        if "zero total variance" in str(error):
            return None
        raise
    # a parameter a resample holds at one value has no share (Optuna leaves it out)
    return {name: float(shares.get(name, 0.0)) for name in distributions}


def importance_text(importance: dict) -> str:
    """'importance (fANOVA over 6 trials that ran their whole budget, 95% bootstrap
    intervals): optimizer.matrix_lr 0.77 [0.31, 0.98], ...', or why there is none."""
    if importance["params"] is None:
        return f"importance: not estimated, {importance['note']}"
    intervals = importance["intervals"]
    shares = ", ".join(
        f"{name} {share:.2f}"
        + (f" [{intervals[name][0]:.2f}, {intervals[name][1]:.2f}]" if intervals[name] else "")
        for name, share in importance["params"].items()
    )
    budget = (
        "that ran their whole budget"
        if importance["tokens"] is None
        else f"at {importance['tokens']:,} tokens, the most they all reached"
    )
    return (
        f"importance (fANOVA over {importance['trials']} trials {budget}, "
        f"95% bootstrap intervals): {shares}"
    )
