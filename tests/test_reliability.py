"""Crash safety: a killed or interrupted driver resumes without losing or repeating work;
failing trials are retried a bounded number of times; many short trials lose nothing."""

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow

PLANNED = 8
SWEEP = [
    "+sweep=lr",
    "trainable._target_=tests.reliability_functions.counted",
    "sweep.stages.0.search=tpe",
    "sweep.stages.0.scheduler=fifo",
    f"sweep.stages.0.num_samples={PLANNED}",
    "sweep.stages.0.extend_trials=0",  # exactly PLANNED trials, wherever the best lands
    "sweep.baseline=false",
    "sweep.concurrency=2",
]  # MLflow on: its default store, mlflow.db in the working directory (tmp_path)


def _env(tmp_path: Path, **extra) -> dict:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]),
        COUNT_FILE=str(tmp_path / "count.txt"),
        RAY_USAGE_STATS_ENABLED="0",
        **extra,
    )


def _executions(tmp_path: Path) -> collections.Counter:
    path = tmp_path / "count.txt"
    lines = path.read_text().split("\n") if path.exists() else []
    return collections.Counter(tuple(line.split()) for line in lines if line.strip())


def _finished(counts: collections.Counter) -> set[str]:
    return {trial for trial, step in counts if step == "3"}


def _start(tmp_path: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "sweeper", *SWEEP, f"hydra.run.dir={tmp_path}/run", *extra]
    return subprocess.Popen(
        args,
        cwd=tmp_path,
        env=_env(tmp_path, TRIAL_SLEEP="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_finished_trials(tmp_path: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.monotonic() + 180
    while len(_finished(_executions(tmp_path))) < n:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the sweep made no progress"
        time.sleep(0.2)


def _resume_and_check(tmp_path: Path, finished_before: set[str]) -> None:
    proc = _start(tmp_path, "sweep.resume=true")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "max_concurrent_trials" not in out  # tpe's limiter holds sweep.concurrency alone
    counts = _executions(tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    state = json.loads((tmp_path / "run" / "sweep_state.json").read_text())
    records = state["stages"][0]["records"]
    assert summary["trials"] == PLANNED == len({r["trial_id"] for r in records})
    assert all(r["status"] == "completed" for r in records), records
    # no trial that had finished before the interruption ran again, not even one step
    for trial in finished_before:
        assert [counts[(trial, str(s))] for s in (1, 2, 3)] == [1, 1, 1], trial
    # the best config is the best over all finished trials
    assert summary["best"]["value"] == min(r["metric"] for r in records)
    _searcher_saw_each_result_once(tmp_path / "run", records)
    # the report names the command the sweep started with, not the resume's
    (launched,) = [
        x for x in (tmp_path / "run" / "report.md").read_text().splitlines() if "Launched" in x
    ]
    assert "+sweep=lr" in launched and "sweep.resume" not in launched, launched
    _one_mlflow_run_per_trial_none_running(tmp_path, records)


def _searcher_saw_each_result_once(run_dir: Path, records: list[dict]) -> None:
    """TPE's study (Tune saves the searcher with the experiment) holds one finished trial
    per Tune trial, with that trial's final value: none lost, none told twice."""
    import pickle

    # one file per driver session, named by its start time: the resumed driver's is newest
    files = (run_dir / "ray" / "stage0_lr").glob("searcher-state-*.pkl")
    with open(max(files, key=lambda f: f.name), "rb") as f:
        state = pickle.load(f)  # OptunaSearch's attributes
    assert {t.state.name for t in state["_ot_study"].trials} == {"COMPLETE"}
    told = [t.value for t in state["_ot_study"].trials if t.state.name == "COMPLETE"]
    assert sorted(told) == pytest.approx(sorted(r["metric"] for r in records))


def _one_mlflow_run_per_trial_none_running(tmp_path: Path, records: list[dict]) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("sweeper").experiment_id])
    trials = [r for r in runs if r.data.tags.get("role") == "trial"]
    assert sorted(r.data.tags["trial_id"] for r in trials) == sorted(r["trial_id"] for r in records)
    assert [r.info.status for r in runs] == ["FINISHED"] * len(runs)  # no RUNNING left
    assert sum(r.data.tags.get("role") == "sweep" for r in runs) == 1


def _ray_processes(driver: int) -> int:
    """The driver's own cluster's: its session dir ends in the driver's pid (other sweeps
    may run on this machine)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    return sum(
        1
        for line in ps.splitlines()
        if ("raylet" in line or "gcs_server" in line) and f"_{driver}/" in line
    )


# SIGTERM is `kill`'s and `docker stop`'s signal: before it was handled like Ctrl+C, the
# driver died at once with Ray's dump of its native stack and no word on how to resume.
# Ctrl+C's own run is the interrupted ASHA and BOHB stages' below. One sweep takes both
# interruptions (one interrupt and resume fewer): SIGTERM, then its resume is SIGKILLed, and
# the last resume must lose and repeat nothing of either.
def test_sigterm_stops_cleanly_as_ctrl_c_does_and_a_killed_driver_resumes_losing_and_rerunning_nothing(
    tmp_path,
):
    stopped = _interrupt_after_finished_trials(tmp_path, sig=signal.SIGTERM)
    started = {trial for trial, _ in _executions(tmp_path)}  # cut short ones start over
    proc = _start(tmp_path, "sweep.resume=true")
    _wait_for_finished_trials(tmp_path, proc, 6)
    # trials finished by now have had 2 s for the driver to record them (it saves its state
    # once a second); one that finishes in the last seconds may be lost with the driver
    finished = _finished(_executions(tmp_path))
    time.sleep(2.0)
    assert _ray_processes(proc.pid) >= 2  # its GCS and raylet
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30  # Ray's processes share the driver's fate
    while _ray_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_processes(proc.pid) == 0
    at_kill = _executions(tmp_path)
    _resume_and_check(tmp_path, stopped | (finished - started))
    # and not one step of a trial finished before the kill ran after it
    after = _executions(tmp_path) - at_kill
    assert not [key for key in after if key[0] in finished], after


def test_a_failing_trial_is_retried_from_checkpoint_and_a_buggy_one_is_not_retried_forever(
    tmp_path,
):
    common = [
        sys.executable,
        "-m",
        "sweeper",
        "+sweep=lr",
        "sweep.stages.0.search=random",
        "sweep.stages.0.scheduler=fifo",
        "sweep.stages.0.num_samples=2",
        "sweep.stages.0.extend_trials=0",
        "sweep.baseline=false",
        "sweep.max_failures=2",
        "mlflow.enabled=false",
    ]
    env = _env(tmp_path, MARKER_DIR=str(tmp_path))
    ok = subprocess.run(
        [
            *common,
            "trainable._target_=tests.reliability_functions.fails_once",
            f"hydra.run.dir={tmp_path}/a",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    records = json.loads((tmp_path / "a" / "sweep_state.json").read_text())["stages"][0]["records"]
    assert [r["status"] for r in records] == ["completed", "completed"]
    assert all(r["metric"] == 3.0 for r in records)
    start = time.monotonic()
    bad = subprocess.run(
        [
            *common,
            "trainable._target_=tests.reliability_functions.always_fails",
            f"hydra.run.dir={tmp_path}/b",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert time.monotonic() - start < 120
    # each failed trial is named with its error and where the full error is ...
    failures = [line for line in bad.stdout.splitlines() if "FAILED after its retries" in line]
    assert len(failures) == 2, bad.stdout[-3000:]
    assert all("ValueError: a bug in user code" in f and "error.txt" in f for f in failures)
    # ... and a stage whose every trial failed ends the sweep in one line, exit 1
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: every trial of stage 'lr' failed: ValueError: a bug in user code; earlier "
        f"stages are kept: continue with sweep.resume=true hydra.run.dir={tmp_path}/b"
    )
    assert not (tmp_path / "b" / "summary.json").exists()


def test_trials_ray_kills_for_memory_end_the_sweep_with_a_one_line_cause(tmp_path):
    # Ray's memory monitor, told that 2% of the machine's memory is too much, kills every
    # trial's worker: the real path of an out-of-memory sweep
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sweeper",
            "+sweep=smoke",
            "sweep.baseline=false",
            "mlflow.enabled=false",
            f"hydra.run.dir={tmp_path}/run",
        ],
        env=_env(tmp_path, RAY_memory_usage_threshold="0.02", RAY_memory_monitor_refresh_ms="100"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert last.startswith("error: every trial of stage 'lr' failed: "), last
    assert "low on memory" in last and "sweep.concurrency=1" in last, last


def test_load_100_one_second_trials_complete_with_no_lost_result(tmp_path):
    args = [
        sys.executable,
        "-m",
        "sweeper",
        *SWEEP,
        "sweep.stages.0.search=random",
        "sweep.stages.0.num_samples=100",
        f"hydra.run.dir={tmp_path}/run",
    ]
    proc = subprocess.run(
        args,
        cwd=tmp_path,
        env=_env(tmp_path, TRIAL_SLEEP="0.33"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the searcher holds sweep.concurrency; Tune, given it too, warned that it ignored it
    assert "max_concurrent_trials" not in proc.stdout + proc.stderr
    state = json.loads((tmp_path / "run" / "sweep_state.json").read_text())
    records = state["stages"][0]["records"]
    assert len(records) == 100 and all(r["status"] == "completed" for r in records)
    counts = _executions(tmp_path)
    assert len({trial for trial, _ in counts}) == 100 and set(counts.values()) == {1}
    reports = state["stages"][0]["reports"]
    assert len(reports) == 300  # every report of every trial reached the driver


def test_tunes_superseded_state_upload_is_dropped_and_other_failures_are_not():
    """The race behind a rare Ray traceback on Ctrl+C (ray_cluster.DropsSupersededStateUpload)
    cannot be timed from a test; the filter is checked on the logger Tune really uses."""
    import logging

    from ray.tune.execution import experiment_state

    from sweeper.sweep.cluster import DropsSupersededStateUpload

    logger = experiment_state.logger
    assert any(isinstance(f, DropsSupersededStateUpload) for f in logger.filters)

    def record(error: BaseException) -> logging.LogRecord:
        return logger.makeRecord(
            logger.name,
            logging.ERROR,
            __file__,
            1,
            "Saving experiment state failed",
            (),
            (type(error), error, None),
        )

    renamed = FileNotFoundError(
        "[Errno 2] Failed to open local file '/tmp/ray/session_x/artifacts/y/stage0_lr/"
        "driver_artifacts/.c4fac8d6-tmp-searcher-state-2026-11-27_20-54-22.pkl'"
    )
    assert not logger.filter(record(renamed))
    assert logger.filter(record(FileNotFoundError("[Errno 2] no such file: 'ray/stage0_lr'")))
    assert logger.filter(record(PermissionError("read-only storage")))
    assert logger.filter(logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "x", (), None))


def _interrupt_after_finished_trials(
    tmp_path: Path, *extra: str, sig=signal.SIGINT, n: int = 3
) -> set[str]:
    """Starts the sweep, interrupts it once `n` trials have finished and checks it stopped
    cleanly; returns the trials that had finished."""
    proc = _start(tmp_path, *extra)
    _wait_for_finished_trials(tmp_path, proc, n)
    finished = _finished(_executions(tmp_path))
    time.sleep(1.0)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert "interrupted" in out and "sweep.resume=true" in out, out[-2000:]
    # the sweep's own way on is the only advice: not Tune's Python (Tuner.restore)
    assert "Tuner.restore" not in out and "Failed to fetch metrics" not in out, out[-3000:]
    # the interrupted stage's time is kept: the sweep's elapsed (and time cap) count it
    state = json.loads((tmp_path / "run" / "sweep_state.json").read_text())
    assert state["elapsed"] > 3.0  # 3 trials of 3 one-second steps had finished
    return finished


# a rung every report: the function reports 3 times, and its clock is its report count
RANKED = ["sweep.budget.tokens_per_trial=null", "sweep.reports_per_trial=3"]


def test_an_interrupted_asha_stage_resumes_with_the_values_its_rungs_held(tmp_path):
    """Ray rebuilds a restored stage's scheduler with empty rungs (ray-project/ray#30838):
    the resume gives ASHA back every value reported before, and no finished trial runs
    again; the progress counts them as done."""
    asha = ["sweep.stages.0.search=random", "sweep.stages.0.scheduler=asha", *RANKED]
    finished = _interrupt_after_finished_trials(tmp_path, *asha)
    proc = _start(tmp_path, *asha, "sweep.resume=true")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    replayed = re.search(r"ASHA's rungs hold the values of its (\d+) trials that reported", out)
    assert replayed and int(replayed.group(1)) >= len(finished), out[-3000:]
    first_line = next(line for line in out.splitlines() if "trials done" in line)
    assert int(first_line.split("/")[0].removeprefix("[lr] ")) >= len(finished), first_line
    counts = _executions(tmp_path)
    for trial in finished:
        assert [counts[(trial, str(s))] for s in (1, 2, 3)] == [1, 1, 1], trial
    state = json.loads((tmp_path / "run" / "sweep_state.json").read_text())
    assert len(state["stages"][0]["records"]) == PLANNED


def test_an_interrupted_bohb_stage_resumes_its_brackets(tmp_path):
    """Ray rebuilds a restored HyperBand with empty brackets (ray-project/ray#30838): the
    resume gives the scheduler back the brackets Tune saved with its state, so the same
    trials go on where they were: no finished trial runs again, no trial is added past the
    plan, and the stage finishes with every planned trial. BOHB, since its searcher must
    also agree with the brackets (it failed on a trial it had forgotten); plain hyperband
    with the real trainable: test_sweep's time-cap resume."""
    hyperband = ["sweep.stages.0.search=bohb", "sweep.stages.0.scheduler=bohb", *RANKED]
    finished = _interrupt_after_finished_trials(tmp_path, *hyperband)
    before = {trial for trial, _ in _executions(tmp_path)}
    proc = _start(tmp_path, *hyperband, "sweep.resume=true")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "its brackets as they were" in out and "starts over" not in out, out[-3000:]
    counts = _executions(tmp_path)
    for trial in finished:
        assert [counts[(trial, str(s))] for s in (1, 2, 3)] == [1, 1, 1], trial
    # the trials are the interrupted run's and the ones it had yet to start: a stage that
    # started over would have trained PLANNED new trials beside the old ones
    executed = {trial for trial, _ in counts}
    assert before < executed or len(before) == PLANNED, (before, executed)
    assert len(executed) == PLANNED, sorted(executed)
    state = json.loads((tmp_path / "run" / "sweep_state.json").read_text())
    records = state["stages"][0]["records"]
    assert {r["trial_id"] for r in records} == executed
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["trials"] == PLANNED
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("sweeper").experiment_id])
    assert "RUNNING" not in {r.info.status for r in runs}
    trials = [r for r in runs if r.data.tags.get("role") == "trial"]
    assert sorted(r.data.tags["trial_id"] for r in trials) == sorted(executed)
