"""Bootstrap confidence intervals for the parametric law and the compute frontier.

Points are resampled with replacement; each replicate is refitted and percentile intervals
are taken over the replicates. The parametric refit is a single L-BFGS-B start from the
full-data optimum (a replicate's optimum lies close to it), which is what makes 1000
replicates cheap; resampling is expressed as per-point multiplicities (weights), which gives
the same objective as duplicating rows.
"""

from __future__ import annotations

import numpy as np

from .frontier import FrontierFit, fit_frontier
from .laws import ChinchillaFit, compute_optimal, fit_chinchilla, single_blas_thread

CI_LEVEL = 0.95


def percentile_ci(samples, level: float = CI_LEVEL) -> list[float] | None:
    """Two-sided percentile interval of the finite samples, or None if there are none."""
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    if len(s) == 0:
        return None
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(s, [tail, 100.0 - tail])
    return [float(lo), float(hi)]


def _resample_counts(rng: np.random.Generator, n_points: int, n_boot: int) -> np.ndarray:
    """(n_boot, n_points) multiplicities of each point in each bootstrap replicate."""
    idx = rng.integers(0, n_points, size=(n_boot, n_points))
    counts = np.zeros((n_boot, n_points))
    np.add.at(counts, (np.arange(n_boot)[:, None], idx), 1.0)
    return counts


def _parametric_derived(E, A, B, alpha, beta, target_flops) -> dict[str, float]:
    out = {"a": beta / (alpha + beta), "b": alpha / (alpha + beta)}
    if target_flops is not None:
        n_opt, d_opt, loss_opt = compute_optimal(E, A, B, alpha, beta, target_flops)
        out.update(
            {
                "N_opt": float(n_opt),
                "D_opt": float(d_opt),
                "tokens_per_param": float(d_opt / n_opt),
                "loss_opt": float(loss_opt),
            }
        )
    return out


def bootstrap_chinchilla(
    n, d, loss, fit: ChinchillaFit, *, n_boot: int, seed: int = 0, target_flops=None
) -> dict:
    """Percentile 95% CIs for E, A, B, alpha, beta, a, b (and N_opt, D_opt, tokens/param and
    the optimal loss at target_flops, if given) from n_boot resampled refits."""
    rng = np.random.default_rng(seed)
    counts = _resample_counts(rng, len(np.asarray(loss)), n_boot)
    samples: dict[str, list[float]] = {}
    n_failed = 0
    with np.errstate(all="ignore"), single_blas_thread():
        for w in counts:
            try:
                rep = fit_chinchilla(n, d, loss, x0=fit.theta, weights=w)
            except (ValueError, RuntimeError, FloatingPointError):
                n_failed += 1
                continue
            values = {"E": rep.E, "A": rep.A, "B": rep.B, "alpha": rep.alpha, "beta": rep.beta}
            values.update(_parametric_derived(**values, target_flops=target_flops))
            for key, v in values.items():
                samples.setdefault(key, []).append(v)
    return _intervals(n_boot, seed, n_failed, samples)


def _intervals(n_boot: int, seed: int, n_failed: int, samples: dict[str, list]) -> dict:
    ci95 = {key: percentile_ci(v) for key, v in samples.items()}
    return {"n_boot": n_boot, "seed": seed, "n_failed": n_failed, "level": CI_LEVEL, "ci95": ci95}


def bootstrap_frontier(
    flops, loss, *, n_boot: int, seed: int = 0, target_flops=None, band_flops=None
) -> dict:
    """Percentile 95% CIs for the frontier's E, A, alpha (and the loss at target_flops) from
    refits on envelope points resampled with replacement; also a pointwise band of the fitted
    curve over band_flops (for plots)."""
    c, y = np.asarray(flops, dtype=float), np.asarray(loss, dtype=float)
    rng = np.random.default_rng(seed)
    band_c = None if band_flops is None else np.asarray(band_flops, dtype=float)
    samples: dict[str, list[float]] = {"E": [], "A": [], "alpha": []}
    if target_flops is not None:
        samples["loss_at_target"] = []
    curves, n_failed = [], 0
    with np.errstate(all="ignore"), single_blas_thread():
        for _ in range(n_boot):
            idx = rng.integers(0, len(c), size=len(c))
            try:
                if len(np.unique(c[idx])) < 3:
                    raise ValueError("fewer than 3 distinct compute values")
                rep: FrontierFit = fit_frontier(c[idx], y[idx])
            except (ValueError, RuntimeError, np.linalg.LinAlgError):
                n_failed += 1
                continue
            for key in ("E", "A", "alpha"):
                samples[key].append(getattr(rep, key))
            if target_flops is not None:
                samples["loss_at_target"].append(float(rep.predict(target_flops)))
            if band_c is not None:
                curves.append(rep.predict(band_c))
    out = _intervals(n_boot, seed, n_failed, samples)
    if band_c is not None and curves:
        lo, hi = np.percentile(np.array(curves), [2.5, 97.5], axis=0)
        out["band"] = {"flops": band_c.tolist(), "lo": lo.tolist(), "hi": hi.tolist()}
    return out
