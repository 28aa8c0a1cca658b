"""Several single runs' validation curves on one axis (`python -m sweeper.compare --runs
--plot runs.png`): when the best pulled ahead, and whether the others were still falling."""

from __future__ import annotations

import math
from pathlib import Path

from sweeper.files import save_figure_atomic

METRIC = "val_bpb"
MAX_LABEL = 70  # characters of a legend entry: the run's name, its value, what differs


def run_curves(client, runs: list) -> tuple[str, dict[str, list[tuple[float, float]]]]:
    """Each run's (x, val_bpb) points by run id (two runs may share a name), and the x
    axis's name: tokens where every run logged them at its evaluations, else the step (a
    user's function may report neither)."""
    values, tokens = {}, {}
    for run in runs:
        history = client.get_metric_history(run.info.run_id, METRIC)
        points = sorted((m.step, m.value) for m in history if math.isfinite(m.value))
        if points:
            values[run.info.run_id] = points
            logged = client.get_metric_history(run.info.run_id, "tokens")
            tokens[run.info.run_id] = {m.step: m.value for m in logged}
    by_tokens = all(
        all(step in tokens[run_id] for step, _ in points) for run_id, points in values.items()
    )
    axis = "tokens" if by_tokens else "step"
    curves = {
        run_id: [(tokens[run_id][step] if by_tokens else step, value) for step, value in points]
        for run_id, points in values.items()
    }
    return axis, curves


def plot_runs(client, runs: list, varied: dict[str, dict[str, str]], path: Path) -> int:
    """Draws the runs' curves (best first, the best thickest) into `path`; `varied`: each
    run's values (by run id) of the config keys that differ between the runs. Returns
    how many runs had a curve to draw."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    axis, curves = run_curves(client, runs)
    names = {run.info.run_id: run.info.run_name for run in runs}
    ranked = sorted(curves, key=lambda run_id: curves[run_id][-1][1])
    fig = Figure(figsize=(10, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    colours = colormaps["viridis"]
    keys = {k for values in varied.values() for k in values}
    tails = [k.rsplit(".", 1)[-1] for k in keys]
    # optimizer.matrix_lr as matrix_lr, unless another key ends the same way
    short = {k: k.rsplit(".", 1)[-1] if tails.count(k.rsplit(".", 1)[-1]) == 1 else k for k in keys}
    for rank, run_id in enumerate(ranked):
        xs, ys = zip(*curves[run_id], strict=True)
        shown = ", ".join(f"{short[k]}={v}" for k, v in (varied.get(run_id) or {}).items())
        label = f"{names[run_id]}  {ys[-1]:.4f}" + (f"  {shown}" if shown else "")
        if len(label) > MAX_LABEL:
            label = label[: MAX_LABEL - 3] + "..."
        ax.plot(
            xs,
            ys,
            "o-" if len(xs) < 30 else "-",
            ms=3,
            lw=2.4 if rank == 0 else 1.3,
            color=colours(rank / max(1, len(ranked) - 1) * 0.9),
            label=label,
        )
    if axis == "tokens":
        ax.xaxis.set_major_formatter(EngFormatter())
    ax.set(
        xlabel=axis,
        ylabel=METRIC,
        title=f"{METRIC} of {len(ranked)} single runs, best first (its last value)",
    )
    ax.grid(alpha=0.3)
    if ranked:
        ax.legend(fontsize=8, loc="upper right")
    save_figure_atomic(fig, path, dpi=110)
    return len(ranked)
