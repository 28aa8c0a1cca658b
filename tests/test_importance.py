"""sweep/importance.py: each searched parameter's share of a stage's metric (fANOVA)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sweeper.report.importance import MIN_TRIALS, importance_text, stage_importance
from sweeper.sweep.space import parse_param

LR = parse_param("optimizer.matrix_lr", {"log_uniform": [0.002, 0.2]})
EMBEDDING_LR = parse_param("optimizer.embedding_lr", {"log_uniform": [0.03, 1.0]})
BATCH = parse_param("trainer.total_batch_size", {"grid": [4096, 8192, 16384]})


def records(metric, n=24, seed=0, status="completed", prefix="t"):
    """n trials at random points of the three params, valued by `metric(lr, emb, batch)`."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lr = float(np.exp(rng.uniform(math.log(0.002), math.log(0.2))))
        emb = float(np.exp(rng.uniform(math.log(0.03), math.log(1.0))))
        batch = int(rng.choice([4096, 8192, 16384]))
        params = {LR.name: lr, EMBEDDING_LR.name: emb, BATCH.name: batch}
        out.append(
            {
                "trial_id": f"{prefix}{i}",
                "status": status,
                "params": params,
                "metric": metric(*params.values()),
            }
        )
    return out


def test_the_parameter_the_metric_follows_takes_nearly_all_the_variance():
    def by_lr(lr, emb, batch):  # a bowl in log LR; the rest does not matter
        return 3.0 + (math.log10(lr) - math.log10(0.02)) ** 2

    result = stage_importance([LR, EMBEDDING_LR], records(by_lr))
    assert result["method"] == "fanova" and result["trials"] == 24
    assert list(result["params"]) == [LR.name, EMBEDDING_LR.name]  # largest first
    assert result["params"][LR.name] > 0.9
    assert sum(result["params"].values()) == pytest.approx(1.0)
    # how sure: over 24 trials the bootstrap's interval keeps LR well above the other
    low, high = result["intervals"][LR.name]
    assert 0.5 < low <= high <= 1.0 and result["intervals"][EMBEDDING_LR.name][1] < 0.5

    def by_embedding(lr, emb, batch):
        return 3.0 + (math.log10(emb) - math.log10(0.2)) ** 2

    result = stage_importance([LR, EMBEDDING_LR], records(by_embedding))
    assert result["params"][EMBEDDING_LR.name] > 0.9
    # a grid's values are categories: the batch size the metric follows
    result = stage_importance([LR, BATCH], records(lambda lr, emb, batch: 3.0 + batch / 16384))
    assert result["params"][BATCH.name] > 0.9
    text = importance_text(result)
    intervals = result["intervals"]
    shown = [
        f"{name} {result['params'][name]:.2f} [{intervals[name][0]:.2f}, {intervals[name][1]:.2f}]"
        for name in (BATCH.name, LR.name)
    ]
    assert text == (
        "importance (fANOVA over 24 trials that ran their whole budget, 95% bootstrap "
        f"intervals): {', '.join(shown)}"
    )


def test_only_trials_that_ran_their_whole_budget_count():
    def by_lr(lr, emb, batch):
        return 3.0 + (math.log10(lr) - math.log10(0.02)) ** 2

    # pruned trials, valued early in training by the other parameter, change nothing
    pruned = records(lambda lr, emb, batch: 9.0 + emb, n=30, seed=1, status="pruned", prefix="p")
    diverged = records(lambda *_: float("nan"), n=5, seed=2, prefix="d")  # no point either
    both = stage_importance([LR, EMBEDDING_LR], records(by_lr) + pruned + diverged)
    alone = stage_importance([LR, EMBEDDING_LR], records(by_lr))
    assert both == alone


def test_too_few_finished_trials_say_so_and_one_parameter_has_no_share_to_give():
    few = records(lambda lr, emb, batch: lr, n=MIN_TRIALS - 1)
    result = stage_importance([LR, EMBEDDING_LR], few)
    assert result["params"] is None and result["trials"] == MIN_TRIALS - 1
    assert importance_text(result) == (
        f"importance: not estimated, {MIN_TRIALS - 1} trial(s) ran their whole budget; "
        f"it needs {MIN_TRIALS}"
    )
    assert stage_importance([LR], records(lambda lr, emb, batch: lr)) is None


def test_a_scaling_grid_that_searches_the_budget_shares_out_nothing():
    # lr_scaling's stage: the budget lowers the loss whatever the LR (it took 0.97)
    budget = parse_param("trainer.budget_flops", {"grid": [1e12, 3e12, 1e13]})
    rows = [
        {
            "trial_id": f"t{i}",
            "status": "completed",
            "metric": 3.0 - math.log10(c) / 10 + lr,
            "params": {LR.name: lr, budget.name: c},
        }
        for i, (c, lr) in enumerate((c, lr) for c in budget.values for lr in (0.01, 0.02, 0.04))
    ]
    result = stage_importance([LR, budget], rows, metric="val_bpb")
    assert result["params"] is None
    assert importance_text(result) == (
        "importance: not estimated, the stage searches the budget (trainer.budget_flops), and "
        "a larger one lowers val_bpb whatever the rest; the fit compares the rest budget by "
        "budget (fit.json's hparams)"
    )


def test_where_a_scheduler_stopped_most_trials_they_are_compared_where_it_compared_them():
    def by_lr(lr, emb, batch):
        return 3.0 + (math.log10(lr) - math.log10(0.02)) ** 2

    trials = records(by_lr)  # 24 trials, ASHA-like: all reach 1,000 tokens, 6 reach 2,000,
    reports = []  # and 2 run their whole 4,000
    for i, trial in enumerate(trials):
        reached = 4000 if i < 2 else 2000 if i < 6 else 1000
        trial["status"] = "completed" if reached == 4000 else "pruned"
        for tokens in (1000, 2000, 4000):
            if tokens <= reached:
                # what the scheduler ranked (the cooled-down fork), beside the run's own value
                value = trial["metric"] + 4000 / tokens
                row = {"trial_id": trial["trial_id"], "tokens": tokens, "val_bpb": 99.0}
                reports.append(row | {"rung_val_bpb": value})
    result = stage_importance([LR, EMBEDDING_LR], trials, reports, "val_bpb")
    assert (result["trials"], result["tokens"]) == (6, 2000)  # the most that 5 reached
    alone = [{**t, "status": "completed", "metric": t["metric"] + 2.0} for t in trials[:6]]
    assert result["params"] == stage_importance([LR, EMBEDDING_LR], alone)["params"]
    assert importance_text(result).startswith(
        "importance (fANOVA over 6 trials at 2,000 tokens, the most they all reached, "
    )
    # a report with no tokens, or a NaN value (a diverged trial), is no point
    broken = [{**r, "rung_val_bpb": float("nan")} for r in reports if r["tokens"] == 2000]
    others = [r for r in reports if r["tokens"] != 2000]
    result = stage_importance([LR, EMBEDDING_LR], trials, others + broken, "val_bpb")
    assert (result["trials"], result["tokens"]) == (24, 1000)
    # nor a diverged trial's last report: its value is the searcher's penalty, not its
    # config's. Its reports before that count: here the 6 trials that reached 2,000
    # tokens diverge there, and the 24 are compared at 1,000 again
    reached = {r["trial_id"] for r in reports if r["tokens"] == 2000}
    diverged = [
        {**r, "status": "diverged"} | ({"rung_val_bpb": 1e9} if r["tokens"] == 2000 else {})
        if r["trial_id"] in reached
        else r
        for r in reports
        if r["tokens"] <= 2000
    ]
    result = stage_importance([LR, EMBEDDING_LR], trials, diverged, "val_bpb")
    assert (result["trials"], result["tokens"]) == (24, 1000)


def test_a_metric_the_params_do_not_move_and_values_off_the_space_are_no_points():
    flat = records(lambda lr, emb, batch: 3.0, n=8)
    result = stage_importance([LR, EMBEDDING_LR], flat, metric="val_bpb")
    assert result["params"] is None and result["trials"] == 8
    assert importance_text(result) == (
        "importance: not estimated, val_bpb does not vary with the params over these trials"
    )
    # a record whose value lies off the searched space (made elsewhere) is left out
    trials = records(lambda lr, emb, batch: 3.0 + math.log10(lr) ** 2, n=7)
    trials[0]["params"][LR.name] = 5.0
    trials[1]["params"][EMBEDDING_LR.name] = None
    assert stage_importance([LR, EMBEDDING_LR], trials)["trials"] == 5
    # five points: some resamples draw one point five times, which has no variance; the
    # interval comes from the others
    result = stage_importance([LR, EMBEDDING_LR], trials[2:])
    low, high = result["intervals"][LR.name]
    assert 0 <= low <= high <= 1


def test_a_large_stages_resamples_cost_what_a_20_trial_stages_do_and_agree_with_it():
    """Optuna's forest costs trees x trials: past 20 trials a resample's forest has fewer
    trees (64 x 20 / trials, at least 16). The shares come from the full forest; the
    intervals still bracket them, and are close to those of full forests."""
    from sweeper.report import importance

    assert [importance.resample_trees(n) for n in (5, 20, 40, 80, 100, 1000)] == [
        *(64, 64, 32, 16, 16, 16)
    ]

    def metric(lr, emb, batch):
        return 3 + (math.log10(lr) + 1.5) ** 2 + 0.2 * (math.log10(emb) + 0.5) ** 2

    trials = records(metric, n=60, seed=3)
    fewer = stage_importance([LR, EMBEDDING_LR], trials)
    for name, share in fewer["params"].items():
        low, high = fewer["intervals"][name]
        assert low <= share <= high, (name, share, low, high)
    full_forests = pytest.MonkeyPatch.context()
    with full_forests as patch:
        patch.setattr(importance, "FULL_FORESTS_UP_TO", 1000)
        full = stage_importance([LR, EMBEDDING_LR], trials)
    assert fewer["params"] == full["params"]  # the same full forest
    for name in full["params"]:
        assert fewer["intervals"][name] == pytest.approx(full["intervals"][name], abs=0.02)
