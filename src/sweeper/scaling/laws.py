"""Chinchilla's parametric scaling law L(N, D), fitted as Hoffmann et al. / Besiroglu et al. do.

Pure functions of numpy arrays; nothing here knows about sweeps, files or plots (the compute
frontier L(C) lives in frontier.py).

Parametric law (Hoffmann et al. 2022, Approach 3, as re-done by Besiroglu et al. 2024):

    L(N, D) = E + A / N**alpha + B / D**beta

fitted in log space as  log L = LSE(a - alpha log N, b - beta log D, e)  with A = exp(a),
B = exp(b), E = exp(e), minimising the SUM of Huber(delta) losses of the log residuals.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

HUBER_DELTA = 1e-3
# Order of the parameter vector theta used throughout this module.
THETA_NAMES = ("a", "b", "e", "alpha", "beta")

# SciPy's L-BFGS-B stops when the relative decrease (f_k - f_k+1) / max(|f_k|, |f_k+1|, 1)
# drops below ftol. Our objective is ~1e-3, so the default ftol (~2e-9) is really an
# absolute tolerance six orders looser than it looks, and the fit stops early. These are tight
# enough that the projected-gradient test (gtol) or a failed line search ends the run instead.
LBFGS_OPTIONS = {"ftol": 1e-15, "gtol": 1e-11, "maxiter": 20_000, "maxfun": 40_000, "maxls": 50}
# A final gradient norm above this (in the units of the summed Huber objective) gets a warning.
GRAD_WARN = 1e-5

try:  # optional: installed with mlflow (via scikit-learn); not a declared dependency
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover
    threadpool_limits = None

_single_thread_depth = 0


@contextlib.contextmanager
def single_blas_thread():
    """Run the enclosed fits with one BLAS thread.

    SciPy's L-BFGS-B calls BLAS on 5-element vectors every iteration; a multi-threaded
    OpenBLAS spends ~1 ms per call waking its threads (10x slower fits on a busy 2-core
    machine). Entering threadpoolctl costs a few ms, so nested uses are no-ops.
    """
    global _single_thread_depth
    outer = threadpool_limits is not None and _single_thread_depth == 0
    _single_thread_depth += 1
    try:
        with threadpool_limits(limits=1, user_api="blas") if outer else contextlib.nullcontext():
            yield
    finally:
        _single_thread_depth -= 1


def start_grid(kind: str = "full") -> np.ndarray:
    """Starting points (rows of theta = a, b, e, alpha, beta) for the multi-start fit.

    "full" is the grid of Hoffmann et al. / Besiroglu et al. (6*6*5*5*5 = 4500 starts);
    "small" a coarser 3**5 = 243-point version of it.
    """
    if kind == "full":
        ab = np.arange(0.0, 30.0, 5.0)
        e = np.arange(-1.0, 1.5, 0.5)
        exps = np.arange(0.0, 2.5, 0.5)
    elif kind == "small":
        ab = np.array([0.0, 10.0, 20.0])
        e = np.array([-1.0, 0.0, 1.0])
        exps = np.array([0.0, 1.0, 2.0])
    else:
        raise ValueError(f"unknown start grid {kind!r} (use 'full' or 'small')")
    return np.array(list(itertools.product(ab, ab, e, exps, exps)), dtype=float)


def huber_objective(theta, log_n, log_d, log_l, delta=HUBER_DELTA, weights=None):
    """Summed Huber loss of log residuals and its analytic gradient.

    theta has shape (5,) or (K, 5); the result is (f, grad) with shapes () / (5,) or
    (K,) / (K, 5), so the whole start grid is evaluated in one call.
    """
    th = np.atleast_2d(np.asarray(theta, dtype=float))
    a, b, e, alpha, beta = (th[:, i : i + 1] for i in range(5))
    t1 = a - alpha * log_n
    t2 = b - beta * log_d
    t3 = np.broadcast_to(e, t1.shape)
    m = np.maximum(np.maximum(t1, t2), t3)
    x1, x2, x3 = np.exp(t1 - m), np.exp(t2 - m), np.exp(t3 - m)
    s = x1 + x2 + x3
    r = m + np.log(s) - log_l
    abs_r = np.abs(r)
    h = np.where(abs_r <= delta, 0.5 * r * r, delta * (abs_r - 0.5 * delta))
    # d Huber / d r, divided by the LSE normaliser: the softmax weights x_i / s are the
    # derivatives of the log prediction with respect to the three terms.
    psi = np.clip(r, -delta, delta) / s
    if weights is not None:
        h = h * weights
        psi = psi * weights
    g1, g2, g3 = psi * x1, psi * x2, psi * x3
    grad = np.stack(
        [g1.sum(1), g2.sum(1), g3.sum(1), -(g1 * log_n).sum(1), -(g2 * log_d).sum(1)], axis=1
    )
    f = h.sum(1)
    if np.ndim(theta) == 1:
        return f[0], grad[0]
    return f, grad


@dataclass
class ChinchillaFit:
    """Result of fitting L(N, D) = E + A/N^alpha + B/D^beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float
    grad_norm: float
    n_points: int
    n_starts: int
    n_refined: int
    message: str
    theta: np.ndarray = field(repr=False)
    warnings: list[str] = field(default_factory=list)

    def predict(self, n, d):
        n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    @property
    def a(self) -> float:
        """Exponent of N_opt ~ C^a implied by the law: beta / (alpha + beta)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of D_opt ~ C^b implied by the law: alpha / (alpha + beta)."""
        return self.alpha / (self.alpha + self.beta)

    def to_dict(self) -> dict:
        return {
            "E": self.E,
            "A": self.A,
            "B": self.B,
            "alpha": self.alpha,
            "beta": self.beta,
            "a": self.a,
            "b": self.b,
            "objective": self.objective,
            "grad_norm": self.grad_norm,
            "n_points": self.n_points,
            "n_starts": self.n_starts,
            "n_refined": self.n_refined,
            "optimizer_message": self.message,
        }


def compute_optimal(E, A, B, alpha, beta, flops):
    """Chinchilla's closed form for the loss-minimising split of C = 6 N D.

    Returns (N_opt, D_opt, loss_opt); broadcasts over numpy inputs. Defined for positive
    exponents and coefficients; otherwise the results are NaN/inf (never complex).
    """
    E, A, B, alpha, beta, flops = (
        np.asarray(v, dtype=float) for v in (E, A, B, alpha, beta, flops)
    )
    with np.errstate(all="ignore"):
        g = (alpha * A / (beta * B)) ** (1.0 / (alpha + beta))
        n_opt = g * (flops / 6.0) ** (beta / (alpha + beta))
        d_opt = (flops / 6.0) ** (alpha / (alpha + beta)) / g
        return n_opt, d_opt, E + A / n_opt**alpha + B / d_opt**beta


def _log_data(n, d, loss):
    with np.errstate(divide="ignore", invalid="ignore"):  # bad values are rejected below
        log_n, log_d, log_l = (np.log(np.asarray(v, dtype=float)) for v in (n, d, loss))
    if not (log_n.shape == log_d.shape == log_l.shape) or log_n.ndim != 1:
        raise ValueError("N, D and loss must be 1-D arrays of equal length")
    if not np.all(np.isfinite(log_n + log_d + log_l)):
        raise ValueError("N, D and loss must be finite and positive")
    return log_n, log_d, log_l


def fit_chinchilla(
    n,
    d,
    loss,
    *,
    grid: str | np.ndarray = "full",
    x0=None,
    n_refine: int | None = 64,
    delta: float = HUBER_DELTA,
    weights=None,
) -> ChinchillaFit:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta by Huber-in-log-space, L-BFGS-B, multi-start.

    grid: "full" (4500 starts), "small" (243) or an explicit (K, 5) array of theta rows.
    x0: a single start (theta = a, b, e, alpha, beta); overrides grid. Used by the bootstrap.
    n_refine: the objective is first evaluated at every grid start in one vectorised call and
        only the n_refine best starts are refined with L-BFGS-B (None = refine all of them,
        which is what Hoffmann et al. did; on the Chinchilla reference data the best 64 reach
        the same optimum as all 4500, see tests/test_scaling_reference.py).
    weights: optional per-point multiplicity (the bootstrap passes resampling counts).
    """
    args = _log_data(n, d, loss)
    w = None if weights is None else np.asarray(weights, dtype=float)
    if x0 is not None:
        starts = np.atleast_2d(np.asarray(x0, dtype=float))
    else:
        starts = start_grid(grid) if isinstance(grid, str) else np.atleast_2d(grid)
    n_starts = len(starts)
    if n_refine is not None and n_starts > n_refine:
        f0 = np.concatenate(
            [
                huber_objective(chunk, *args, delta=delta, weights=w)[0]
                for chunk in np.array_split(starts, max(1, n_starts // 500))
            ]
        )
        f0 = np.where(np.isfinite(f0), f0, np.inf)
        starts = starts[np.argsort(f0, kind="stable")[:n_refine]]

    def objective(th):
        return huber_objective(th, *args, delta=delta, weights=w)

    best = None
    with single_blas_thread():
        for start in starts:
            res = minimize(objective, start, jac=True, method="L-BFGS-B", options=LBFGS_OPTIONS)
            if np.isfinite(res.fun) and (best is None or res.fun < best.fun):
                best = res
    if best is None:
        raise RuntimeError("no start produced a finite objective")
    theta = best.x
    f, g = huber_objective(theta, *args, delta=delta, weights=w)
    grad_norm = float(np.linalg.norm(g))
    a, b, e, alpha, beta = (float(v) for v in theta)
    with np.errstate(over="ignore"):  # a diverged fit is reported below, not warned about
        big_e, big_a, big_b = (float(v) for v in np.exp([e, a, b]))
    fit = ChinchillaFit(
        E=big_e,
        A=big_a,
        B=big_b,
        alpha=alpha,
        beta=beta,
        objective=float(f),
        grad_norm=grad_norm,
        n_points=len(args[0]),
        n_starts=n_starts,
        n_refined=len(starts),
        message=str(best.message),
        theta=np.array(theta),
    )
    if grad_norm > GRAD_WARN:
        fit.warnings.append(
            f"parametric fit: final gradient norm {grad_norm:.2e} > {GRAD_WARN:g}; "
            "the optimiser may have stopped short of the minimum"
        )
    if not np.all(np.isfinite([big_e, big_a, big_b])):
        fit.warnings.append(
            "parametric fit: coefficients diverged to infinity; the data do not determine the law"
        )
    if alpha <= 0 or beta <= 0:
        fit.warnings.append(
            f"parametric fit: non-positive exponent (alpha={alpha:.3g}, beta={beta:.3g}); "
            "the data do not constrain both terms"
        )
    return fit
