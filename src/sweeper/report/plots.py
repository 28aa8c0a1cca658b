"""Sweep plots (PNG): the metric against LR per stage, and every trial's learning curve."""

from __future__ import annotations

import math
from pathlib import Path

from sweeper.files import save_figure_atomic
from sweeper.sweep.stages import SEED_KEY, finite_number

STATUS_COLORS = {
    "completed": "tab:blue",
    "pruned": "tab:gray",
    "diverged": "tab:red",
    "failed": "black",
}


# (report key, y label, title) of the learning curves' optional panels: the largest gradient
# norm between reports (a loss spike often shows there first), how far a step moves the
# hidden matrices relative to their size, and the residual stream's RMS at the last block,
# which grows without bound in a run going unstable
DIAGNOSTICS = (
    (
        "grad_norm_max",
        "gradient norm before clipping",
        "Largest gradient norm since the last report",
    ),
    (
        "update_ratio_matrix",
        "||update|| / ||weights||, one step",
        "How far a step moves the hidden matrices",
    ),
    (
        "residual_rms",
        "RMS of the residual stream",
        "Residual stream at the last block (grows in unstable runs)",
    ),
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: sweeps run on headless machines
    import matplotlib.pyplot as plt

    return plt


def plot_learning_curves(path: Path, reports: list[dict], metric: str) -> Path | None:
    """metric vs tokens for every trial, coloured by how the trial ended; beside it, where
    the trials report them (sweeper's own training does), the DIAGNOSTICS a run going
    unstable shows first. A trial that replayed an earlier run (`reused_from`) is left out:
    its curve is that run's, drawn already."""
    reports = [r for r in reports if not r.get("reused_from")]
    if not reports:
        return None
    plt = _pyplot()
    by_trial = _by_trial(reports)
    panels = [(metric, metric, "Learning curves of all trials")]
    panels += [p for p in DIAGNOSTICS if any(_positive(r.get(p[0])) for r in reports)]
    rows_of_panels = 1 if len(panels) <= 3 else 2  # four panels: two rows of two
    columns = math.ceil(len(panels) / rows_of_panels)
    fig, axes = plt.subplots(
        rows_of_panels, columns, figsize=(7 * columns, 4.5 * rows_of_panels), squeeze=False
    )
    axes = axes.ravel()
    shown = set()
    by_tokens = all(r.get("tokens") for r in reports)
    for ax, (key, label, title) in zip(axes, panels):
        for rows in by_trial.values():
            rows = measured(rows, metric)
            rows = [r for r in rows if r.get(key) is not None]
            if key != metric:
                rows = [r for r in rows if _positive(r[key])]  # log axis: NaN (diverged) left out
            if not rows:
                continue
            status = rows[-1]["status"]
            ax.plot(
                [r["tokens"] if by_tokens else r["report"] for r in rows],
                [r[key] for r in rows],
                marker=".",
                color=STATUS_COLORS.get(status, "tab:green"),
                alpha=0.8,
                label=status if status not in shown else None,
            )
            shown.add(status)
        ax.set_xlabel("training tokens" if by_tokens else CLOCKLESS)
        if not by_tokens:
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key != metric:  # 0.5, 1, 2 rather than 5x10^-1, 10^0, 2x10^0
            log_axis_labelled(ax.yaxis, [r[key] for r in reports if _positive(r.get(key))])
    if shown:
        axes[0].legend(title="trial ended")
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=120)
    plt.close(fig)
    return path


# the x axis of a user's function that reports no tokens: its reports, counted
CLOCKLESS = "report (the function reports no tokens)"


def measured(rows: list[dict], metric: str) -> list[dict]:
    """A trial's reports, each with its number (`report`: 1, 2, ...), less a diverged
    trial's last one: that holds the searcher's penalty (8 bits for sweeper's training,
    1e9 for a user's function), not a measurement."""
    rows = [{**r, "report": i} for i, r in enumerate(rows, 1)]
    if rows and rows[-1]["status"] == "diverged":
        rows = rows[:-1]
    return [r for r in rows if finite_number(r.get(metric))]


def _by_trial(reports: list[dict]) -> dict[str, list[dict]]:
    by_trial: dict[str, list[dict]] = {}
    for row in reports:
        by_trial.setdefault(row["trial_id"], []).append(row)
    return by_trial


def _positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


# neighbouring values labelled on a log axis at least this ratio apart (a plot ~5 inches
# wide over a decade or two): the 1, 2, 5 of a grid are, 0.0156 and 0.0164 are not
MIN_LABELLED_RATIO = 1.4


def log_axis_labelled(axis, tried: list[float]) -> None:
    """A log scale on `axis` whose labels name values: a range of a decade or two has one
    power of ten to label, if any. A few values far enough apart for their labels (a
    grid's) are labelled themselves, to 3 figures, else 1, 2 and 5 of each decade: two
    sampled LRs 5% apart would print one label over the other."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if axis.get_scale() != "log":  # a colour bar's axis over a LogNorm is one already
        if axis.axis_name == "x":
            axis.axes.set_xscale("log")
        else:
            axis.axes.set_yscale("log")
    axis.set_minor_formatter(NullFormatter())  # minor labels overlap
    tried = sorted(set(tried))
    apart = all(high / low >= MIN_LABELLED_RATIO for low, high in zip(tried, tried[1:]))
    if len(tried) <= 6 and apart:
        axis.set_ticks(tried, [f"{v:g}" if float(v).is_integer() else f"{v:.3g}" for v in tried])
    else:
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def plot_stage_lr(
    path: Path,
    records: list[dict],
    spec,
    best: dict | None = None,
    ranges: dict[str, tuple[float, float]] | None = None,
    extended: dict[str, list[float]] | None = None,
    reports: list[dict] | None = None,
) -> Path | None:
    """The metric against each numeric parameter the stage tuned, LRs first (sweep.lr_keys'
    order). Pruned trials are hollow: their last report came before the full budget. The
    best is a star; dashed lines mark each param's search range (`ranges`: name -> (low,
    high)), so a best at an end of it shows; a band shades what an extend_trials round
    searched past the end (`extended`: name -> [low, high], or a list's new values).
    Given the stage's `reports`, a last panel draws each trial's learning curve coloured by
    the first of those parameters, so an LR too high or too low shows in how it trained."""
    ranges = ranges or {}
    # trainer.seed as a grid axis repeats the points; it is not a value to plot against
    tuned = sorted({k for r in records for k in r["params"]} - {SEED_KEY})
    order = [k for k in spec.lr_keys if k in tuned] + [k for k in tuned if k not in spec.lr_keys]
    keys = [k for k in order if all(isinstance(r["params"].get(k), int | float) for r in records)]
    keys = keys[:3]
    points = [r for r in records if r["metric"] is not None]
    if not keys or not points:
        return None
    plt = _pyplot()
    from matplotlib.transforms import blended_transform_factory

    curves = bool(reports)
    panels = len(keys) + curves
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for status, color in STATUS_COLORS.items():
            chosen = [r for r in points if r["status"] == status]
            if chosen and status == "diverged":
                # its value is the searcher's penalty (1e9 for a user's function), not a
                # measurement: marked along the top, it leaves the others' scale alone
                ax.scatter(
                    [r["params"][key] for r in chosen],
                    [0.97] * len(chosen),
                    s=40,
                    marker="x",
                    color=color,
                    label="diverged",
                    transform=blended_transform_factory(ax.transData, ax.transAxes),
                )
            elif chosen:
                hollow = status == "pruned"
                ax.scatter(
                    [r["params"][key] for r in chosen],
                    [r["metric"] for r in chosen],
                    s=40,
                    label=status,
                    edgecolors=color,
                    facecolors="none" if hollow else color,
                )
        if best is not None and best.get("metric") is not None:
            ax.scatter(
                [best["params"][key]],
                [best["metric"]],
                s=220,
                marker="*",
                color="tab:orange",
                edgecolors="black",
                linewidths=0.6,
                zorder=3,
                label="best",
            )
        values = [r["params"][key] for r in points]
        for i, bound in enumerate(ranges.get(key, ())):
            ax.axvline(
                bound, color="0.5", linestyle="--", lw=1, label="search range" if i else None
            )
            values.append(bound)
        if extended and key in extended:
            ax.axvspan(
                *_band_past_the_end(key, extended[key], ranges, records),
                color="tab:orange",
                alpha=0.12,
                lw=0,
                label="searched past its end",
            )
        if min(values) > 0 and max(values) / min(values) > 3:
            log_axis_labelled(ax.xaxis, [r["params"][key] for r in points])
        ax.set_xlabel(key)
        ax.set_ylabel(f"{spec.metric} (last report)")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    if curves:
        curves_coloured_by(axes[0][-1], records, reports, keys[0], spec.metric, best)
    fig.suptitle(f"Stage '{records[0]['stage']}': {spec.metric} against its parameters")
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=120)
    plt.close(fig)
    return path


def _band_past_the_end(key: str, extended: list, ranges: dict, records: list[dict]) -> tuple:
    """Where an extend_trials round searched: a range's [old end, new end] as it is stored;
    for a list, its new values, from the old end they continue."""
    if key in ranges:
        return tuple(extended)
    old = [r["params"][key] for r in records if r["params"][key] not in extended]
    end = (min(old) if min(extended) < min(old) else max(old)) if old else extended[0]
    return min(*extended, end), max(*extended, end)


# how a trial ended, as a line style and an end marker in the curves coloured by a parameter
ENDING_STYLES = {
    "completed": ("-", "o"),
    "pruned": ("--", "o"),
    "diverged": ("-", "x"),
    "failed": (":", "x"),
}


def curves_coloured_by(ax, records: list[dict], reports: list[dict], key: str, metric, best):
    """Each trial's metric against tokens on `ax`, its colour the trial's value of `key` (a
    log scale where the values span more than 3x, as LRs do). A diverged trial's curve stops
    at its last measured value, marked x: the report after it holds the searcher's penalty,
    not a measurement. The best trial is drawn thickest."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, MaxNLocator

    values = [r["params"][key] for r in records]
    low, high = min(values), max(values)
    if low > 0 and high / low > 3:
        norm = LogNorm(low, high)
    else:
        norm = Normalize(low, high if high > low else low + 1)
    colours = ScalarMappable(norm=norm, cmap="viridis")
    by_trial = _by_trial(reports)
    best_id = best.get("trial_id") if best else None
    endings = set()
    by_tokens = all(r.get("tokens") for r in reports)
    for record in records:
        rows = measured(by_trial.get(record["trial_id"], []), metric)
        if not rows:
            continue
        style, marker = ENDING_STYLES.get(record["status"], ("-", "o"))
        endings.add(record["status"])
        colour = colours.to_rgba(record["params"][key])
        is_best = record["trial_id"] == best_id
        clock = [r["tokens"] if by_tokens else r["report"] for r in rows]
        ys = [r[metric] for r in rows]
        ax.plot(
            clock,
            ys,
            style,
            color=colour,
            lw=2.6 if is_best else 1.3,
            zorder=3 if is_best else 2,
        )
        ax.plot(
            clock[-1:],
            ys[-1:],
            marker,
            color=colour,
            ms=7 if is_best else 5,
            mfc="none" if record["status"] == "pruned" else colour,
        )
    handles = [
        Line2D([], [], ls=ENDING_STYLES[e][0], marker=ENDING_STYLES[e][1], color="0.4", label=e)
        for e in ENDING_STYLES
        if e in endings
    ]
    if best_id is not None:
        handles.append(Line2D([], [], color="0.4", lw=2.6, label="best"))
    ax.legend(handles=handles, fontsize="small")
    bar = ax.figure.colorbar(colours, ax=ax, label=key)
    if isinstance(norm, LogNorm):
        log_axis_labelled(bar.ax.yaxis, values)
    # 40 k, 1 M and few of them: a narrow panel's labels must not run together
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.xaxis.set_major_locator(MaxNLocator(6, integer=not by_tokens))
    ax.set_xlabel("training tokens" if by_tokens else CLOCKLESS)
    ax.set_ylabel(metric)
    ax.set_title(f"Learning curves, coloured by {key.rsplit('.', 1)[-1]}")
    ax.grid(alpha=0.3)
