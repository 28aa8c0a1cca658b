"""PNG plots of a `fit_all` result.

Figures are built with matplotlib's object API (Figure + Agg canvas, no pyplot), so nothing
here touches the global backend or needs a display, and figures are freed when they go out of
scope.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sweeper.files import save_figure_atomic

from .hparams import LR_RULE_EXPONENTS, budget_groups
from .laws import compute_optimal
from .records import average_seeds, to_points

DPI = 120


def _new_figure(ncols: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=(6.4 * ncols, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _save(fig: Figure, path: Path) -> Path:
    save_figure_atomic(fig, path, dpi=DPI)
    return path


def _loss_label(result: dict) -> str:
    return f"loss ({result.get('conventions', {}).get('loss_unit', '?')})"


def plot_all(result: dict, records: list[dict], out_dir) -> list[Path]:
    """Write the plots whose fits are present in `result`; returns the PNG paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pts, _ = average_seeds(to_points(records))  # the points the fits were made on
    paths = []
    if result.get("frontier"):
        paths.append(plot_frontier(result, pts, out / "frontier.png"))
    iso = result.get("isoflop")
    if iso and any(p.get("coeffs") for p in iso["profiles"]):
        paths.append(plot_isoflop(result, pts, out / "isoflop.png"))
    if iso and iso.get("n_opt_law"):
        paths.append(plot_optima(result, out / "optima.png"))
    if result.get("hparams"):
        paths.append(plot_hparams(result, out / "hparams.png", pts))
    if result.get("lr_vs_batch"):
        paths.append(plot_lr_vs_batch(result, out / "lr_vs_batch.png"))
    return paths


def plot_frontier(result: dict, pts, path: Path) -> Path:
    """Loss vs compute: every point, the envelope, the fit and its extrapolation."""
    fr = result["frontier"]
    fig, (ax,) = _new_figure()
    has_c = pts.has("C")
    ax.scatter(pts.C[has_c], pts.loss[has_c], s=6, c="0.7", label="all reports")
    env = fr["envelope"]
    ax.scatter(env["flops"], env["loss"], s=16, c="C0", label="frontier (lower envelope)")
    c_min, c_max = min(env["flops"]), max(env["flops"])
    target = result.get("target_flops")
    curve = lambda c: fr["E"] + fr["A"] * c ** -fr["alpha"]
    c_fit = np.logspace(np.log10(c_min), np.log10(c_max), 200)
    label = f"fit: {fr['E']:.3g} + {fr['A']:.3g}·C^-{fr['alpha']:.3g}"
    ax.plot(c_fit, curve(c_fit), c="C1", label=label)
    band = (fr.get("bootstrap") or {}).get("band")
    if band:
        ax.fill_between(
            band["flops"], band["lo"], band["hi"], color="C1", alpha=0.2, label="95% bootstrap band"
        )
    if target and target > c_max:
        c_ext = np.logspace(np.log10(c_max), np.log10(target), 100)
        ax.plot(c_ext, curve(c_ext), c="C1", ls="--", label="extrapolation")
    if target:
        ax.scatter(
            [target],
            [curve(target)],
            marker="*",
            s=120,
            c="C3",
            zorder=5,
            label=f"target {target:.2g} FLOPs: {curve(target):.3f}",
        )
    ax.set_xscale("log")
    ax.set_xlabel("compute C (FLOPs)")
    ax.set_ylabel(_loss_label(result))
    ax.set_title("Compute frontier L(C) = E + A·C^-α")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_isoflop(result: dict, pts, path: Path) -> Path:
    """Loss vs N for each budget with its parabola (in ln N) and optimum."""
    profiles = [p for p in result["isoflop"]["profiles"] if p.get("coeffs")]
    fig, (ax,) = _new_figure()
    logs = np.log10([p["flops"] for p in profiles])
    span = max(float(np.ptp(logs)), 1e-9)
    for prof, lg in zip(profiles, logs):
        color = _viridis((lg - logs.min()) / span)
        sel = _points_of_budget(pts, prof)
        ax.scatter(pts.N[sel], pts.loss[sel], s=14, color=color)
        c0, c1, c2 = prof["coeffs"]
        lo, hi = np.log(prof["n_range"])
        x = np.linspace(lo, hi, 100)
        ax.plot(np.exp(x), c0 + c1 * x + c2 * x**2, color=color, label=f"{prof['flops']:.2g}")
        # an excluded vertex is drawn only inside the sizes tried: outside them (a
        # parabola's far vertex, N = 3.5e-4 at a negative loss) it would stretch the axes
        # over decades and squeeze the data into a corner
        n_opt = prof.get("n_opt")
        inside = n_opt and prof["n_range"][0] <= n_opt <= prof["n_range"][1]
        if n_opt and (prof["valid"] or (inside and prof["loss_opt"] > 0)):
            ax.scatter(
                [n_opt],
                [prof["loss_opt"]],
                marker="*" if prof["valid"] else "x",
                s=90,
                color=color,
                edgecolors="k" if prof["valid"] else None,  # an "x" has no edge to colour
                zorder=5,
            )
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel(_loss_label(result))
    ax.set_title("IsoFLOP profiles (★ optimum, × excluded)")
    ax.legend(title="budget (FLOPs)", fontsize=7, ncols=2)
    return _save(fig, path)


def _points_of_budget(pts, prof: dict) -> np.ndarray:
    """Final points carrying the profile's budget label."""
    return np.array(
        [
            lab is not None and fin and str(lab) == prof["label"]
            for lab, fin in zip(pts.budget, pts.final)
        ],
        dtype=bool,
    )


def _viridis(frac: float):
    from matplotlib import colormaps

    return colormaps["viridis"](0.9 * float(frac))


def plot_optima(result: dict, path: Path) -> Path:
    """N_opt and D_opt vs compute with the power-law fits (and the parametric law's line)."""
    iso = result["isoflop"]
    good = [p for p in iso["profiles"] if p["valid"]]
    c = np.array([p["flops"] for p in good])
    target = result.get("target_flops")
    c_line = np.logspace(np.log10(c.min()), np.log10(max(c.max(), target or 0)), 100)
    fig, axes = _new_figure(2)
    par = result.get("parametric")
    for ax, key, law_key, exp_name, label in (
        (axes[0], "n_opt", "n_opt_law", "a", "N_opt (parameters)"),
        (axes[1], "d_opt", "d_opt_law", "b", "D_opt (tokens)"),
    ):
        law = iso[law_key]
        ax.scatter(c, [p[key] for p in good], c="C0", label="IsoFLOP optima")
        ax.plot(
            c_line, law["k"] * c_line ** law["p"], c="C1", label=f"fit: {key} ∝ C^{law['p']:.3f}"
        )
        if par:
            # (N_opt, D_opt) of the parametric law along C = 6 N D
            optima = compute_optimal(*(par[k] for k in ("E", "A", "B", "alpha", "beta")), c_line)
            y = optima[0 if key == "n_opt" else 1]
            ax.plot(c_line, y, c="C2", ls="--", label=f"parametric law: ∝ C^{par[exp_name]:.3f}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("compute C (FLOPs)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("Compute-optimal model size and data vs compute")
    return _save(fig, path)


def plot_hparams(result: dict, path: Path, pts) -> Path:
    """Per hyperparameter: each budget's lowest final loss at each value tried, with the
    budget's optimum dotted; and the optima against compute with their power-law fit."""
    from matplotlib import colormaps

    items = list(result["hparams"].items())
    averaged = bool(result.get("seeds")) and pts.by_seed is not None
    fig = Figure(figsize=(12.8, 4.8 * len(items)), layout="constrained")
    FigureCanvasAgg(fig)
    for row, (name, law) in enumerate(items):
        c = np.array(law["budgets"])
        colours = colormaps["viridis"](np.linspace(0, 0.85, len(c)))
        ax = fig.add_subplot(len(items), 2, 2 * row + 1)
        values = getattr(pts, name)
        by_seed = pts.by_seed if averaged else [{}] * len(values)
        # each budget's runs as the fit grouped them (by label): by compute within 20%,
        # nearby budgets mixed, and runs without a C were none
        groups = budget_groups(pts, name)
        for budget, best, colour in zip(c, law["best"], colours):
            at = groups[budget]
            grid = np.unique(values[at])  # each value's lowest loss, as the optimum uses
            pick = [at[values[at] == v] for v in grid]
            pick = np.array([i[np.argmin(pts.loss[i])] for i in pick])
            lowest = pts.loss[pick]
            # above the budget's own best: budgets lie far apart in loss, and their shapes
            # (where each bottoms out) are what the optima are read from
            ax.plot(grid, lowest - lowest.min(), "o-", c=colour, ms=4, label=f"C = {budget:.2g}")
            # with seeds averaged, each seed's own curve (thin, dashed): whether the seeds
            # agree on where it bottoms out is what the fit's "not resolved" check reads
            for seed in sorted(set.intersection(*(set(by_seed[i]) for i in pick))):
                own = np.array([by_seed[i][seed] for i in pick])
                ax.plot(grid, own - own.min(), "--", c=colour, lw=0.7, alpha=0.6)
            ax.axvline(best, c=colour, ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel(name.replace("_", " "))
        ax.set_ylabel(f"{_loss_label(result)} above the budget's lowest")
        mean = "\nmean over seeds (dashed: each seed's own)" if averaged else ""
        ax.set_title(f"lowest final loss at each {name.replace('_', ' ')} (dotted: optimum){mean}")
        ax.legend(fontsize=8)
        ax = fig.add_subplot(len(items), 2, 2 * row + 2)
        # an optimum at an end of the values tried is a bound: hollow
        ends = np.array([how == "grid end" for how in law.get("how") or ["?"] * len(c)])
        best = np.array(law["best"])
        ax.scatter(c[~ends], best[~ends], c=colours[~ends], zorder=3, label="optimum per budget")
        if ends.any():
            ax.scatter(
                c[ends],
                best[ends],
                facecolors="none",
                edgecolors=colours[ends],
                zorder=3,
                label="best at an end of the values tried",
            )
        # with seeds averaged: the values the seeds cannot tell from the optimum, a bar
        for n, (budget, (lo, hi), colour) in enumerate(
            zip(c, law.get("within_noise") or [], colours)
        ):
            label = None if n else "values the seeds cannot tell from the optimum"
            ax.plot([budget, budget], [lo, hi], c=colour, lw=6, alpha=0.35, label=label)
        c_line = np.logspace(np.log10(c.min()), np.log10(c.max()), 50)
        ax.plot(c_line, law["k"] * c_line ** law["p"], c="C1", label=f"fit ∝ C^{law['p']:.3f}")
        # with seeds averaged: each seed's own optima and law, grey, for how far apart they lie
        own = [e for e in law.get("per_seed") or [] if e["p"] is not None]
        for n, e in enumerate(own):
            ax.scatter(e["budgets"], e["best"], marker="x", c="0.45", s=18, zorder=2)
            ax.plot(
                c_line,
                e["k"] * c_line ** e["p"],
                c="0.45",
                ls="--",
                lw=0.7,
                label=None if n else "each seed's own optima and law",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        if min(law["best"]) == max(law["best"]):  # a flat law: a log axis of zero height
            ax.set_ylim(law["best"][0] / 2, law["best"][0] * 2)
        ax.set_xlabel("compute budget C (FLOPs)")
        ax.set_ylabel(f"optimal {name.replace('_', ' ')}")
        ax.legend(fontsize=8)
    fig.suptitle("Optimal hyperparameters vs compute")
    return _save(fig, path)


def plot_lr_vs_batch(result: dict, path: Path) -> Path:
    """Each budget's best LR at each batch size, with the pooled slope through each budget's
    points and the slopes of the sqrt and linear rules for comparison."""
    from matplotlib import colormaps

    lvb = result["lr_vs_batch"]
    fig, (ax,) = _new_figure()
    colours = colormaps["viridis"](np.linspace(0, 0.85, len(lvb["budgets"])))
    g = lvb["exponent"]
    labelled = False
    for b, colour in zip(lvb["budgets"], colours):
        batch, lr = np.array(b["batch_size"]), np.array(b["lr"])
        ends = np.array([how == "grid end" for how in b["how"]])
        ax.plot(batch[~ends], lr[~ends], "o", c=colour, label=f"C = {b['budget']:.2g}")
        ax.plot(batch[ends], lr[ends], "o", mfc="none", c=colour)
        if b["exponent"] is not None and g is not None:
            # the pooled slope through this budget's optima (its own intercept)
            level = np.exp(np.mean(np.log(lr[~ends]) - g * np.log(batch[~ends])))
            line = np.geomspace(batch.min(), batch.max(), 20)
            label = None if labelled else f"pooled slope {g:.2f}, at each budget's level"
            ax.plot(line, level * line**g, c=colour, lw=1, label=label)
            labelled = True
    # the rules' lines start at an optimum inside the grid, of the largest budget that has one
    anchors = [
        (batch, lr)
        for b in lvb["budgets"]
        for batch, lr, how in zip(b["batch_size"], b["lr"], b["how"])
        if how != "grid end"
    ] or [(lvb["budgets"][-1]["batch_size"][0], lvb["budgets"][-1]["lr"][0])]
    anchor_b, anchor_lr = anchors[-1]
    line = np.geomspace(
        min(min(b["batch_size"]) for b in lvb["budgets"]),
        max(max(b["batch_size"]) for b in lvb["budgets"]),
        20,
    )
    for rule, style in (("sqrt", "--"), ("linear", ":")):
        e = LR_RULE_EXPONENTS[rule]
        ax.plot(
            line, anchor_lr * (line / anchor_b) ** e, c="0.5", ls=style, lw=1, label=f"{rule} rule"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch size (tokens)")
    ax.set_ylabel("best lr")
    slope = "no slope" if g is None else f"slope {g:.2f}"
    ax.set_title(f"best LR vs batch: {slope} (hollow: an end of the LRs tried)")
    ax.legend(fontsize=8)
    return _save(fig, path)
