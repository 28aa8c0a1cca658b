"""Every fit the data allow, in one JSON-serialisable dict: `fit_all(records, ...)`.

Bad data never raise: a fit that cannot be made (too few points, a degenerate grid, a numerical
failure) leaves its section as None and adds a one-line entry to `warnings`.
"""

from __future__ import annotations

import math

import numpy as np

from sweeper.seeds import paired_lead

from .bootstrap import bootstrap_chinchilla, bootstrap_frontier
from .frontier import fit_frontier, lower_envelope
from .isoflop import fit_hparam_vs_compute, fit_isoflop, group_by_budget
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
HPARAMS = ("lr", "batch_size")
EXTRAPOLATION_NOTED = 100.0  # a prediction this many times past the largest budget is noted
FITS = ("frontier", "parametric", "isoflop", "hparams")
# the exponent of each `lr_rule` of a sweep stage (sweep/stages.py): lr ~ batch^exponent
LR_RULE_EXPONENTS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


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
    opts = {
        "target": target_flops,
        "boot": int(bootstrap or 0),
        "seed": seed,
    }
    steps = (  # (section of the result, the fit in FITS it belongs to, the step)
        ("frontier", "frontier", _frontier),
        ("parametric", "parametric", lambda p, o, w: _parametric(p, o, w, grid, n_refine)),
        ("isoflop", "isoflop", _isoflop),
        ("hparams", "hparams", _hparams),
        ("lr_vs_batch", "hparams", _lr_vs_batch),  # read from the same grids
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
        _each_seed_alone(runs, result, opts)
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
    best: dict[tuple, int] = {}
    for i in idx:
        key = (pts.N[i], pts.D[i])
        if key not in best or pts.loss[i] < pts.loss[best[key]]:
            best[key] = i
    return np.array(sorted(best.values()), dtype=int)


def _with_budget(pts: Points, mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(mask & np.array([b is not None for b in pts.budget], dtype=bool))


def _hparam_groups(pts: Points, ok: np.ndarray) -> list[tuple]:
    """The budgets a hyperparameter's optima are read at: `ok`'s points by budget label,
    as (budget, indices into ok, label)."""
    return group_by_budget(pts.C[ok], [pts.budget[i] for i in ok])


def budget_groups(pts: Points, name: str) -> dict[float, np.ndarray]:
    """{budget: indices into pts} of the final runs that carry `name`, grouped as the fit
    of `name` against compute grouped them (plots.plot_hparams draws each group)."""
    ok = _with_budget(pts, pts.final & pts.has(name))
    return {budget: ok[idx] for budget, idx, _ in _hparam_groups(pts, ok)}


def _isoflop(pts: Points, opts: dict, warnings: list) -> tuple:
    ok = _with_budget(pts, pts.final & pts.has("N"))
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


def _hparams(pts: Points, opts: dict, warnings: list) -> tuple:
    """Per budget, the value that minimises the loss (`optimum_on_grid`); then value ~ k C^p.
    A hyperparameter with one value in every run (the scaling sweep's LR), or one value at
    each budget (set per budget by a rule, not searched), has nothing to fit."""
    section, preds = {}, {}
    for name in HPARAMS:
        has = pts.final & pts.has(name)
        if not has.any():
            continue
        ok = _with_budget(pts, has)
        if len(ok) == 0:
            warnings.append(f"{name}-vs-compute: no budget labels on the runs; skipped")
            continue
        values, losses = getattr(pts, name)[ok], pts.loss[ok]
        groups = _hparam_groups(pts, ok)
        if len(set(values)) < 2:
            continue  # the same everywhere: its "law" would be that constant
        if all(len(set(values[idx])) < 2 for _, idx, _ in groups):
            continue  # not searched at any budget: its "law" would be the rule that set it
        budgets, best, how = [], [], []
        within = []  # per budget: the range of values the optimum may be, given the seeds
        for budget, idx, _ in groups:
            value, method = optimum_on_grid(values[idx], losses[idx])
            budgets.append(budget)
            best.append(value)
            how.append(method)
            if pts.by_seed is not None:
                # in a joint LR x batch grid, LRs are compared at the best point's batch size
                # (a split between two batches is not also a split between two LRs), and
                # batch sizes each at its own best LR, since the best LR moves with the batch
                idx = np.asarray(idx)
                held = idx[_at_best_batch(pts, ok[idx])] if name == "lr" else idx
                split, plausible = _split_by_seed(
                    values[held], losses[held], [pts.by_seed[i] for i in ok[held]]
                )
                within.append([min(plausible + [value]), max(plausible + [value])])
                if split:
                    warnings.append(f"{name}-vs-compute: at C = {budget:.3g} {split}")
        inside = sum(method != "grid end" for method in how)
        if len(budgets) > 1 and inside == 0:
            # no optimum was found, only bounds: a law through them would be the grid's ends
            # (lr_bs_scaling's first run had batch 1024, its smallest, best at every budget)
            warnings.append(
                f"{name}-vs-compute: the best {name} is at an end of the values tried at every "
                f"budget ({', '.join(f'{v:.4g}' for v in best)}): no law; try values beyond"
            )
            continue
        if len(budgets) > 1 and inside < 2:
            # one optimum and bounds: the law's slope would be set by a bound (two seeds of
            # lr_bs_scaling with batch 256: 835, then 256 at both ends, "predicted" 21 tokens)
            ends = ", ".join(
                f"{c:.3g}: {v:.4g}" for c, v, m in zip(budgets, best, how) if m == "grid end"
            )
            warnings.append(
                f"{name}-vs-compute: only one optimum lies inside the values tried (at an end: "
                f"{ends}): no law, which needs two; try values beyond"
            )
            continue
        for budget, value, method in zip(budgets, best, how):
            if method == "grid end":
                warnings.append(
                    f"{name}-vs-compute: at C = {budget:.3g} the best {name} ({value:.4g}) is at "
                    "an end of the values tried: the optimum may lie beyond it"
                )
        if len(set(budgets)) < 2:
            warnings.append(f"{name}-vs-compute: {len(set(budgets))} budget(s) (need >= 2)")
            continue
        law = fit_hparam_vs_compute(budgets, best)
        section[name] = {**law.to_dict(), "budgets": budgets, "best": best, "how": how}
        if within:
            section[name]["within_noise"] = within
        if name == "lr" and law.p > 0:
            # every published LR law falls with compute (DeepSeek's C^-0.125; lr_scaling
            # here measured C^-0.385): a rising one is more likely the seeds' noise
            warnings.append(
                f"lr-vs-compute: the best lr rises with compute (C^{law.p:+.3g}), where "
                "it falls in every published law: more seeds or budgets before trusting it"
            )
        if opts["target"] is not None:
            preds[f"{name}_opt"] = float(law.predict(opts["target"]))
            warnings.extend(_extrapolation_warnings(name, budgets, opts))
    return section, preds


def _extrapolation_warnings(name, budgets, opts) -> list[str]:
    """A prediction at a compute far past the largest budget fitted, with how much a small
    error in the exponent then moves it. The scaling sweeps extrapolate 100x."""
    factor = opts["target"] / max(budgets)
    if factor <= EXTRAPOLATION_NOTED:
        return []
    return [
        f"{name}-vs-compute: C = {opts['target']:.3g} is {factor:,.0f}x the largest budget "
        f"fitted ({max(budgets):.3g}): an exponent off by 0.1 moves the prediction "
        f"{factor**0.1:.2g}x"
    ]


def _lr_vs_batch(pts: Points, opts: dict, warnings: list) -> tuple:
    """Where a budget's runs vary both the LR and the batch size (lr_bs_scaling): the best
    LR of each batch size (`optimum_on_grid`), and how it grows with the batch, lr ~ B^g,
    per budget and pooled over budgets (one slope, an intercept per budget). The `lr_rule`
    whose exponent is nearest the pooled g is the one to freeze LRs by when a stage changes
    the batch size: sqrt (0.5) is Adam's usual rule, linear (1) SGD's."""
    ok = _with_budget(pts, pts.final & pts.has("lr") & pts.has("batch_size"))
    if len(ok) == 0:
        return None, {}
    groups = group_by_budget(pts.C[ok], [pts.budget[i] for i in ok])
    per_budget, xs, ys, budget_of = [], [], [], []
    for budget, idx, _ in groups:
        lr, batch, loss = pts.lr[ok][idx], pts.batch_size[ok][idx], pts.loss[ok][idx]
        batches = sorted(set(batch))
        if len(batches) < 2 or any(len(set(lr[batch == b])) < 2 for b in batches):
            continue  # one batch size, or a batch size tried at one LR: nothing to read
        optima = [optimum_on_grid(lr[batch == b], loss[batch == b]) for b in batches]
        # a best LR at an end of the grid is a bound, not an optimum: the slope leaves it out
        inside = [(b, v) for b, (v, how) in zip(batches, optima) if how != "grid end"]
        slope = None
        if len(inside) >= 2:
            x, y = np.log([b for b, _ in inside]), np.log([v for _, v in inside])
            slope = float(np.polyfit(x, y, 1)[0])
            xs += list(x)
            ys += list(y)
            budget_of += [len(per_budget)] * len(inside)
        per_budget.append(
            {
                "budget": budget,
                "batch_size": batches,
                "lr": [value for value, _ in optima],
                "how": [how for _, how in optima],
                "exponent": slope,
            }
        )
    if not per_budget:
        return None, {}
    exponent = rule = None
    if xs:
        # pooled slope: each budget's own intercept (its LRs are higher or lower overall)
        columns = sorted(set(budget_of))
        design = np.zeros((len(xs), 1 + len(columns)))
        design[:, 0] = xs
        design[np.arange(len(xs)), 1 + np.searchsorted(columns, budget_of)] = 1.0
        exponent = float(np.linalg.lstsq(design, np.array(ys), rcond=None)[0][0])
        rule = min(LR_RULE_EXPONENTS, key=lambda r: abs(LR_RULE_EXPONENTS[r] - exponent))
    ends = sum(b["how"].count("grid end") for b in per_budget)
    if ends:
        warnings.append(
            f"lr-vs-batch: {ends} best LR(s) at an end of the LRs tried, left out of the "
            "slopes (bounds, not optima)"
            + ("" if xs else ": no budget has two optima inside the grid, so no slope")
        )
    return {"budgets": per_budget, "exponent": exponent, "closest_lr_rule": rule}, {}


def _each_seed_alone(runs: Points, result: dict, opts: dict) -> None:
    """Where seeds were averaged: each hyperparameter law and the pooled LR-vs-batch slope
    fitted again on each seed's runs alone, next to the fit of the means (`per_seed`). The
    spread of those exponents and predictions is what a reader would otherwise guess from
    the seed-to-seed sd: on lr_bs_scaling's three seeds, say, how far apart the seeds put
    the law. A seed whose optima give no law (all at an end of the values tried, say) is
    listed with p = None. Its fits' warnings would repeat those of the means, so they are
    dropped."""
    seeds = sorted(set(runs.seed[np.isfinite(runs.seed)]))
    for seed in seeds:
        own = runs.take(np.flatnonzero(runs.seed == seed))
        try:
            with np.errstate(all="ignore"):
                laws, preds = _hparams(own, opts, [])
                slope, _ = _lr_vs_batch(own, opts, [])
        except Exception:  # the fit of the means stands; a seed's own is only a spread
            laws, preds, slope = {}, {}, None
        label = int(seed) if float(seed).is_integer() else float(seed)
        for name, law in result["hparams"].items():
            mine = laws.get(name)
            keys = ("p", "k", "budgets", "best", "how")
            entry = {"seed": label, **dict.fromkeys(keys)}
            if mine is not None:
                entry.update({key: mine[key] for key in keys})
                entry["prediction"] = preds.get(f"{name}_opt")
            law.setdefault("per_seed", []).append(entry)
        if result["lr_vs_batch"] is not None:
            g = None if slope is None else slope["exponent"]
            result["lr_vs_batch"].setdefault("per_seed", []).append({"seed": label, "exponent": g})


def _at_best_batch(pts: Points, rows: np.ndarray) -> np.ndarray:
    """Mask of `rows` (indices into pts) at the batch size of the row of lowest loss (a
    batch size that is absent counts as one value)."""
    batch = pts.batch_size[rows]
    best = batch[np.argmin(pts.loss[rows])]
    return (batch == best) | (np.isnan(batch) & np.isnan(best))


def _split_by_seed(values, losses, by_seed: list[dict]) -> tuple[str | None, list[float]]:
    """Where seeds were averaged: which values the best value (lowest mean) is not clearly
    better than, seed by seed (`seeds.paired_lead`). Every other value is checked, not only
    the next best: with seed noise as large as the grid's steps, a value two steps away can
    be as plausible as the neighbour. Returns the warning (None where every value is
    resolved) and the values the optimum may be: the best and those it does not clearly
    beat."""
    grid = sorted(set(float(v) for v in values))
    lowest = []  # each value's point of lowest mean loss
    for g in grid:
        i = min((i for i, v in enumerate(values) if v == g), key=lambda i: losses[i])
        lowest.append((float(losses[i]), g, by_seed[i]))
    if len(lowest) < 2:
        return None, grid
    (_, best, mine), *rivals = sorted(lowest, key=lambda t: t[:2])
    unresolved = []  # (value, its rank after the best, the lead over it)
    for rank, (_, value, theirs) in enumerate(rivals):
        lead = paired_lead(mine, theirs)
        if lead is not None and not lead.resolved:
            unresolved.append((value, rank, lead))
    if not unresolved:
        return None, [best]
    (value, rank, lead), *others = unresolved
    rival = f"the next ({value:.4g})" if rank == 0 else f"{value:.4g}"
    text = f"the best ({best:.4g}) beats {rival} {lead.words()}: not resolved"
    if others:
        text += "; nor against " + ", ".join(f"{v:.4g} ({lead.short()})" for v, _, lead in others)
    return text, [best] + [v for v, *_ in unresolved]


def optimum_on_grid(values, losses) -> tuple[float, str]:
    """The hyperparameter value that minimises the loss, from runs at one budget: the
    vertex of a parabola in log(value) through the best value and its two neighbours (each
    value's lowest loss), kept between those neighbours ("parabola"). On a grid of LRs a
    factor of 2 apart, the best run alone would move the law's points in steps of 2x; the
    parabola is the usual refinement. The best value itself where it is an end of the
    values tried ("grid end": with one or two values tried it always is, and the optimum
    may lie anywhere past it), or the three points bend the wrong way ("best run")."""
    grid = sorted(set(float(v) for v in values))
    lowest = [min(float(y) for v, y in zip(values, losses) if v == g) for g in grid]
    i = int(np.argmin(lowest))
    if i in (0, len(grid) - 1):
        return grid[i], "grid end"
    x = np.log(grid[i - 1 : i + 2])
    a, b, _ = np.polyfit(x, lowest[i - 1 : i + 2], 2)
    if not a > 0:
        return grid[i], "best run"
    return float(np.exp(np.clip(-b / (2 * a), x[0], x[2]))), "parabola"


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
