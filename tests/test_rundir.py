"""One process per run dir, whole output files, and dirs that are not ours left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sweeper.config.errors import ConfigError
from sweeper.files import TEMP_PREFIX, remove_stale_temps, write_atomic, write_json_atomic
from sweeper.rundir import LOCK_NAME, new_default_dir, take_run_dir
from tests.conftest import REPO, TINY_SWEEP, run_cli

TINY_RUN = ["model=tiny", "trainer.max_steps=2", "trainer.budget_tokens=null"]
TINY_RUN += ["mlflow.enabled=false"]


@pytest.fixture
def held_dir(tmp_path):
    """A run dir held by another process, as a running sweep holds its own."""
    run_dir = tmp_path / "held"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from sweeper.rundir import take_run_dir; "
            f"take_run_dir({str(run_dir)!r}); print('held', flush=True); time.sleep(600)",
        ],
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "held\n"
    yield run_dir, holder.pid
    holder.kill()
    holder.wait()


def files_in(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "command",
    [TINY_RUN, [*TINY_SWEEP, "mlflow.enabled=false"], [*TINY_SWEEP, "sweep.resume=true"]],
    ids=["run", "sweep", "resume"],
)
def test_a_second_process_on_a_held_run_dir_stops_naming_the_holder(held_dir, command):
    run_dir, pid = held_dir
    before = files_in(run_dir)
    proc = run_cli([*command, f"hydra.run.dir={run_dir}"], run_dir.parent)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: hydra.run.dir={run_dir} is in use by pid {pid} (")
    assert "take_run_dir" in proc.stderr  # the holder's command
    assert files_in(run_dir) == before
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["held"]  # no outputs/, no db


def test_the_lock_goes_with_its_process(held_dir, tmp_path):
    run_dir, _ = held_dir
    with pytest.raises(ConfigError, match="in use by pid"):
        take_run_dir(str(run_dir))
    os.kill(held_dir[1], 9)
    time.sleep(0.5)
    take_run_dir(str(run_dir))  # a killed holder's lock is free: the resume can start
    assert (run_dir / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} (")


def test_two_runs_in_the_same_second_with_hydras_default_dir_get_two_dirs(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), RAY_USAGE_STATS_ENABLED="0")
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "sweeper", *TINY_RUN, "trainer.seed=" + str(seed)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    for run in runs:
        assert run.wait(timeout=180) == 0, run.stderr.read()[-2000:]
    results = sorted((tmp_path / "outputs").glob("*/*/result.json"))
    assert len(results) == 2, results  # one dir each, each with its own record


def test_a_default_dir_taken_in_the_same_second_gets_a_suffix(tmp_path, monkeypatch):
    second = time.localtime()
    monkeypatch.setattr("sweeper.rundir.time.localtime", lambda: second)  # one clock reading
    first, again, third = (Path(new_default_dir(str(tmp_path))) for _ in range(3))
    assert again.name == first.name + "-2" and third.name == first.name + "-3"
    assert first.parent == again.parent == tmp_path / time.strftime("%Y-%m-%d", second)
    assert all(p.is_dir() for p in (first, again, third))


def test_a_run_dir_that_is_not_writable_is_one_line(tmp_path):
    proc = run_cli([*TINY_RUN, "hydra.run.dir=/proc"], tmp_path)
    assert proc.returncode == 2
    assert (
        proc.stderr == "error: hydra.run.dir=/proc is not writable; choose another hydra.run.dir\n"
    )


def test_a_dir_of_other_files_is_refused_unless_the_user_says_so(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    for name in ("notes.txt", "train.py", "data", "z.csv"):
        (project / name).write_text("mine")
    before = files_in(project)
    proc = run_cli([*TINY_RUN, f"hydra.run.dir={project}"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: hydra.run.dir={project} holds files that are not a sweeper run (data, "
        "notes.txt, train.py, ...): choose an empty or new dir, or add "
        "allow_nonempty_dir=true to write there anyway\n"
    )
    assert files_in(project) == before

    proc = run_cli([*TINY_RUN, f"hydra.run.dir={project}", "allow_nonempty_dir=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (project / "result.json").exists() and (project / "notes.txt").read_text() == "mine"


def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temp(tmp_path):
    target = tmp_path / "summary.json"
    write_json_atomic(target, {"best": 1})

    def half_then_crash(f):
        f.write(b'{"best": ')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, half_then_crash)
    assert json.loads(target.read_text()) == {"best": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_atomic_files_keep_the_umasks_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_json_atomic(tmp_path / "result.json", {"status": "completed"})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_killed_writers_temp_files_are_removed_by_the_next_run(tmp_path):
    left = tmp_path / f"{TEMP_PREFIX}summary.json.123-abcd"
    left.write_text('{"half')
    (tmp_path / "checkpoint").mkdir()
    deeper = tmp_path / "checkpoint" / f"{TEMP_PREFIX}training_state-4.pt.123-abcd"
    deeper.write_bytes(b"half a state")
    (tmp_path / "summary.json").write_text("{}")
    take_run_dir(str(tmp_path))
    assert not left.exists() and not deeper.exists() and (tmp_path / "summary.json").exists()
    assert remove_stale_temps(tmp_path) == []
