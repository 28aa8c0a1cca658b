"""The compute frontier: L(C) = E + A * C^-alpha fitted to the lower envelope of (C, loss).

Every report of every trial is a (compute, loss) point; the frontier is the best loss reached
at each amount of compute, i.e. what an optimally-sized model achieves, and its fit predicts the
loss at a larger compute budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import least_squares


def lower_envelope(flops, loss) -> np.ndarray:
    """Indices of the points on the compute frontier, in order of increasing compute.

    A point is kept when its loss is strictly lower than that of every point with less (or
    equal) compute: the running minimum of loss over increasing C, recording only improvements.
    Non-finite or non-positive entries are ignored.
    """
    c, y = np.asarray(flops, dtype=float), np.asarray(loss, dtype=float)
    ok = np.flatnonzero(np.isfinite(c) & np.isfinite(y) & (c > 0) & (y > 0))
    # Sort by compute, ties by loss, so the best of several equal-compute points comes first.
    order = ok[np.lexsort((y[ok], c[ok]))]
    keep, best = [], np.inf
    for i in order:
        if y[i] < best:
            keep.append(i)
            best = y[i]
    return np.array(keep, dtype=int)


@dataclass
class FrontierFit:
    """Result of fitting L(C) = E + A * C^-alpha (least squares on log L)."""

    E: float
    A: float
    alpha: float
    rmse_log: float
    n_points: int
    e_at_bound: bool
    warnings: list[str] = field(default_factory=list)

    def predict(self, flops):
        return self.E + self.A * np.asarray(flops, dtype=float) ** -self.alpha

    def to_dict(self) -> dict:
        return {
            "E": self.E,
            "A": self.A,
            "alpha": self.alpha,
            "rmse_log": self.rmse_log,
            "n_points": self.n_points,
            "E_at_bound": self.e_at_bound,
        }


def _frontier_residuals(p, x, log_l):
    e, log_a, alpha = p
    return np.log(e + np.exp(log_a - alpha * x)) - log_l


def _frontier_jac(p, x, log_l):
    e, log_a, alpha = p
    t = np.exp(log_a - alpha * x)
    pred = e + t
    return np.column_stack([1.0 / pred, t / pred, -x * t / pred])


def fit_frontier(flops, loss) -> FrontierFit:
    """Fit L(C) = E + A * C^-alpha to (C, L) points, minimising squared error of log L.

    Pass the envelope points (see lower_envelope). E is bounded to [0, min L). log C is
    centred before fitting so the amplitude is O(1); A is reported for C in raw FLOPs.
    Starts: for a ladder of fixed E values, log(L - E) is linear in log C, so ordinary least
    squares gives (log A, alpha); the best of those seeds a bounded least-squares refit.
    """
    c, y = np.asarray(flops, dtype=float), np.asarray(loss, dtype=float)
    if c.ndim != 1 or c.shape != y.shape or len(c) < 3:
        raise ValueError("need at least 3 (compute, loss) points")
    if not np.all(np.isfinite(c) & np.isfinite(y) & (c > 0) & (y > 0)):
        raise ValueError("compute and loss must be finite and positive")
    x0 = np.mean(np.log(c))
    x = np.log(c) - x0
    log_l = np.log(y)
    e_max = float(y.min()) * (1.0 - 1e-9)
    best = None
    for frac in np.linspace(0.0, 0.99, 34):
        e = frac * y.min()
        slope, icpt = np.polyfit(x, np.log(y - e), 1)
        p = np.array([e, icpt, max(-slope, 0.0)])
        sse = float(np.sum(_frontier_residuals(p, x, log_l) ** 2))
        if best is None or sse < best[0]:
            best = (sse, p)
    p0 = best[1]
    p0[0] = min(p0[0], e_max * (1 - 1e-6))
    res = least_squares(
        _frontier_residuals,
        p0,
        jac=_frontier_jac,
        bounds=([0.0, -np.inf, 0.0], [e_max, np.inf, np.inf]),
        args=(x, log_l),
        method="trf",
        x_scale="jac",
        ftol=1e-15,
        xtol=1e-15,
        gtol=1e-15,
        max_nfev=10_000,
    )
    e, log_a, alpha = (float(v) for v in res.x)
    if e <= 1e-6 * e_max:
        # At its lower bound the bounded solver only creeps towards E = 0 (ending at 3e-18,
        # or a denormal 5e-324 in a bootstrap replicate). With E = 0 the law is a line in
        # log-log and its least-squares fit is exact, so the bound is taken as it is.
        e = 0.0
        slope, log_a = (float(v) for v in np.polyfit(x, log_l, 1))
        if slope > 0:  # a loss that rises with compute: the flat law, as alpha's bound gives
            slope, log_a = 0.0, float(np.mean(log_l))
        alpha = -slope
        res.fun = _frontier_residuals(np.array([e, log_a, alpha]), x, log_l)
    with np.errstate(over="ignore"):  # reported below
        amplitude = float(np.exp(log_a + alpha * x0))
    fit = FrontierFit(
        E=e,
        A=amplitude,
        alpha=alpha,
        rmse_log=float(np.sqrt(np.mean(res.fun**2))),
        n_points=len(c),
        e_at_bound=bool(e >= e_max * (1 - 1e-6) or e <= 1e-6 * e_max),
    )
    if not np.isfinite(amplitude):
        fit.warnings.append(
            f"frontier fit: A overflows (alpha={alpha:.3g}); the points do not follow a power law"
        )
    if fit.e_at_bound:
        fit.warnings.append(
            f"frontier fit: E={e:.4g} is at its bound [0, min loss); the irreducible loss is "
            "not constrained by these points"
        )
    return fit
