"""Every fit the data allow, in one JSON-serialisable dict: `fit_all(records, ...)`.

Bad data never raise: a fit that cannot be made (too few points, a degenerate grid, a numerical
failure) leaves its section as None and adds a one-line entry to `warnings`.
"""

from __future__ import annotations

import math

import numpy as np

from .bootstrap import bootstrap_chinchilla, bootstrap_frontier
from .frontier import fit_frontier, lower_envelope
from .hparams import fit_each_seed_alone, fit_hparams, fit_lr_vs_batch, with_budget
from .isoflop import fit_isoflop, lowest_of_each
from .laws import compute_optimal, fit_chinchilla
from .records import Points, average_seeds, to_points

DEFAULT_CONVENTIONS = {
    "params": "total",  # "total" | "non_embedding" | "matmul": what N counts
    "flops": "6ND",  # "6ND" | "per_token_with_attention" | "given": how C was computed
    "loss_unit": "nats",  # "nats" | "bpb" | ...: the unit of the loss column
}
MIN_FRONTIER_POINTS = 4  # envelope points; the law has 3 parameters
MIN_PARAMETRIC_POINTS = 6  # the law has 5 parameters
MIN_ISOFLOP_SIZES = 3  # a parabola needs 3 distinct model sizes
FITS = ("frontier", "parametric", "isoflop", "hparams")


def fit_all(
    records: list[dict],
    *,
    target_flops: float | None = None,
    bootstrap: int = 0,
    seed: int = 0,
    conventions: dict | None = None,
    grid: str = "full",
    n_refine: int | None = 64,
    fits: tuple[str, ...] = FITS,
) -> dict:
    """Fit the frontier, the parametric law, IsoFLOP profiles, hyperparameter-vs-compute
    laws and the best LR against the batch size to `records` (dicts with optional keys N, D,
    C, loss, budget, lr, batch_size, final, seed). Runs that differ only in their seed are
    fitted as their mean (`records.average_seeds`; what was averaged is `result["seeds"]`).

    target_flops: also predict loss / N_opt / D_opt / optimal hyperparameters there.
    bootstrap: number of bootstrap replicates for CIs (0 = none); seed seeds them.
    conventions: overrides of DEFAULT_CONVENTIONS, recorded verbatim in the result.
    grid / n_refine: start grid of the parametric fit (see laws.fit_chinchilla).
    fits: which of FITS to attempt; the others are neither fitted nor warned about.
    """
    result: dict = {
        "conventions": {
            **DEFAULT_CONVENTIONS,
            **(conventions if isinstance(conventions, dict) else {}),
        },
        "target_flops": target_flops,
        "n_records": len(records) if isinstance(records, (list, tuple)) else 0,
        "n_used": 0,
        "seeds": None,
        "frontier": None,
        "parametric": None,
        "isoflop": None,
        "hparams": {},
        "lr_vs_batch": None,
        "predictions": {},
        "warnings": [],
    }
    warnings = result["warnings"]
    if target_flops is not None:
        target_flops = _positive_or_none(target_flops)
        if target_flops is None:
            warnings.append(f"target_flops={result['target_flops']!r} is not a positive number")
        result["target_flops"] = target_flops
    try:
        pts = to_points(list(records))
    except Exception as exc:  # records of the wrong shape altogether
        warnings.append(f"could not read records: {type(exc).__name__}: {exc}")
        return _jsonable(result)
    result["n_used"] = len(pts.loss)
    if pts.n_dropped:
        warnings.append(
            f"dropped {pts.n_dropped} of {pts.n_records} record(s) with a missing, NaN/inf or "
            "non-positive loss"
        )
    if pts.n_nonpositive_size:
        warnings.append(
            f"{pts.n_nonpositive_size} record(s) with a zero or negative N, D or C: the fits "
            "that read it leave them out"
        )
    runs = pts  # each seed's own runs, for the per-seed laws below
    pts, result["seeds"] = average_seeds(pts)
    opts = {"target": target_flops, "boot": int(bootstrap or 0), "seed": seed}
    steps = (  # (section of the result, the fit in FITS it belongs to, the step)
        ("frontier", "frontier", _frontier),
        ("parametric", "parametric", lambda p, o, w: _parametric(p, o, w, grid, n_refine)),
        ("isoflop", "isoflop", _isoflop),
        ("hparams", "hparams", fit_hparams),
        ("lr_vs_batch", "hparams", fit_lr_vs_batch),  # read from the same grids
    )
    for name, fit, step in steps:
        if fit not in fits:
            continue
        try:
            # Degenerate data can overflow intermediate values; the checks in each fit turn that
            # into a warning line, so numpy's own RuntimeWarnings would only be noise.
            with np.errstate(all="ignore"):
                section, preds = step(pts, opts, warnings)
        except Exception as exc:  # keep the fits that worked; report the one that did not
            warnings.append(f"{name}: fit failed ({type(exc).__name__}: {exc})")
            continue
        if section is not None:
            result[name] = section
        result["predictions"].update(preds)
    if result["seeds"] and "hparams" in fits:
        fit_each_seed_alone(runs, result, opts)
    return _jsonable(result)


def _frontier(pts: Points, opts: dict, warnings: list) -> tuple:
    ok = np.flatnonzero(pts.has("C"))
    if len(ok) == 0:
        warnings.append("frontier: no points with compute (C, or N and D) known; skipped")
        return None, {}
    c, y = pts.C[ok], pts.loss[ok]
    env = lower_envelope(c, y)
    if len(env) < MIN_FRONTIER_POINTS:
        warnings.append(
            f"frontier: only {len(env)} point(s) on the compute frontier "
            f"(need >= {MIN_FRONTIER_POINTS}); skipped"
        )
        return None, {}
    fit = fit_frontier(c[env], y[env])
    warnings.extend(fit.warnings)
    early = int((~pts.final[ok][env]).sum())
    ended = ok[pts.final[ok]]
    if early and len(lower_envelope(pts.C[ended], pts.loss[ended])) == 1:
        # a sweep of one budget: the envelope is its best run's learning curve, mostly at
        # its peak LR under WSD, above what a run annealed at that compute would reach
        warnings.append(
            f"frontier: {early} of its {len(env)} points are reports from before their run's "
            "LR schedule ended, and the runs end at one compute budget: it is one learning "
            "curve, above what runs annealed at each compute reach, so alpha reads steeper "
            "than the compute-optimal frontier's (+sweep=scaling or lr_scaling end runs at "
            "several budgets)"
        )
    section = fit.to_dict()
    section["n_candidates"] = len(ok)
    section["envelope"] = {"flops": c[env].tolist(), "loss": y[env].tolist()}
    preds = {}
    target = opts["target"]
    if target is not None:
        preds["frontier_loss"] = float(fit.predict(target))
    if opts["boot"] > 0:
        hi = max(c.max(), target or 0.0)
        band = np.logspace(np.log10(c.min()), np.log10(hi), 60)
        boot = bootstrap_frontier(
            c[env],
            y[env],
            n_boot=opts["boot"],
            seed=opts["seed"],
            target_flops=target,
            band_flops=band,
        )
        section["bootstrap"] = boot
        if target is not None:
            preds["frontier_loss_ci95"] = boot["ci95"].get("loss_at_target")
    return section, preds


def _parametric(pts: Points, opts: dict, warnings: list, grid, n_refine) -> tuple:
    ok = _best_per_pair(pts, np.flatnonzero(pts.final & pts.has("N") & pts.has("D")))
    n, d, y = pts.N[ok], pts.D[ok], pts.loss[ok]
    problem = None
    if len(ok) > 1 and len(np.unique(n)) < 2:  # the reason, before the count it implies
        problem = f"a single model size N = {n[0]:.4g} (need >= 2)"
    elif len(ok) < MIN_PARAMETRIC_POINTS:
        problem = f"{len(ok)} final point(s) with N and D (need >= {MIN_PARAMETRIC_POINTS})"
    elif len(np.unique(d)) < 2:
        problem = "a single token count D (need >= 2)"
    elif len({(a, b) for a, b in zip(n, d)}) < 5:
        problem = "fewer than 5 distinct (N, D) pairs"
    elif abs(np.corrcoef(np.log(n), np.log(d))[0, 1]) > 0.9999:
        problem = "log N and log D are collinear (e.g. fixed tokens per parameter)"
    if problem:
        warnings.append(f"parametric: {problem}; L(N, D) not fitted")
        return None, {}
    fit = fit_chinchilla(n, d, y, grid=grid, n_refine=n_refine)
    warnings.extend(fit.warnings)
    section = fit.to_dict()
    section["n_excluded_intermediate"] = int(np.sum(~pts.final & pts.has("N") & pts.has("D")))
    preds = {}
    target = opts["target"]
    usable = fit.alpha > 0 and fit.beta > 0 and np.isfinite([fit.E, fit.A, fit.B]).all()
    if target is not None and not usable:
        warnings.append("parametric: degenerate parameters; no compute-optimal prediction")
    elif target is not None:
        n_opt, d_opt, loss_opt = compute_optimal(fit.E, fit.A, fit.B, fit.alpha, fit.beta, target)
        preds.update(
            {
                "parametric_N_opt": float(n_opt),
                "parametric_D_opt": float(d_opt),
                "parametric_loss_opt": float(loss_opt),
                "parametric_tokens_per_param": float(d_opt / n_opt),
            }
        )
    if opts["boot"] > 0:
        boot = bootstrap_chinchilla(
            n, d, y, fit, n_boot=opts["boot"], seed=opts["seed"], target_flops=target
        )
        section["bootstrap"] = boot
        if target is not None:
            for key in ("N_opt", "D_opt", "loss_opt", "tokens_per_param"):
                preds[f"parametric_{key}_ci95"] = boot["ci95"].get(key)
    return section, preds


def _best_per_pair(pts: Points, idx: np.ndarray) -> np.ndarray:
    """The lowest-loss run of each (N, D): runs differing only in hyperparameters (an LR
    sweep at one size) are one measurement of the law, at its best hyperparameters."""
    keep = lowest_of_each([(pts.N[i], pts.D[i]) for i in idx], pts.loss[idx])
    return np.array(sorted(idx[keep]), dtype=int)


def _isoflop(pts: Points, opts: dict, warnings: list) -> tuple:
    ok = with_budget(pts, pts.final & pts.has("N"))
    if len(ok) == 0:
        warnings.append(
            "isoflop: no final points with a budget label and N; skipped (python -m "
            "sweeper.fit reads the labels from a CSV's --budget-col, which may be its FLOPs)"
        )
        return None, {}
    if len(np.unique(pts.N[ok])) < 2:  # one line, not one per budget
        warnings.append(
            f"isoflop: a single model size N = {pts.N[ok][0]:.4g} at every budget (need >= "
            f"{MIN_ISOFLOP_SIZES} per budget); skipped"
        )
        return None, {}
    d = pts.D[ok] if np.all(pts.has("D")[ok]) else None
    budgets = [pts.budget[i] for i in ok]
    fit = fit_isoflop(pts.N[ok], pts.loss[ok], pts.C[ok], budgets, d, MIN_ISOFLOP_SIZES)
    warnings.extend(fit.warnings)
    preds = {}
    if opts["target"] is not None and fit.n_opt_law is not None:
        preds["isoflop_N_opt"] = float(fit.n_opt_law.predict(opts["target"]))
        preds["isoflop_D_opt"] = float(fit.d_opt_law.predict(opts["target"]))
    return fit.to_dict(), preds


def _positive_or_none(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def _jsonable(obj):
    """Plain Python containers and floats; NaN/inf become None so the JSON is standard."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj
