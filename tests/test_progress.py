"""The driver's Tune callbacks fed real Ray Tune trial objects: the progress line a sweep
prints as trials end, and the start of the baseline in the first idle slot."""

import pytest
from ray.tune.experiment import Trial

from sweeper.sweep.callbacks import IDLE_WORK, IdleSlot, ProgressCallback


def trials_in(*statuses: str) -> list[Trial]:
    trials = []
    for status in statuses:
        trial = Trial("__fake", stub=True)  # a real Trial; stub: no trainable is looked up
        trial.set_status(status)
        trials.append(trial)
    return trials


def test_paused_trials_are_counted_apart_from_running_ones(capsys):
    # HyperBand/BOHB pause trials between rungs: they hold no CPU and must not read "running"
    trials = trials_in(Trial.RUNNING, Trial.RUNNING, Trial.PAUSED, Trial.PAUSED, Trial.PENDING)
    progress = ProgressCallback("lr", planned=8, metric="val_bpb", mode="min")
    progress.on_trial_result(0, trials, trials[1], {"val_bpb": 3.25})
    progress.on_trial_result(0, trials, trials[0], {"val_bpb": 3.5})
    trials[0].update_last_result({"val_bpb": 3.5, "status": "completed", "done": True})

    progress.on_trial_complete(0, trials, trials[0])

    line = capsys.readouterr().out.strip()
    # the best is the finished trial's: 3.25 is at fewer tokens (stages.pick_best)
    assert line.startswith("[lr] 1/8 trials done, 1 running, 2 paused | best val_bpb 3.5000 |")


def test_before_any_trial_finishes_the_best_is_marked_unfinished(capsys):
    """A paused trial's rung value, the best so far, then a finished trial's: the line
    shows the rung value as unfinished, then the finished one, as the stage's table does."""
    trials = trials_in(Trial.RUNNING, Trial.RUNNING, Trial.RUNNING)
    progress = ProgressCallback("lr", planned=3, metric="val_bpb", mode="min", heartbeat=0)
    progress.on_trial_result(0, trials, trials[0], {"val_bpb": 3.1, "status": "running"})
    trials[0].set_status(Trial.PAUSED)
    trials[1].update_last_result({"val_bpb": 3.6, "status": "pruned"})
    progress.on_trial_complete(0, trials, trials[1])
    trials[1].set_status(Trial.TERMINATED)
    trials[2].update_last_result({"val_bpb": 3.3, "status": "completed", "done": True})
    progress.on_trial_complete(0, trials, trials[2])

    lines = capsys.readouterr().out.splitlines()
    assert "| best val_bpb 3.1000 (unfinished) |" in lines[0]
    assert "| best val_bpb 3.3000 |" in lines[1]


def test_endings_are_tallied_and_no_paused_count_without_paused_trials(capsys):
    trials = trials_in(Trial.RUNNING, Trial.RUNNING, Trial.RUNNING)
    progress = ProgressCallback("bs", planned=3, metric="val_bpb", mode="min")
    trials[0].update_last_result({"val_bpb": 3.9, "status": "pruned"})
    trials[1].update_last_result({"val_bpb": 9.0, "status": "diverged"})

    progress.on_trial_complete(0, trials, trials[0])
    trials[0].set_status(Trial.TERMINATED)
    progress.on_trial_complete(0, trials, trials[1])

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        "[bs] 1/3 trials done (1 pruned), 2 running | best val_bpb 3.9000 (unfinished) |"
    )
    assert lines[1].startswith("[bs] 2/3 trials done (1 pruned, 1 diverged), 1 running | ")
    assert "paused" not in "".join(lines)


def test_a_trial_that_diverges_takes_its_earlier_values_out_of_the_best(capsys):
    trials = trials_in(Trial.RUNNING, Trial.RUNNING)
    progress = ProgressCallback("lr", planned=2, metric="val_bpb", mode="min")
    progress.on_trial_result(0, trials, trials[0], {"val_bpb": 3.2, "status": "running"})
    progress.on_trial_result(0, trials, trials[1], {"val_bpb": 3.6, "status": "running"})
    progress.on_trial_result(0, trials, trials[0], {"val_bpb": 8.0, "status": "diverged"})
    trials[0].update_last_result({"val_bpb": 8.0, "status": "diverged"})
    progress.on_trial_complete(0, trials, trials[0])
    trials[0].set_status(Trial.TERMINATED)
    trials[1].update_last_result({"val_bpb": 3.4, "status": "diverged"})
    progress.on_trial_complete(0, trials, trials[1])  # its last report unseen: still out

    lines = capsys.readouterr().out.splitlines()
    assert (
        "1/2 trials done (1 diverged), 1 running | best val_bpb 3.6000 (unfinished) |" in lines[0]
    )
    assert "2/2 trials done (2 diverged), 0 running | best val_bpb - |" in lines[1]


def test_a_grid_over_budgets_estimates_the_time_left_by_compute(capsys):
    """lr_bs_scaling's budgets are 10x apart: after the cheap trials the time left is the
    FLOPs left at the rate trained so far, not the trial count's (here 3x too short)."""
    import math
    import re
    import time

    from sweeper.config.schema import load_run_config
    from sweeper.sweep.callbacks import GridCosts
    from sweeper.train.model import GPT, GPTShape

    from .conftest import tiny

    base = tiny(trainer={"max_steps": None, "budget_flops": 1e10})
    budgets = [1e10, 3e10, 1e11]
    costs = GridCosts(base, {}, {"trainer.budget_flops": budgets})
    per_token = GPT(GPTShape.from_config(load_run_config(base).model)).flops_per_token()
    # whole optimizer steps of 512 tokens, as the run trains them
    plans = [math.ceil(b / per_token / 512) * 512 * per_token for b in budgets]
    assert costs.total == sum(plans)

    trials = trials_in(Trial.RUNNING, Trial.RUNNING, Trial.PENDING)
    for trial, budget in zip(trials, budgets):
        trial.config = {"trainer.budget_flops": budget}
    progress = ProgressCallback("lr_bs", planned=3, metric="val_bpb", mode="min", costs=costs)
    progress.started = time.time() - 100.0
    trials[0].update_last_result({"val_bpb": 3.0, "status": "completed", "flops": plans[0]})
    trials[1].update_last_result({"val_bpb": 3.5, "status": "running", "flops": plans[0]})

    progress.on_trial_complete(0, trials, trials[0])
    trials[0].set_status(Trial.TERMINATED)
    # the second was pruned after as many FLOPs as the first trained: its rest is not run
    trials[1].update_last_result({"val_bpb": 3.5, "status": "pruned", "flops": 2 * plans[0]})
    progress.on_trial_complete(0, trials, trials[1])

    lines = capsys.readouterr().out.splitlines()
    etas = [float(re.search(r"~(\d+)s left", line).group(1)) for line in lines]
    # 100 s for 2 plans[0] of FLOPs (one done, one running); left: all but those two
    assert abs(etas[0] - 100 / (2 * plans[0]) * (sum(plans) - 2 * plans[0])) <= 2
    assert abs(etas[1] - 100 / (3 * plans[0]) * plans[2]) <= 2
    count_eta = 100 / 1 * 2  # 100 s per trial done, two to go
    assert etas[0] > 2.5 * count_eta


def test_the_time_left_counts_how_far_the_running_trials_are(capsys):
    """Trials start two at a time: when the first ends, the second is 90% trained, so 1.9
    trials took the elapsed 100 s, not 1 (which would say 700 s for the 7 left)."""
    import re
    import time

    trials = trials_in(Trial.RUNNING, Trial.RUNNING, Trial.PAUSED)
    progress = ProgressCallback(
        "lr", planned=8, metric="val_bpb", mode="min", clock=("tokens", 160_000.0)
    )
    progress.started = time.time() - 100.0
    trials[0].update_last_result({"val_bpb": 3.5, "status": "completed", "tokens": 160_000})
    trials[1].update_last_result({"val_bpb": 3.6, "status": "running", "tokens": 144_000})
    trials[2].update_last_result({"val_bpb": 3.9, "status": "running", "tokens": 40_000})

    progress.on_trial_complete(0, trials, trials[0])

    eta = float(re.search(r"~(\d+)s left", capsys.readouterr().out).group(1))
    trained = 1 + 0.9 + 0.25  # the paused trial's first rung is trained too
    assert abs(eta - 100 / trained * (8 - trained)) <= 2


def test_the_time_left_leaves_out_the_wait_for_the_first_trial_to_start(capsys):
    """Ray takes seconds to start a stage's first worker: the rate the ETA uses is the
    training done since the first trial started, while `elapsed` stays the stage's."""
    import re
    import time

    trials = trials_in(Trial.RUNNING, Trial.RUNNING)
    progress = ProgressCallback(
        "lr", planned=4, metric="val_bpb", mode="min", clock=("tokens", 100_000.0)
    )
    progress.started = time.time() - 30.0
    progress.on_trial_start(0, trials, trials[0])
    progress.first_trial_started = time.time() - 20.0  # 10 s of start-up before it
    progress.on_trial_start(0, trials, trials[1])  # a later start moves nothing
    trials[0].update_last_result({"val_bpb": 3.5, "status": "completed", "tokens": 100_000})
    trials[1].update_last_result({"val_bpb": 3.6, "status": "running", "tokens": 100_000})

    progress.on_trial_complete(0, trials, trials[0])

    line = capsys.readouterr().out
    assert "| 30s elapsed," in line
    # 2 trials' worth trained in 20 s of training: 2 left take 20 s, not 30
    assert abs(float(re.search(r"~(\d+)s left", line).group(1)) - 20) <= 1


def test_a_line_comes_while_trials_run_though_none_has_ended(capsys):
    """A stage's first trial can take minutes on a slow CPU: after `heartbeat` seconds
    without a line, one comes anyway, with the time left from how far the trials are."""
    import re
    import time

    trials = trials_in(Trial.RUNNING, Trial.RUNNING, Trial.PENDING)
    progress = ProgressCallback(
        "lr", planned=8, metric="val_bpb", mode="min", clock=("tokens", 160_000.0), heartbeat=60
    )
    progress.on_step_end(1, trials)
    assert capsys.readouterr().out == ""  # just started

    progress.started = progress.last_line = time.time() - 61.0
    progress.on_step_end(2, trials)
    progress.on_step_end(3, trials)  # a line was printed just now: quiet again
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "[lr] 0/8 trials done, 2 running | best val_bpb - | 61s elapsed, "
        "time left once a trial reports"
    ]

    for trial, value in zip(trials, (4.2, 4.3)):
        trial.update_last_result({"val_bpb": value, "status": "running", "tokens": 24_000})
        progress.on_trial_result(3, trials, trial, trial.last_result)
    progress.started, progress.last_line = time.time() - 100.0, time.time() - 60.0
    progress.on_step_end(4, trials)
    line = capsys.readouterr().out.strip()
    assert line.startswith(
        "[lr] 0/8 trials done, 2 running | best val_bpb 4.2000 (unfinished) | 100s elapsed"
    )
    trained = 2 * 24_000 / 160_000
    assert abs(float(re.search(r"~(\d+)s left", line).group(1)) - 100 / trained * 7.7) <= 2

    paused = trials_in(Trial.PAUSED, Trial.PENDING)  # HyperBand between rungs: nothing runs
    progress.last_line = time.time() - 600.0
    progress.on_step_end(5, paused)
    assert capsys.readouterr().out == ""


@pytest.fixture
def baseline_waiting():
    started = []
    IDLE_WORK["run"] = started.append
    yield started
    IDLE_WORK.pop("run", None)


@pytest.mark.parametrize(
    "statuses, planned, concurrency, idle",
    [
        # lr_bs's LR stage: 8 trials on 2 slots; not while trials wait for a slot
        ([Trial.RUNNING, Trial.RUNNING, Trial.TERMINATED], 8, None, False),
        ([Trial.RUNNING, Trial.TERMINATED, Trial.PENDING], 8, None, False),
        # every trial started and one slot free: the last trial trains alone
        ([Trial.TERMINATED] * 7 + [Trial.RUNNING], 8, None, True),
        ([Trial.TERMINATED] * 6 + [Trial.RUNNING] * 2, 8, None, False),
        # HyperBand: a trial paused between rungs will want the slot back
        ([Trial.TERMINATED] * 6 + [Trial.RUNNING, Trial.PAUSED], 8, None, False),
        # a stage of one trial never fills two slots
        ([Trial.RUNNING], 1, None, True),
        # sweep.concurrency=1 keeps the stage from using the second slot at all
        ([Trial.RUNNING, Trial.PENDING], 8, 1, True),
    ],
)
def test_the_baseline_starts_in_the_first_slot_a_stage_leaves_idle(
    baseline_waiting, statuses, planned, concurrency, idle
):
    idle_slot = IdleSlot("run", "lr", planned=planned, slots=2, concurrency=concurrency)
    idle_slot.on_step_end(0, trials_in(*statuses))
    assert baseline_waiting == (["in the slot stage 'lr' leaves idle"] if idle else [])


def test_the_baseline_starts_once(baseline_waiting):
    idle_slot = IdleSlot("run", "lr", planned=1, slots=2)
    idle_slot.on_step_end(0, trials_in(Trial.RUNNING))
    idle_slot.on_step_end(1, trials_in(Trial.RUNNING))
    IdleSlot("run", "batch_size", planned=1, slots=2).on_step_end(0, trials_in(Trial.RUNNING))
    assert len(baseline_waiting) == 1


def test_a_resumed_stage_counts_the_trials_that_ended_before_and_restarts_its_clock(capsys):
    """Tuner.restore runs a stage with the callback pickled when it first started: the
    trials that ended in the earlier run count as done (in no time, so the time left comes
    from the trials trained now), the clock leaves out the time between the runs, and a
    trial Tune ends a second time counts once."""
    import time

    trials = trials_in(Trial.TERMINATED, Trial.TERMINATED, Trial.ERROR, Trial.PENDING)
    trials[0].update_last_result({"val_bpb": 3.3, "status": "completed", "done": True})
    trials[1].update_last_result({"val_bpb": 3.6, "status": "pruned"})
    progress = ProgressCallback("lr", planned=4, metric="val_bpb", mode="min")
    progress.started -= 3600  # the stage first started an hour ago
    progress.setup()
    progress.on_step_end(0, trials)
    progress.on_trial_complete(1, trials, trials[0])  # ended again by Tune: counted once
    trials[3].set_status(Trial.RUNNING)
    trials[3].update_last_result({"val_bpb": 3.2, "status": "completed", "done": True})
    progress.on_trial_complete(2, trials, trials[3])

    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(
        "[lr] 4/4 trials done (1 pruned, 1 failed), 0 running | best val_bpb 3.2000 | 0s elapsed"
    )
    assert time.time() - progress.started < 60
