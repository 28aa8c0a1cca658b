"""Hyperparameters against compute: at each budget the best value of the LR and the batch
size tried, then value ~ k C^p across budgets, and the best LR against the batch size.
Part of `analysis.fit_all`; the same no-raise contract (a fit that cannot be made adds a
warning line)."""

from __future__ import annotations

import numpy as np

from sweeper.seeds import paired_lead

from .isoflop import fit_hparam_vs_compute, group_by_budget
from .records import Points

HPARAMS = ("lr", "batch_size")
EXTRAPOLATION_NOTED = 100.0  # a prediction this many times past the largest budget is noted
# the exponent of each `lr_rule` of a sweep stage (sweep/stages.py): lr ~ batch^exponent
LR_RULE_EXPONENTS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


def with_budget(pts: Points, mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(mask & np.array([b is not None for b in pts.budget], dtype=bool))


def _hparam_groups(pts: Points, ok: np.ndarray) -> list[tuple]:
    """The budgets a hyperparameter's optima are read at: `ok`'s points by budget label,
    as (budget, indices into ok, label)."""
    return group_by_budget(pts.C[ok], [pts.budget[i] for i in ok])


def budget_groups(pts: Points, name: str) -> dict[float, np.ndarray]:
    """{budget: indices into pts} of the final runs that carry `name`, grouped as the fit
    of `name` against compute grouped them (plots.plot_hparams draws each group)."""
    ok = with_budget(pts, pts.final & pts.has(name))
    return {budget: ok[idx] for budget, idx, _ in _hparam_groups(pts, ok)}


def fit_hparams(pts: Points, opts: dict, warnings: list) -> tuple:
    """Per budget, the value that minimises the loss (`optimum_on_grid`); then value ~ k C^p.
    A hyperparameter with one value in every run (the scaling sweep's LR), or one value at
    each budget (set per budget by a rule, not searched), has nothing to fit."""
    section, preds = {}, {}
    for name in HPARAMS:
        has = pts.final & pts.has(name)
        if not has.any():
            continue
        ok = with_budget(pts, has)
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


def fit_lr_vs_batch(pts: Points, opts: dict, warnings: list) -> tuple:
    """Where a budget's runs vary both the LR and the batch size (lr_bs_scaling): the best
    LR of each batch size (`optimum_on_grid`), and how it grows with the batch, lr ~ B^g,
    per budget and pooled over budgets (one slope, an intercept per budget). The `lr_rule`
    whose exponent is nearest the pooled g is the one to freeze LRs by when a stage changes
    the batch size: sqrt (0.5) is Adam's usual rule, linear (1) SGD's."""
    ok = with_budget(pts, pts.final & pts.has("lr") & pts.has("batch_size"))
    if len(ok) == 0:
        return None, {}
    groups = _hparam_groups(pts, ok)
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


def fit_each_seed_alone(runs: Points, result: dict, opts: dict) -> None:
    """Where seeds were averaged: each hyperparameter law and the pooled LR-vs-batch slope
    fitted again on each seed's runs alone, next to the fit of the means (`per_seed`): how
    far apart the seeds put the law. A seed whose optima give no law is listed with p = None;
    its fits' warnings would repeat those of the means, so they are dropped."""
    seeds = sorted(set(runs.seed[np.isfinite(runs.seed)]))
    for seed in seeds:
        own = runs.take(np.flatnonzero(runs.seed == seed))
        try:
            with np.errstate(all="ignore"):
                laws, preds = fit_hparams(own, opts, [])
                slope, _ = fit_lr_vs_batch(own, opts, [])
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
