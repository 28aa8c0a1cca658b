"""curves.png of a single run (`python -m sweeper`): its loss as it trained, and the LR
schedule that shaped it.

The training loss of every step and the validation value of every evaluation on one axis,
in the same unit (bits per byte: the loss in nats / ln 2 / data.bytes_per_token, as
`evaluate` converts it; bits per token where bytes_per_token is unknown), with the
corpus's unigram baseline for scale; beside it the LR multiplier of each step, so a bend in
the loss can be read against the warm-down that made it.
"""

from __future__ import annotations

import math
from pathlib import Path

from sweeper.config.schema import RunConfig
from sweeper.files import save_figure_atomic
from sweeper.train.schedule import lr_multiplier

PLOT_NAME = "curves.png"
# the EMA drawn over the per-step loss averages about this share of the run's steps: enough
# to show the trend through the batches' noise, little enough not to lag a short run's fall
SMOOTHING_SPAN = 1 / 25


def plot_run(result: dict, cfg: RunConfig, path: Path) -> Path | None:
    """Draw the run's curves into `path`; None where the run trained no step."""
    losses = result.get("loss_trace") or []
    if not losses:
        return None
    # matplotlib's object API, as the scaling plots: no pyplot state in the training process
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    unit = 1 / math.log(2) / (cfg.data.bytes_per_token or 1.0)
    per_step = cfg.trainer.total_batch_size
    steps = range(1, len(losses) + 1)
    tokens = [s * per_step for s in steps]
    train = [loss * unit if math.isfinite(loss) else math.nan for loss in losses]
    fig = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_lr = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    ax_loss.plot(tokens, train, color="tab:blue", alpha=0.25, lw=0.8, label="train (each step)")
    smoothing = 1 - 1 / max(1.0, SMOOTHING_SPAN * len(train))
    ax_loss.plot(tokens, ema(train, smoothing), color="tab:blue", lw=1.6, label="train (EMA)")
    evals = [r for r in result.get("history") or [] if _finite(r.get("val_bpb"))]
    if evals:
        ax_loss.plot(
            [r["tokens"] for r in evals],
            [r["val_bpb"] for r in evals],
            "o-",
            color="tab:orange",
            label="validation",
        )
    if _finite(result.get("unigram_bpb")):
        ax_loss.axhline(result["unigram_bpb"], color="gray", ls="--", lw=1, label="unigram")
    finite = [v for v in train + [r["val_bpb"] for r in evals] if math.isfinite(v)]
    if finite:  # the first steps' loss (~ln 256) would flatten everything after them
        top = min(max(finite), 1.25 * (result.get("unigram_bpb") or max(finite)))
        ax_loss.set_ylim(0.97 * min(finite), max(top, 1.03 * min(finite)))
    unit_name = "bits per byte" if cfg.data.bytes_per_token else "bits per token"
    ax_loss.set(xlabel="tokens", ylabel=unit_name, title=_title(result))
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(loc="upper right", fontsize=8)

    total = result.get("steps") or len(losses)
    s = cfg.scheduler
    schedule = [
        lr_multiplier(step, total, s.name, s.warmup_ratio, s.warmdown_ratio, s.final_lr_frac)
        for step in range(len(losses))
    ]
    ax_lr.plot(tokens, schedule, color="tab:green")
    ax_lr.set(
        xlabel="tokens",
        ylabel="LR / peak LR",
        ylim=(0, 1.05),
        title=f"LR schedule: {s.name}",
    )
    ax_lr.grid(alpha=0.3)
    for ax in (ax_loss, ax_lr):
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 400k, not 400000
    save_figure_atomic(fig, path, dpi=110)
    return path


def ema(values: list[float], smoothing: float) -> list[float]:
    """Exponential moving average, debiased at the start (as TensorBoard's smoothing);
    a NaN step (a diverged run's last) is carried through as NaN."""
    out, average, weight = [], 0.0, 0.0
    for value in values:
        if not math.isfinite(value):
            out.append(math.nan)
            continue
        average = smoothing * average + (1 - smoothing) * value
        weight = smoothing * weight + (1 - smoothing)
        out.append(average / weight)
    return out


def _title(result: dict) -> str:
    value = result.get("val_bpb")
    shown = f"val {value:.4f}" if _finite(value) else "no validation value"
    return f"{result.get('status', 'run')}: {shown} after {result.get('tokens', 0):,} tokens"


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
