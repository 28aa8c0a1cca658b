"""Checkpoint files survive kills: atomic saves, fallback past a corrupt newest one."""

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sweeper.files import TEMP_PREFIX
from sweeper.train.checkpoint import STATE_FILE, load_latest_state, load_state, save_state

from .conftest import REPO


def test_save_is_atomic_and_loads_back(tmp_path):
    state = {"step": 3, "w": torch.arange(5.0)}
    save_state(tmp_path, state)
    loaded = load_state(tmp_path)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], state["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]  # no temp file left


def test_a_kill_during_a_save_leaves_the_previous_state_loadable(tmp_path):
    save_state(tmp_path, {"step": 1})
    # a child process starts saving a large state and is SIGKILLed mid-write
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[2]);"
        "from sweeper.train.checkpoint import save_state;"
        "save_state(sys.argv[1], {'step': 2, 'big': torch.zeros(200_000_000)})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(REPO / "src")])
    deadline = time.monotonic() + 60
    while not (temps := list(tmp_path.glob(f"{TEMP_PREFIX}{STATE_FILE}.*"))) or not (
        temps[0].stat().st_size > 0  # the write has begun
    ):
        assert proc.poll() is None and time.monotonic() < deadline, "never caught mid-save"
        time.sleep(0.001)
    tmp_file = temps[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert tmp_file.stat().st_size < 800_000_000  # it really was cut off mid-write
    assert load_state(tmp_path)["step"] == 1


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    old, new = tmp_path / "checkpoint_000001", tmp_path / "checkpoint_000002"
    old.mkdir()
    new.mkdir()
    save_state(old, {"step": 1})
    (new / STATE_FILE).write_bytes(b"truncated garbage")
    assert load_latest_state(new)["step"] == 1
    save_state(new, {"step": 2})
    assert load_latest_state(new)["step"] == 2


class RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_that_would_run_code_is_refused_not_run(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"step": 1, "payload": RunsCodeWhenUnpickled(marker)}, tmp_path / STATE_FILE)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_state(tmp_path)
    assert not marker.exists()


def test_a_trained_runs_state_is_tensors_and_plain_values(tmp_path, tiny_config):
    from sweeper.train.loop import train
    from sweeper.train.run_checkpoint import checkpoint_saver, load_resume_state

    config = tiny_config(trainer={"max_steps": 2, "eval_every": 1, "checkpoint_every_eval": True})
    train(config, checkpoint_saver(tmp_path, config), verbose=False)
    state = load_resume_state(tmp_path)  # weights_only: anything else in it is refused
    assert state["step"] == 2 and state["model"] and state["optimizer"]
