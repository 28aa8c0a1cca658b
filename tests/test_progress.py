"""The progress line a sweep prints as each trial ends, fed real Ray Tune trial objects."""

from ray.tune.experiment import Trial

from sweeper.sweep.callbacks import ProgressCallback


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
    assert line.startswith("[lr] 1/8 trials done, 1 running, 2 paused | best val_bpb 3.2500 |")


def test_endings_are_tallied_and_no_paused_count_without_paused_trials(capsys):
    trials = trials_in(Trial.RUNNING, Trial.RUNNING, Trial.RUNNING)
    progress = ProgressCallback("bs", planned=3, metric="val_bpb", mode="min")
    trials[0].update_last_result({"val_bpb": 3.9, "status": "pruned"})
    trials[1].update_last_result({"val_bpb": 9.0, "status": "diverged"})

    progress.on_trial_complete(0, trials, trials[0])
    trials[0].set_status(Trial.TERMINATED)
    progress.on_trial_complete(0, trials, trials[1])

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[bs] 1/3 trials done (1 pruned), 2 running | best val_bpb - |")
    assert lines[1].startswith("[bs] 2/3 trials done (1 pruned, 1 diverged), 1 running | ")
    assert "paused" not in "".join(lines)
