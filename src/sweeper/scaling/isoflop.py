"""IsoFLOP profiles (Hoffmann et al. Approach 2) and power laws of optima against compute.

For every compute budget, loss is fitted as a parabola in log N; its vertex is that budget's
compute-optimal model size N_opt. Then N_opt ~ C^a and D_opt ~ C^b are fitted by least squares
in log-log space. The same log-log fit serves for optimal hyperparameters (learning rate, batch
size) against compute, and for reproducing published exponents from published optima.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PowerLawFit:
    """y = k * x^p, fitted by ordinary least squares of log y on log x."""

    k: float
    p: float
    r2: float | None
    n_points: int

    def predict(self, x):
        return self.k * np.asarray(x, dtype=float) ** self.p

    def to_dict(self) -> dict:
        return {"k": self.k, "p": self.p, "r2": self.r2, "n_points": self.n_points}


def fit_power_law(x, y) -> PowerLawFit:
    """OLS of log y on log x. Needs >= 2 points with distinct positive x."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError("x and y must be 1-D arrays of equal length")
    if not np.all(np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)):
        raise ValueError("power-law fit needs finite, positive values")
    lx, ly = np.log(x), np.log(y)
    if len(np.unique(lx)) < 2:
        raise ValueError("power-law fit needs at least 2 distinct x values")
    p, log_k = np.polyfit(lx, ly, 1)
    if not np.isfinite(p) or abs(log_k) > 700:  # exp(log_k) would overflow
        raise ValueError(f"power-law fit diverged (exponent {p:.3g}); x values too close")
    r2 = None
    if len(x) > 2:
        ss_res = float(np.sum((ly - (log_k + p * lx)) ** 2))
        ss_tot = float(np.sum((ly - ly.mean()) ** 2))
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return PowerLawFit(k=float(np.exp(log_k)), p=float(p), r2=r2, n_points=len(x))


def optima_exponent(flops, n_opt) -> float:
    """Exponent a of N_opt ~ C^a from precomputed per-budget optima (e.g. Porian et al.)."""
    return fit_power_law(flops, n_opt).p


def _budget_value(label, flops: np.ndarray) -> float:
    """A budget label's compute in FLOPs: the label itself when numeric, else the median C."""
    try:
        value = float(label)
    except (TypeError, ValueError):
        value = float("nan")
    if np.isfinite(value) and value > 0:
        return value
    known = flops[np.isfinite(flops) & (flops > 0)]
    return float(np.median(known)) if len(known) else float("nan")


def group_by_budget(flops, budget=None, bins_per_decade: int = 10) -> list[tuple]:
    """[(budget_flops, indices, label), ...] sorted by budget; groups whose compute is
    unknown (no finite positive label or C) are left out.

    With labels, points sharing a label form a group. Without, log10 C is rounded to
    1/bins_per_decade of a decade: points in one bin (~26% wide by default) share a budget,
    and two a few percent apart can still fall either side of a bin's edge.
    """
    c = np.asarray(flops, dtype=float)
    if budget is None:
        with np.errstate(divide="ignore", invalid="ignore"):
            keys = np.round(np.log10(c) * bins_per_decade)
        labels = [None if not np.isfinite(k) else k for k in keys]
    else:
        labels = list(budget)
    groups: dict[object, list[int]] = {}
    for i, lab in enumerate(labels):
        if lab is None or (isinstance(lab, float) and not np.isfinite(lab)):
            continue
        groups.setdefault(lab, []).append(i)
    out = []
    for lab, idx in groups.items():
        idx = np.array(idx, dtype=int)
        if budget is None:
            value = float(np.exp(np.mean(np.log(c[idx]))))
        else:
            value = _budget_value(lab, c[idx])
        if np.isfinite(value) and value > 0:
            out.append((value, idx, lab))
    return sorted(out, key=lambda t: t[0])


@dataclass
class IsoFlopProfile:
    """The parabola fit of loss against log N for one compute budget."""

    flops: float
    label: str
    coeffs: list[float]  # loss = c0 + c1 x + c2 x^2 with x = ln N
    n_opt: float | None
    d_opt: float | None
    loss_opt: float | None
    n_range: list[float]
    n_sizes: int
    valid: bool
    flags: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def lowest_of_each(keys, loss) -> list[int]:
    """The index of the lowest loss among the points of each key (the first of equals)."""
    best: dict = {}
    for i, key in enumerate(keys):
        if key not in best or loss[i] < loss[best[key]]:
            best[key] = i
    return list(best.values())


def _best_per_size(n: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """Indices of the lowest-loss point at each distinct N (several LRs per size, say)."""
    return np.array(sorted(lowest_of_each(n, loss), key=lambda i: n[i]), dtype=int)


def fit_profile(
    n, loss, flops: float, d=None, min_sizes: int = 3, label: str = ""
) -> IsoFlopProfile:
    """Fit one IsoFLOP profile. Never raises for degenerate data; sets valid/flags instead.

    Flags: "too_few_sizes", "opens_downward" (no minimum), "outside_grid" (the vertex lies
    outside the sampled N range, so it is an extrapolation) — these make the profile invalid —
    and "edge" (the lowest measured loss is at the smallest or largest N: the grid may not
    bracket the optimum), which is only a warning.
    D_opt comes from the points' own D when given (log D is linear in log N along an IsoFLOP,
    so it is interpolated at the vertex), else from C / (6 N_opt).
    """
    n, loss = np.asarray(n, dtype=float), np.asarray(loss, dtype=float)
    keep = _best_per_size(n, loss)
    n, loss = n[keep], loss[keep]
    d = None if d is None else np.asarray(d, dtype=float)[keep]
    prof = IsoFlopProfile(
        flops=float(flops),
        label=label,
        coeffs=[],
        n_opt=None,
        d_opt=None,
        loss_opt=None,
        n_range=[float(n.min()), float(n.max())] if len(n) else [],
        n_sizes=len(n),
        valid=False,
    )
    if len(n) < min_sizes:
        prof.flags.append("too_few_sizes")
        return prof
    x = np.log(n)
    c2, c1, c0 = np.polyfit(x, loss, 2)
    prof.coeffs = [float(c0), float(c1), float(c2)]
    if int(np.argmin(loss)) in (0, len(n) - 1):
        prof.flags.append("edge")
    if c2 <= 0:
        prof.flags.append("opens_downward")
        return prof
    x_opt = -c1 / (2 * c2)
    if not x.min() <= x_opt <= x.max():
        prof.flags.append("outside_grid")
    prof.n_opt = float(np.exp(x_opt))
    prof.loss_opt = float(c0 + c1 * x_opt + c2 * x_opt**2)
    if d is not None and np.all(np.isfinite(d) & (d > 0)):
        slope, icpt = np.polyfit(x, np.log(d), 1)
        prof.d_opt = float(np.exp(icpt + slope * x_opt))
    else:
        prof.d_opt = float(flops / (6.0 * prof.n_opt))
    prof.valid = "outside_grid" not in prof.flags
    return prof


@dataclass
class IsoFlopFit:
    profiles: list[IsoFlopProfile]
    n_opt_law: PowerLawFit | None
    d_opt_law: PowerLawFit | None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "method": "parabola in ln N per budget; OLS in log-log over valid budgets",
            "profiles": [p.to_dict() for p in self.profiles],
            "n_opt_law": None if self.n_opt_law is None else self.n_opt_law.to_dict(),
            "d_opt_law": None if self.d_opt_law is None else self.d_opt_law.to_dict(),
            "a": None if self.n_opt_law is None else self.n_opt_law.p,
            "b": None if self.d_opt_law is None else self.d_opt_law.p,
        }


def fit_isoflop(n, loss, flops, budget=None, d=None, min_sizes: int = 3) -> IsoFlopFit:
    """Per-budget parabola fits, then N_opt ~ C^a and D_opt ~ C^b over the valid budgets."""
    n, loss, flops = (np.asarray(v, dtype=float) for v in (n, loss, flops))
    d_arr = None if d is None else np.asarray(d, dtype=float)
    profiles, warnings = [], []
    for value, idx, lab in group_by_budget(flops, budget):
        d_b = None if d_arr is None else d_arr[idx]
        prof = fit_profile(n[idx], loss[idx], value, d_b, min_sizes, label=str(lab))
        profiles.append(prof)
        if prof.flags:
            verdict = "kept" if prof.valid else "excluded"
            warnings.append(
                f"isoflop: budget {value:.3g} FLOPs flagged {','.join(prof.flags)} ({verdict})"
            )
    good = [p for p in profiles if p.valid]
    fit = IsoFlopFit(profiles=profiles, n_opt_law=None, d_opt_law=None, warnings=warnings)
    if len({p.flops for p in good}) < 2:
        warnings.append(
            f"isoflop: {len(good)} usable budget(s); need >= 2 to fit N_opt ~ C^a, D_opt ~ C^b"
        )
        return fit
    c = np.array([p.flops for p in good])
    fit.n_opt_law = fit_power_law(c, [p.n_opt for p in good])
    fit.d_opt_law = fit_power_law(c, [p.d_opt for p in good])
    return fit


def fit_hparam_vs_compute(flops, values) -> PowerLawFit:
    """Fit an optimal hyperparameter (e.g. per-budget best LR) as k * C^p; needs >= 2 budgets."""
    return fit_power_law(flops, values)
