"""Sweep plots (PNG): the metric against LR per stage, and every trial's learning curve."""

from __future__ import annotations

from pathlib import Path

STATUS_COLORS = {
    "completed": "tab:blue",
    "pruned": "tab:gray",
    "diverged": "tab:red",
    "failed": "black",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: sweeps run on headless machines
    import matplotlib.pyplot as plt

    return plt


def plot_learning_curves(path: Path, reports: list[dict], metric: str) -> Path | None:
    """metric vs tokens for every trial, coloured by how the trial ended."""
    if not reports:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_trial: dict[str, list[dict]] = {}
    for row in reports:
        by_trial.setdefault(row["trial_id"], []).append(row)
    shown = set()
    for rows in by_trial.values():
        rows = [r for r in rows if r.get(metric) is not None and r.get("tokens")]
        if not rows:
            continue
        status = rows[-1]["status"]
        label = status if status not in shown else None
        shown.add(status)
        ax.plot(
            [r["tokens"] for r in rows],
            [r[metric] for r in rows],
            marker=".",
            color=STATUS_COLORS.get(status, "tab:green"),
            alpha=0.8,
            label=label,
        )
    ax.set_xlabel("training tokens")
    ax.set_ylabel(metric)
    ax.set_title("Learning curves of all trials")
    ax.grid(alpha=0.3)
    if shown:
        ax.legend(title="trial ended")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_stage_lr(path: Path, records: list[dict], spec) -> Path | None:
    """The metric against the stage's first LR-like parameter (or its first parameter)."""
    keys = sorted({k for r in records for k in r["params"]})
    lr_keys = [k for k in keys if k.endswith("lr")]
    key = (lr_keys or keys or [None])[0]
    points = [r for r in records if r["metric"] is not None and key in r["params"]]
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for status in STATUS_COLORS:
        chosen = [r for r in points if r["status"] == status]
        if chosen:
            ax.scatter(
                [r["params"][key] for r in chosen],
                [r["metric"] for r in chosen],
                color=STATUS_COLORS[status],
                label=status,
                s=36,
            )
    values = [r["params"][key] for r in points]
    if all(isinstance(v, int | float) and v > 0 for v in values) and max(values) / min(values) > 3:
        ax.set_xscale("log")
    ax.set_xlabel(key)
    ax.set_ylabel(f"{spec.metric} (last report)")
    ax.set_title(f"Stage '{records[0]['stage']}': {spec.metric} vs {key}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
