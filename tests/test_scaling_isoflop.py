"""IsoFLOP profiles, power laws of optima and optimal hyperparameters vs compute."""

from __future__ import annotations

import numpy as np
import pytest

from sweeper.scaling import (
    compute_optimal,
    fit_hparam_vs_compute,
    fit_isoflop,
    fit_power_law,
    fit_profile,
    group_by_budget,
    optima_exponent,
)

BUDGETS = np.logspace(18, 21, 7)


def parabola_grid(a=0.52, k=0.09, curvature=0.08, seed=0):
    """Points whose loss is exactly a parabola in ln N around N_opt = k C^a (asymmetric grid)."""
    rng = np.random.default_rng(seed)
    n, loss, c, labels = [], [], [], []
    for budget in BUDGETS:
        n_opt = k * budget**a
        sizes = n_opt * 10 ** (np.linspace(-0.6, 0.7, 7) + rng.uniform(-0.05, 0.05))
        base = 2.0 + 50 * budget**-0.1
        n += list(sizes)
        loss += list(base + curvature * np.log(sizes / n_opt) ** 2)
        c += [budget] * len(sizes)
        labels += [f"{budget:.3g}"] * len(sizes)
    return np.array(n), np.array(loss), np.array(c), labels


def test_isoflop_recovers_planted_exponent():
    n, loss, c, labels = parabola_grid(a=0.52)
    fit = fit_isoflop(n, loss, c, labels)
    assert len(fit.profiles) == len(BUDGETS)
    assert all(p.valid and not p.flags for p in fit.profiles)
    assert fit.n_opt_law.p == pytest.approx(0.52, abs=1e-6)
    assert fit.d_opt_law.p == pytest.approx(0.48, abs=1e-6)  # D_opt = C / (6 N_opt)
    assert fit.n_opt_law.r2 == pytest.approx(1.0)
    assert fit.to_dict()["a"] == pytest.approx(0.52, abs=1e-6)


def test_isoflop_on_a_planted_chinchilla_law():
    """Parabola minima of L(N, C/6N) follow the law's own exponent beta/(alpha+beta)."""
    e, a_, b_, alpha, beta = 1.7, 400.0, 410.0, 0.34, 0.28
    n, loss, c, d = [], [], [], []
    for budget in BUDGETS:
        n_opt = compute_optimal(e, a_, b_, alpha, beta, budget)[0]
        sizes = n_opt * np.logspace(-0.5, 0.5, 9)
        tokens = budget / (6 * sizes)
        n += list(sizes)
        d += list(tokens)
        loss += list(e + a_ / sizes**alpha + b_ / tokens**beta)
        c += [budget] * len(sizes)
    fit = fit_isoflop(n, loss, c, budget=c, d=d)
    assert fit.n_opt_law.p == pytest.approx(beta / (alpha + beta), abs=0.01)
    assert fit.d_opt_law.p == pytest.approx(alpha / (alpha + beta), abs=0.01)


def test_profile_flags():
    sizes = np.logspace(7, 9, 5)
    x = np.log(sizes)
    down = fit_profile(sizes, 3.0 - 0.01 * (x - x.mean()) ** 2, 1e19)
    assert not down.valid and "opens_downward" in down.flags and down.n_opt is None
    outside = fit_profile(sizes, 3.0 + 0.01 * (x - x.max() - 2.0) ** 2, 1e19)
    assert not outside.valid and "outside_grid" in outside.flags and "edge" in outside.flags
    edge = fit_profile(sizes, 3.0 + 0.05 * (x - x[-1] + 0.1) ** 2, 1e19)
    assert edge.valid and edge.flags == ["edge"]
    few = fit_profile(sizes[:2], [3.0, 2.9], 1e19)
    assert not few.valid and few.flags == ["too_few_sizes"]


def test_profile_keeps_best_run_per_size_and_interpolates_d():
    sizes = np.repeat(np.logspace(7, 9, 5), 2)
    x = np.log(sizes)
    loss = 3.0 + 0.05 * (x - x.mean()) ** 2 + np.tile([0.0, 0.3], 5)  # second LR is worse
    d = 1e19 / (5.0 * sizes)  # a non-6ND convention: D_opt comes from the data
    prof = fit_profile(sizes, loss, 1e19, d=d)
    assert prof.n_sizes == 5
    assert prof.n_opt == pytest.approx(np.exp(x.mean()), rel=1e-9)
    assert prof.d_opt == pytest.approx(1e19 / (5.0 * prof.n_opt), rel=1e-9)


def test_isoflop_with_too_few_budgets_warns():
    n, loss, c, labels = parabola_grid()
    one = np.array(labels) == labels[0]
    fit = fit_isoflop(n[one], loss[one], c[one], [lab for lab, k in zip(labels, one) if k])
    assert fit.n_opt_law is None and any("need >= 2" in w for w in fit.warnings)


def test_group_by_budget_labels_and_bins():
    c = np.array([1.0e18, 1.05e18, 3e18, 2.9e18, 1e19])
    groups = group_by_budget(c)
    assert [len(idx) for _, idx, _ in groups] == [2, 2, 1]
    labelled = group_by_budget(c, ["x", "x", "y", "y", "y"])
    assert [len(idx) for _, idx, _ in labelled] == [2, 3]
    assert labelled[0][0] == pytest.approx(np.median(c[:2]))  # non-numeric label -> median C
    numeric = group_by_budget(c, [1e18, 1e18, 3e18, 3e18, 1e19])
    assert [v for v, _, _ in numeric] == [1e18, 3e18, 1e19]


def test_power_law_and_hparam_recover_planted_exponent():
    c = np.logspace(17, 21, 6)
    lr = 0.8 * c**-0.125
    law = fit_hparam_vs_compute(c, lr)
    assert law.p == pytest.approx(-0.125, abs=1e-9)
    assert law.k == pytest.approx(0.8, rel=1e-6)
    two = fit_power_law(c[:2], lr[:2])
    assert two.p == pytest.approx(-0.125) and two.r2 is None
    with pytest.raises(ValueError):
        fit_power_law([1e18, 1e18], [1.0, 2.0])
    with pytest.raises(ValueError):
        fit_power_law([1e18, 1e19], [1.0, -2.0])


def test_optima_exponent_is_plain_ols():
    rng = np.random.default_rng(1)
    c = np.logspace(16, 19, 12)
    n_opt = 3.0 * c**0.5 * np.exp(rng.normal(0, 0.05, c.size))
    expected = np.polyfit(np.log(c), np.log(n_opt), 1)[0]
    assert optima_exponent(c, n_opt) == pytest.approx(expected, rel=1e-12)
