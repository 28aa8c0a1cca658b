"""curves.png of a single run (sweeper.report.run_plot)."""

import math

import pytest

from sweeper.config.schema import load_run_config
from sweeper.report.run_plot import ema, plot_run
from sweeper.train.loop import train
from sweeper.train.schedule import lr_multiplier

from .conftest import tiny


def test_the_ema_is_debiased_and_carries_a_nan_through():
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # no pull toward 0
    assert ema([1.0, 3.0], 0.5) == pytest.approx([1.0, (0.5 * 0.5 + 0.5 * 3.0) / 0.75])
    smoothed = ema([1.0, math.nan, 1.0], 0.5)
    assert smoothed[0] == 1.0 and math.isnan(smoothed[1]) and smoothed[2] == pytest.approx(1.0)
    assert ema([4.0, 1.0], 0.0) == [4.0, 1.0]  # no smoothing: the values themselves


def test_the_plot_draws_the_runs_own_losses_evaluations_and_schedule(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    config = tiny(trainer={"max_steps": 12, "eval_every": 4, "dtype": "float32"})
    result = train(config, verbose=False)
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    cfg = load_run_config(config)
    assert plot_run(result, cfg, tmp_path / "curves.png") == tmp_path / "curves.png"
    (fig,) = drawn
    ax_loss, ax_lr = fig.axes
    lines = {line.get_label(): line for line in ax_loss.get_lines()}
    batch = cfg.trainer.total_batch_size
    # the training loss of each step, in bits per byte (the byte-level corpus: nats / ln 2)
    each = lines["train (each step)"]
    assert list(each.get_xdata()) == [batch * s for s in range(1, 13)]
    assert list(each.get_ydata()) == pytest.approx([x / math.log(2) for x in result["loss_trace"]])
    # every evaluation's value where it was taken, and the unigram baseline
    val = lines["validation"]
    assert (
        list(val.get_xdata())
        == [r["tokens"] for r in result["history"]]
        == [batch * s for s in (4, 8, 12)]
    )
    assert list(val.get_ydata()) == [r["val_bpb"] for r in result["history"]]
    assert lines["unigram"].get_ydata()[0] == pytest.approx(result["unigram_bpb"])
    # the schedule: WSD's warm-down over the last 40% of the 12 steps
    (schedule,) = ax_lr.get_lines()
    s = cfg.scheduler
    expected = [
        lr_multiplier(i, 12, s.name, s.warmup_ratio, s.warmdown_ratio, s.final_lr_frac)
        for i in range(12)
    ]
    assert list(schedule.get_ydata()) == expected and expected[0] == 1.0 > expected[-1]
    # the view starts below the best value and leaves out the first steps' ~8 bits
    low, high = ax_loss.get_ylim()
    assert low < min(result["val_bpb"], min(each.get_ydata())) and high < 8.0


def test_a_run_with_no_step_draws_nothing(tmp_path):
    cfg = load_run_config(tiny())
    assert plot_run({"status": "failed", "loss_trace": []}, cfg, tmp_path / "c.png") is None
    assert not (tmp_path / "c.png").exists()


def test_a_diverged_run_is_drawn_up_to_its_last_finite_step(tmp_path):
    cfg = load_run_config(tiny())
    result = {
        "status": "diverged",
        "val_bpb": None,
        "tokens": 1536,
        "loss_trace": [5.0, 4.0, math.nan],
        "history": [{"tokens": 1024, "val_bpb": None}],
        "unigram_bpb": 4.76,
    }
    assert plot_run(result, cfg, tmp_path / "curves.png").stat().st_size > 0
