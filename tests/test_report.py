"""report.md: a finished sweep on one page (sweeper.report.markdown)."""

import re
from types import SimpleNamespace

import pytest

from sweeper.config.sweep import StageSpec, SweepSpec
from sweeper.report.markdown import as_html, changes_table, render_report, trial_table, write_report
from sweeper.text import duration_text
from tests.conftest import plan_for

BASE = {
    "optimizer": {"matrix_lr": 0.02, "embedding_lr": 0.2, "scalar_lr": 0.02},
    "trainer": {"total_batch_size": 8192, "device": "auto", "threads": None},
}


def record(trial_id, status, metric, tokens, **params):
    params = {f"optimizer.{k}": v for k, v in params.items()}
    return {
        "trial_id": trial_id,
        "status": status,
        "metric": metric,
        "tokens": tokens,
        "params": params,
    }


RECORDS = [
    record("a", "pruned", 3.90, 4096, matrix_lr=0.004),
    record("b", "completed", 3.42, 16384, matrix_lr=0.04),
    record("c", "diverged", 8.0, 2048, matrix_lr=0.5),  # 8.0: the searcher's penalty
    record("d", "completed", 3.55, 16384, matrix_lr=0.02),
]


def finished_sweep(baseline: dict | None, best_value: float | None = 3.42):
    """summary.json's dict and the state of a one-stage sweep that froze matrix_lr=0.04 and
    ran its trials on one thread of the CPU."""
    final = {
        "optimizer": {**BASE["optimizer"], "matrix_lr": 0.04 if best_value else 0.02},
        "trainer": {**BASE["trainer"], "device": "cpu", "threads": 1},
    }
    best = next(r for r in RECORDS if r["trial_id"] == "b") if best_value else None
    state = SimpleNamespace(
        stages=[{"name": "lr", "records": RECORDS, "best": best}], launched=None
    )
    state.stages[0]["base_after"] = final
    improvement = None
    if baseline and baseline.get("value") is not None and best_value is not None:
        improvement = baseline["value"] - best_value
    summary = {
        "trials": 4,
        "elapsed_s": 288.4,
        "total_flops": 2.9e13,
        "stages": [
            {
                "name": "lr",
                "params": ["optimizer.matrix_lr"],
                "trials": 4,
                "statuses": {"completed": 2, "pruned": 1, "diverged": 1},
                "best_value": best_value,
                "best_params": {"optimizer.matrix_lr": 0.04} if best_value else None,
                "at_range_edge": [],
            }
        ],
        "best": {"value": best_value, "overrides": ["optimizer.matrix_lr=0.04"]}
        if best_value
        else None,
        "baseline": baseline,
        "improvement": improvement,
        "confirmation": None,
        "plots": [],
        "fit": None,
    }
    spec = SweepSpec(
        name="lr",
        stages=[StageSpec(name="lr", search="random", scheduler="asha")],
        lr_keys=["optimizer.matrix_lr", "optimizer.embedding_lr", "optimizer.scalar_lr"],
    )
    return summary, spec, state


def test_the_trial_table_ranks_measured_trials_and_shows_no_value_for_a_penalty():
    summary, spec, state = finished_sweep({"value": 3.55, "status": "completed"})
    rows = trial_table(RECORDS, state.stages[0]["best"], spec)
    assert rows[0] == "| val_bpb | status | tokens | `optimizer.matrix_lr` |"
    # best first, bold; then by value; the diverged trial's 8.0 is no measurement: last, "-"
    assert rows[2:] == [
        "| **3.4200** | completed | 16,384 | 0.04 |",
        "| 3.5500 | completed | 16,384 | 0.02 |",
        "| 3.9000 | pruned | 4,096 | 0.004 |",
        "| - | diverged | 2,048 | 0.5 |",
    ]
    # mode max ranks the other way
    rows = trial_table(RECORDS, None, SweepSpec(mode="max"))
    assert [row.split(" | ")[0] for row in rows[2:]] == ["| 3.9000", "| 3.5500", "| 3.4200", "| -"]


def test_what_the_sweep_changed_leaves_out_where_the_trials_ran():
    summary, spec, state = finished_sweep({"value": 3.55, "status": "completed"})
    final = state.stages[0]["base_after"]
    keys = {"optimizer.matrix_lr", "optimizer.embedding_lr", "trainer.total_batch_size"}
    assert changes_table(BASE, final, keys) == [
        "| key | started at | ends at |",
        "| --- | ---: | ---: |",
        "| `optimizer.matrix_lr` | 0.02 | 0.04 |",
    ]
    assert changes_table(BASE, BASE, keys) == []


@pytest.mark.parametrize(
    ("baseline", "sentence"),
    [
        (
            {"value": 3.55, "status": "completed"},
            "**Best val_bpb 3.4200** against 3.5500 for the unmodified config under the same "
            "budget: +0.1300 better.",
        ),
        (
            {"value": 3.42002, "status": "completed"},
            "**Best val_bpb 3.4200** against 3.4200 for the unmodified config under the same "
            "budget: the same to 4 decimals: the sweep found nothing better.",
        ),
        (
            {"value": 3.40, "status": "completed"},
            "**Best val_bpb 3.4200** against 3.4000 for the unmodified config under the same "
            "budget: 0.0200 worse: the unmodified config did better.",
        ),
        (
            {"value": None, "status": "diverged"},
            "**Best val_bpb 3.4200**; the unmodified config diverged under the same budget.",
        ),
        (None, "**Best val_bpb 3.4200**."),
    ],
)
def test_the_page_opens_with_the_best_against_the_unmodified_config(tmp_path, baseline, sentence):
    summary, spec, state = finished_sweep(baseline)
    page = render_report(summary, plan_for(spec, BASE), state, tmp_path)
    assert page.startswith(f"# Sweep `lr`\n\n{sentence}\n"), page[:300]


def test_a_sweep_with_nothing_to_rank_says_so_and_offers_no_command(tmp_path):
    summary, spec, state = finished_sweep(None, best_value=None)
    page = render_report(summary, plan_for(spec, BASE), state, tmp_path)
    assert "No trial finished with a value to rank." in page
    assert "```" not in page and "What the sweep changed" not in page


def test_the_page_holds_the_stage_the_command_and_only_the_plots_that_exist(tmp_path):
    summary, spec, state = finished_sweep({"value": 3.55, "status": "completed"})
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- +sweep=lr\n- trainer.dtype=float32\n")
    (tmp_path / "stage_lr.png").write_bytes(b"png")
    (tmp_path / "learning_curves.png").write_bytes(b"png")  # an earlier sweep's, not drawn now
    summary["plots"] = ["stage_lr.png"]
    summary["stages"][0]["at_range_edge"] = [{"note": "best optimizer.matrix_lr=0.04 is at ..."}]
    path = write_report(tmp_path, summary, plan_for(spec, BASE), state)
    assert path == tmp_path / "report.md"
    page = path.read_text()
    assert "4 trials in 4 min 48 s, 2.9e13 training FLOPs" in page
    assert "Launched with `python -m sweeper +sweep=lr trainer.dtype=float32`." in page
    assert "```\npython -m sweeper optimizer.matrix_lr=0.04\n```" in page
    assert "## Stage 1: `lr`\n\nrandom search, asha scheduler; 4 trials (" in page
    assert "Best val_bpb 3.4200 with `optimizer.matrix_lr=0.04`." in page
    assert "- best optimizer.matrix_lr=0.04 is at ..." in page
    # every image it shows was drawn by this sweep: learning_curves.png was not
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)
    assert images == ["stage_lr.png"]


def test_the_html_page_holds_its_images_and_tables(tmp_path):
    import base64

    summary, spec, state = finished_sweep({"value": 3.55, "status": "completed"})
    png = b"\x89PNG\r\n\x1a\n not a real image, but bytes to carry"
    (tmp_path / "stage_lr.png").write_bytes(png)
    summary["plots"] = ["stage_lr.png"]
    write_report(tmp_path, summary, plan_for(spec, BASE), state)
    page = (tmp_path / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<title>sweep lr</title>" in page
    # the image inside the page, byte for byte: the MLflow UI shows it with no file beside it
    (source,) = re.findall(r'<img[^>]*src="([^"]+)"', page)
    prefix = "data:image/png;base64,"
    assert source.startswith(prefix) and base64.b64decode(source[len(prefix) :]) == png
    # tables as tables, the best bold, the command as code
    assert re.search(r"<th[^>]*>val_bpb</th>", page), page
    assert re.search(r"<td[^>]*><strong>3.4200</strong></td>", page), page
    assert "<code>python -m sweeper optimizer.matrix_lr=0.04" in page
    # an image the page names but the run dir lacks, or one outside it, is left as a link
    outside = as_html("![a](missing.png) ![b](../stage_lr.png)", tmp_path, "x")
    assert 'src="missing.png"' in outside and 'src="../stage_lr.png"' in outside


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "an unknown time"), (47.6, "48 s"), (288.4, "4 min 48 s"), (7500, "2 h 05 min")],
)
def test_durations_read_as_a_person_says_them(seconds, text):
    assert duration_text(seconds) == text


def test_a_page_is_never_half_written(tmp_path, monkeypatch):
    summary, spec, state = finished_sweep({"value": 3.55, "status": "completed"})
    (tmp_path / "report.md").write_text("the earlier page\n")

    def fails(fd):  # the disk fills up as the page is written out
        raise OSError("No space left on device")

    monkeypatch.setattr("sweeper.files.os.fsync", fails)
    with pytest.raises(OSError):
        write_report(tmp_path, summary, plan_for(spec, BASE), state)
    monkeypatch.undo()
    assert (tmp_path / "report.md").read_text() == "the earlier page\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]  # no temp file left


def test_a_report_that_cannot_be_written_loses_nothing_else(tmp_path, monkeypatch, capsys):
    import json

    from sweeper.report import summary as outputs
    from sweeper.sweep.state import SweepState

    def fails(*args):
        raise ValueError("a stage without a name")

    monkeypatch.setattr(outputs, "write_report", fails)
    base = {**BASE, "trainer": {**BASE["trainer"], "seed": 0}}
    plan = plan_for(SweepSpec(name="s"), base)
    summary = outputs.write_all(tmp_path, plan, SweepState.new(tmp_path, "s", base))
    out = capsys.readouterr().out
    assert "note: report.md not written: ValueError: a stage without a name" in out
    # summary.json is there, says so, and the outputs line names no page
    assert json.loads((tmp_path / "summary.json").read_text())["report"] is None
    assert summary["report"] is None and f"outputs: {tmp_path}/summary.json" in out
    assert not (tmp_path / "report.md").exists()
