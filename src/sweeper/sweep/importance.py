"""Which of a stage's parameters mattered: Optuna's fANOVA over the stage's finished trials.

A stage that tunes two or more parameters (the `lr` stage's matrix and embedding LRs, a
user's stage of several) ends with each parameter's share of the metric's variance, as W&B
Sweeps and Optuna's dashboard show it. Only trials that ran their whole budget count, as in
Optuna's own `get_param_importances`: a pruned trial's value was taken earlier in training,
and mixing the two would credit the parameters with the difference in budget.
"""

from __future__ import annotations

import math
from typing import Any

from sweeper.sweep.space import LIST_KINDS, ParamSpec

# fewer finished trials than this say too little for a forest to split on
MIN_TRIALS = 5


def _distribution(param: ParamSpec) -> Any:
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    if param.kind in LIST_KINDS:  # choice and grid alike: the values tried
        return CategoricalDistribution(list(param.values))
    if param.integer:
        return IntDistribution(param.low, param.high, log=param.log)
    return FloatDistribution(param.low, param.high, log=param.log)


def stage_importance(params: list[ParamSpec], records: list[dict]) -> dict | None:
    """{"method", "trials", "params": {name: share of variance, summing to 1, largest
    first}} for a stage of two or more searched parameters; "params" is None, with a
    "note", when too few trials finished. None for a stage of one parameter."""
    if len(params) < 2:
        return None
    finished = [
        r
        for r in records
        if r["status"] == "completed"
        and isinstance(r.get("metric"), int | float)
        and math.isfinite(r["metric"])
        and all(p.name in r["params"] for p in params)
    ]
    result: dict[str, Any] = {"method": "fanova", "trials": len(finished), "params": None}
    if len(finished) < MIN_TRIALS:
        result["note"] = (
            f"{len(finished)} trial(s) ran their whole budget; "
            f"the parameters' importance needs {MIN_TRIALS}"
        )
        return result
    import optuna
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no INFO line per study
    distributions = {p.name: _distribution(p) for p in params}
    study = optuna.create_study()  # in memory, gone with this call
    for record in finished:
        values = {name: record["params"][name] for name in distributions}
        study.add_trial(
            optuna.trial.create_trial(
                params=values, distributions=distributions, value=record["metric"]
            )
        )
    shares = get_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=0))
    result["params"] = {name: float(share) for name, share in shares.items()}
    return result


def importance_text(importance: dict) -> str:
    """'importance (fANOVA, 6 trials that ran their whole budget): optimizer.matrix_lr 0.77,
    optimizer.embedding_lr 0.23', or why there is none."""
    if importance["params"] is None:
        return f"importance: none yet, {importance['note']}"
    shares = ", ".join(f"{name} {share:.2f}" for name, share in importance["params"].items())
    return (
        f"importance (fANOVA, {importance['trials']} trials that ran their whole budget): {shares}"
    )
