"""Parametric law L(N, D) and compute frontier L(C): recovery of planted parameters."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import approx_fprime, check_grad, minimize_scalar

from sweeper.scaling import (
    compute_optimal,
    fit_chinchilla,
    fit_frontier,
    huber_objective,
    lower_envelope,
    start_grid,
)

PLANTED = {"E": 1.7, "A": 400.0, "B": 410.0, "alpha": 0.34, "beta": 0.28}


def planted_grid(noise=2e-3, seed=0):
    rng = np.random.default_rng(seed)
    n, d = np.meshgrid(np.logspace(7, 10, 10), np.logspace(9, 12, 10))
    n, d = n.ravel(), d.ravel()
    p = PLANTED
    loss = p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d ** p["beta"]
    return n, d, loss * np.exp(rng.normal(0.0, noise, n.size))


def test_start_grid_sizes():
    assert start_grid("full").shape == (4500, 5)
    assert start_grid("small").shape == (243, 5)
    with pytest.raises(ValueError):
        start_grid("huge")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_analytic_gradient_matches_finite_differences(seed):
    n, d, loss = planted_grid()
    args = (np.log(n), np.log(d), np.log(loss))
    rng = np.random.default_rng(seed)
    theta = np.array([6.0, 6.0, 0.5, 0.34, 0.28]) + rng.normal(0, 0.3, 5)
    f = lambda t: huber_objective(t, *args)[0]
    g = lambda t: huber_objective(t, *args)[1]
    fd = approx_fprime(theta, f, 1e-7)
    assert check_grad(f, g, theta, epsilon=1e-7) < 1e-5 * max(1.0, np.linalg.norm(fd))
    np.testing.assert_allclose(g(theta), central_diff(f, theta), rtol=1e-6, atol=1e-9)


def central_diff(f, x, h=1e-6):
    x = np.asarray(x, dtype=float)
    return np.array([(f(x + h * e) - f(x - h * e)) / (2 * h) for e in np.eye(len(x))])


def test_gradient_with_weights_and_quadratic_regime():
    n, d, loss = planted_grid(noise=1e-4)  # residuals inside the Huber quadratic zone
    args = (np.log(n), np.log(d), np.log(loss))
    w = np.random.default_rng(3).integers(0, 3, n.size).astype(float)
    theta = np.log([400.0, 410.0, 1.7]).tolist() + [0.34, 0.28]
    f = lambda t: huber_objective(t, *args, weights=w)[0]
    g = lambda t: huber_objective(t, *args, weights=w)[1]
    np.testing.assert_allclose(g(theta), central_diff(f, theta), rtol=1e-5, atol=1e-10)


def test_objective_vectorised_over_starts():
    n, d, loss = planted_grid()
    args = (np.log(n), np.log(d), np.log(loss))
    starts = start_grid("small")[:20]
    f_all, g_all = huber_objective(starts, *args)
    for i in (0, 7, 19):
        f1, g1 = huber_objective(starts[i], *args)
        assert f_all[i] == pytest.approx(f1, rel=1e-12)
        np.testing.assert_allclose(g_all[i], g1, rtol=1e-12, atol=1e-15)


def test_parametric_fit_recovers_planted_parameters():
    fit = fit_chinchilla(*planted_grid())
    assert fit.E == pytest.approx(PLANTED["E"], rel=0.01)
    assert fit.alpha == pytest.approx(PLANTED["alpha"], rel=0.03)
    assert fit.beta == pytest.approx(PLANTED["beta"], rel=0.03)
    assert fit.A == pytest.approx(PLANTED["A"], rel=0.15)
    assert fit.B == pytest.approx(PLANTED["B"], rel=0.15)
    assert fit.grad_norm < 1e-5 and not fit.warnings
    assert fit.n_starts == 4500 and fit.n_refined == 64


def test_single_start_and_small_grid_agree_with_full_grid():
    data = planted_grid()
    full = fit_chinchilla(*data)
    small = fit_chinchilla(*data, grid="small")
    single = fit_chinchilla(*data, x0=[5.0, 5.0, 0.0, 0.5, 0.5])
    for other in (small, single):
        assert other.objective == pytest.approx(full.objective, rel=1e-6)
        assert other.alpha == pytest.approx(full.alpha, rel=1e-4)
    assert single.n_starts == 1


def test_parametric_fit_rejects_bad_arrays():
    with pytest.raises(ValueError):
        fit_chinchilla([1e8, np.nan], [1e9, 1e9], [3.0, 3.0], x0=[5, 5, 0, 0.5, 0.5])
    with pytest.raises(ValueError):
        fit_chinchilla([1e8, 1e9], [1e9], [3.0, 3.0])


def test_compute_optimal_minimises_loss_on_the_isoflop():
    p = PLANTED
    c = 1e22
    n_opt, d_opt, loss_opt = compute_optimal(**p, flops=c)
    assert 6 * n_opt * d_opt == pytest.approx(c, rel=1e-9)
    law = lambda log_n: (
        p["E"]
        + p["A"] / np.exp(log_n) ** p["alpha"]
        + p["B"] / (c / 6 / np.exp(log_n)) ** p["beta"]
    )
    res = minimize_scalar(law, bounds=(10, 40), method="bounded", options={"xatol": 1e-10})
    assert np.exp(res.x) == pytest.approx(n_opt, rel=1e-4)
    assert loss_opt == pytest.approx(res.fun, rel=1e-9)


def test_lower_envelope_keeps_only_improvements():
    c = [1, 2, 3, 3, 4, 5, np.nan, 6]
    y = [5.0, 6.0, 4.0, 3.5, 4.0, 3.0, 1.0, 3.0]
    assert lower_envelope(c, y).tolist() == [0, 3, 5]


def planted_frontier(seed=0):
    """Frontier points on E + A C^-alpha plus dominated points (loss the frontier already
    reached at 1.5-10x less compute)."""
    rng = np.random.default_rng(seed)
    e, a, alpha = 1.7, 300.0, 0.15
    curve = lambda c: e + a * c**-alpha
    c_f = np.logspace(15, 21, 40)
    c_d = 10 ** rng.uniform(15.2, 21, 300)
    c = np.r_[c_f, c_d]
    y = np.r_[
        curve(c_f) * np.exp(rng.normal(0, 1e-3, c_f.size)), curve(c_d / rng.uniform(1.5, 10, 300))
    ]
    return c, y, (e, a, alpha)


def test_frontier_fit_recovers_planted_law():
    c, y, (e, a, alpha) = planted_frontier()
    env = lower_envelope(c, y)
    assert np.all(env < 40)  # dominated points never make the envelope
    fit = fit_frontier(c[env], y[env])
    assert fit.E == pytest.approx(e, rel=0.01)
    assert fit.alpha == pytest.approx(alpha, rel=0.03)
    assert fit.A == pytest.approx(a, rel=0.15)
    assert fit.predict(1e24) == pytest.approx(e + a * 1e24**-alpha, rel=2e-3)
    assert not fit.e_at_bound


def test_frontier_e_bound_flagged_when_unconstrained():
    c = np.logspace(18, 21, 8)
    y = 5.0 * c**-0.02  # a pure power law: E wants to be 0
    fit = fit_frontier(c, y)
    assert fit.E == 0.0  # the bound itself, not a solver's 3e-18 (or a denormal) next to it
    assert fit.e_at_bound and fit.warnings
    assert fit.alpha == pytest.approx(0.02, rel=1e-9)
    assert fit.A == pytest.approx(5.0, rel=1e-9)
    assert fit.warnings[0].startswith("frontier fit: E=0 is at its bound")
    # a curve that steepens in log-log (E would be negative): E = 0's least squares are
    # the log-log line's
    u = np.log(c) - np.log(c).mean()
    noisy = y * np.exp(-0.002 * u**2 + np.random.default_rng(0).normal(0, 0.001, y.size))
    fit = fit_frontier(c, noisy)
    slope, icpt = np.polyfit(np.log(c), np.log(noisy), 1)
    assert (fit.E, fit.alpha) == (0.0, pytest.approx(-slope, rel=1e-9))
    assert fit.A == pytest.approx(np.exp(icpt), rel=1e-9)
    assert fit.rmse_log == pytest.approx(
        np.sqrt(np.mean((np.log(noisy) - icpt - slope * np.log(c)) ** 2)), rel=1e-9
    )


def test_frontier_rejects_too_few_points():
    with pytest.raises(ValueError):
        fit_frontier([1e18, 1e19], [3.0, 2.9])
