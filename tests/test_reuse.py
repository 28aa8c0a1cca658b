"""A trial that would train again a run the sweep already finished replays it instead
(engine.reusable_run, trainable.replay). The end-to-end case is in test_sweep.py."""

import dataclasses
from pathlib import Path

import pytest

from sweeper.config.compose import compose
from sweeper.sweep.preflight import build_plan
from sweeper.sweep.runner import reusable_run
from sweeper.sweep.state import SweepState, spent_flops
from sweeper.sweep.trainable import EarlierRun, replay, same_training


def lr_bs():
    plan = build_plan(compose(["+sweep=lr_bs"]))
    return plan, plan.base


def with_trainer(config: dict, **values) -> dict:
    return {**config, "trainer": {**config["trainer"], **values}}


def test_only_how_often_two_runs_evaluate_may_differ_for_them_to_train_the_same():
    _, base = lr_bs()
    assert same_training(base, with_trainer(base, num_evals=1))
    assert same_training(base, with_trainer(base, eval_every=7))
    assert not same_training(base, with_trainer(base, seed=base["trainer"]["seed"] + 1))
    assert not same_training(base, with_trainer(base, threads=2))  # float sums differ
    other_lr = {**base, "optimizer": {**base["optimizer"], "matrix_lr": 0.05}}
    assert not same_training(base, other_lr)


def incumbent_reports(trial_id: str = "t1") -> list[dict]:
    rows = []
    for step, value in ((5, 4.1), (10, 3.7), (20, 3.43)):
        rows.append(
            {
                "trial_id": trial_id,
                "stage": "lr",
                "status": "completed",
                "step": step,
                "tokens": step * 8192,
                "flops": step * 1e11,
                "fork_flops": 5e10,
                "val_bpb": value,
                "rung_val_bpb": value - 0.1,
                "train_loss": value * 0.7,
                "mfu": None,
                "wall_time": 1.0,
                "final": step == 20,
            }
        )
    return rows


def test_a_replay_reports_the_earlier_runs_values_marked_and_ends_as_it_ended():
    earlier = EarlierRun(config={}, source="lr/t1", reports=tuple(incumbent_reports()))
    seen = []
    replay(earlier, "val_bpb", seen.append)
    assert [r["val_bpb"] for r in seen] == [4.1, 3.7, 3.43]
    assert [r["flops"] for r in seen] == [5e11, 1e12, 2e12]
    assert [r["status"] for r in seen] == ["running", "running", "completed"]
    assert all(r["reused_from"] == "lr/t1" for r in seen)
    # this stage has no rungs, the earlier stage's forks are not this trial's, and a
    # missing value (mfu on a CPU) is not reported as a None
    assert not any({"rung_val_bpb", "fork_flops", "wall_time", "mfu"} & set(r) for r in seen)


def state_after_lr_stage(tmp_path: Path, base: dict, status: str = "completed", **best):
    state = SweepState.new(tmp_path, "lr_bs", base)
    record = {
        "trial_id": "t1",
        "stage": "lr",
        "status": status,
        "params": {"optimizer.matrix_lr": 0.02},
        "metric": 3.43,
        "flops": 2e12,
        "fork_flops": 1e11,
        **best,
    }
    reports = [{**r, "status": status} for r in incumbent_reports()]
    state.finish_stage("lr", [record], reports, record, base, 10.0, carried=record)
    return state


def test_a_fifo_stage_may_replay_the_run_its_start_was_frozen_from(tmp_path):
    plan, base = lr_bs()
    state = state_after_lr_stage(tmp_path, base)
    earlier = reusable_run(plan, plan.stages[1], state, base)
    assert earlier is not None and earlier.source == "lr/t1" and earlier.config == base
    assert [r["val_bpb"] for r in earlier.reports] == [4.1, 3.7, 3.43]


@pytest.mark.parametrize(
    "case",
    ["early-stopping stage", "user's function", "pruned incumbent", "mean over seeds", "first"],
)
def test_no_replay_where_the_run_could_differ_or_is_not_a_whole_one(tmp_path, case):
    plan, base = lr_bs()
    stage, target = plan.stages[1], None
    state = state_after_lr_stage(
        tmp_path,
        base,
        status="pruned" if case == "pruned incumbent" else "completed",
        **({"seeds": [0, 1]} if case == "mean over seeds" else {}),
    )
    if case == "early-stopping stage":
        stage = plan.stages[0]  # asha: rungs this run was not ranked at
    elif case == "user's function":
        target = "tests.user_functions.noisy_bowl"  # need not give the same value twice
    elif case == "first":
        state = SweepState.new(tmp_path / "fresh", "lr_bs", base)  # nothing frozen yet
    plan = dataclasses.replace(plan, target=target)
    assert reusable_run(plan, stage, state, base) is None


def test_a_replayed_trial_spends_no_compute():
    trained = {"flops": 2e12, "fork_flops": 1e11}
    assert spent_flops([trained, {**trained, "reused_from": "lr/t1"}]) == 2.1e12
