"""sweep.confirm_seeds: the stats over fresh seeds and their lines (the runs themselves are
in test_sweep.py)."""

from pathlib import Path

import pytest

from sweeper.config.sweep import SweepSpec
from sweeper.sweep.confirm import confirmation_lines, confirmation_summary, fresh_seeds, with_seed
from sweeper.sweep.state import SweepState
from tests.conftest import plan_for

BASE = {"trainer": {"seed": 4}, "optimizer": {"matrix_lr": 0.02}}
BEST = {"trainer": {"seed": 4}, "optimizer": {"matrix_lr": 0.05}}


def state_with(runs: dict, best_config: dict = BEST) -> SweepState:
    stage = {"name": "lr", "records": [], "reports": [], "best": {}, "base_after": BEST}
    state = SweepState(out=None, name="s", base=BASE, stages=[stage])
    state.confirmation = {"best_config": best_config, "runs": runs}
    return state


def ran(value, status="completed"):
    return {"value": value, "status": status}


def test_fresh_seeds_follow_the_sweeps_own_and_leave_the_config_alone():
    assert fresh_seeds(BASE, 3) == [5, 6, 7]
    assert fresh_seeds(BASE, 0) == []
    seeded = with_seed(BASE, 9)
    assert seeded["trainer"]["seed"] == 9 and BASE["trainer"]["seed"] == 4


def test_fresh_seeds_pass_over_seeds_a_stage_trained_on():
    state = SweepState(out=Path("unused"), name="lr", base=BASE)
    records = [{"params": {"trainer.seed": s, "optimizer.matrix_lr": 0.02}} for s in (4, 5, 7)]
    state.stages.append({"records": records + [{"params": {"optimizer.matrix_lr": 0.04}}]})
    assert fresh_seeds(BASE, 3, state) == [6, 8, 9]


def test_the_improvement_is_paired_by_seed_with_its_spread():
    runs = {
        "5": {"best": ran(3.0), "baseline": ran(3.5)},
        "6": {"best": ran(3.2), "baseline": ran(3.3)},
        "7": {"best": ran(3.1), "baseline": ran(3.0)},
    }
    summary = confirmation_summary(plan_for(SweepSpec(confirm_seeds=3), BASE), state_with(runs))
    assert summary["seeds"] == [5, 6, 7]
    assert summary["best_mean"] == pytest.approx(3.1) and summary["best_std"] == pytest.approx(0.1)
    assert summary["baseline_mean"] == pytest.approx(3.2667, abs=1e-4)
    # gains 0.5, 0.1, -0.1: mean 0.1667, sample std 0.3055; better on two seeds of three
    assert summary["improvement_mean"] == pytest.approx(0.16667, abs=1e-4)
    assert summary["improvement_std"] == pytest.approx(0.30551, abs=1e-4)
    assert (summary["better_on"], summary["paired"]) == (2, 3)
    (line,) = confirmation_lines(summary, "val_bpb")
    assert line == (
        "fresh seeds 5, 6, 7: best val_bpb 3.1000 +- 0.1000, baseline 3.2667 +- 0.2517 "
        "-> 0.1667 +- 0.3055 better, on 2 of 3 seeds"
    )
    # where higher is better the sign turns
    maximised = confirmation_summary(
        plan_for(SweepSpec(confirm_seeds=3, mode="max"), BASE), state_with(runs)
    )
    assert maximised["improvement_mean"] == pytest.approx(-0.16667, abs=1e-4)


def test_a_run_without_a_value_is_left_out_of_the_pairs_and_named():
    runs = {
        "5": {"best": ran(3.0), "baseline": ran(3.5)},
        "6": {"best": ran(8.0, "diverged"), "baseline": ran(3.3)},
    }
    summary = confirmation_summary(plan_for(SweepSpec(confirm_seeds=2), BASE), state_with(runs))
    assert summary["best"] == [3.0, None] and summary["baseline"] == [3.5, 3.3]
    assert summary["paired"] == 1 and summary["improvement_std"] is None
    assert summary["no_value"] == ["best on seed 6 (diverged)"]
    line, note = confirmation_lines(summary, "val_bpb")
    assert line.endswith("-> 0.5000 better, on 1 of 1 seeds")
    assert note == "note: no value from best on seed 6 (diverged)"


def test_only_the_seeds_asked_for_and_only_runs_of_the_current_best_count():
    runs = {"5": {"best": ran(3.0)}, "6": {"best": ran(3.0)}, "7": {"best": ran(3.4)}}
    # confirm_seeds lowered to 2 on a resume: seed 7's run is kept but not reported
    summary = confirmation_summary(plan_for(SweepSpec(confirm_seeds=2), BASE), state_with(runs))
    assert summary["seeds"] == [5, 6] and summary["baseline_mean"] is None
    # no baseline (sweep.baseline=false): no pairs, and a best that never moved gets a note
    line, note = confirmation_lines(summary, "val_bpb")
    assert line == "fresh seeds 5, 6: best val_bpb 3.0000 +- 0.0000"
    assert "every fresh seed gave the same value" in note
    # runs of another best config (a resumed sweep that found a new one) are not this one's
    stale = state_with(runs, best_config=BASE)
    assert confirmation_summary(plan_for(SweepSpec(confirm_seeds=3), BASE), stale) is None
    assert (
        confirmation_summary(plan_for(SweepSpec(confirm_seeds=0), BASE), state_with(runs)) is None
    )
