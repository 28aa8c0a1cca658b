"""A single run's checkpoint (trainer.checkpoint_every_eval) and trainer.resume=true."""

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

import pytest

from sweeper.config.compose import compose, other_budgets_cleared
from sweeper.config.errors import ConfigError
from sweeper.config.schema import load_run_config
from sweeper.train.loop import train
from sweeper.train.run_checkpoint import (
    check_new_run_dir,
    check_resumable_run,
    checkpoint_saver,
    has_checkpoint,
    load_resume_state,
    resume_command,
)

from .conftest import REPO, run_cli, tiny

# a run of 300 steps of 512 tokens: a few seconds, with a checkpoint every 20 steps
LONG_RUN_STEPS = 300
LONG_RUN = [
    "model=tiny",
    f"trainer.max_steps={LONG_RUN_STEPS}",
    "trainer.eval_every=20",
    "trainer.eval_tokens=1024",
    "trainer.total_batch_size=512",
    "trainer.device_batch_size=8",
    "trainer.checkpoint_every_eval=true",
]
# four steps, a checkpoint at 2 and 4
SHORT_RUN = LONG_RUN[:1] + ["trainer.max_steps=4", "trainer.eval_every=2"] + LONG_RUN[3:]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO / "src"), PYTHONUNBUFFERED="1")


def _interrupt_after_first_checkpoint(args: list[str], cwd) -> tuple[int, str]:
    """Starts `python -m sweeper args`, sends SIGTERM (kill, docker stop) once its first
    checkpoint is written; returns the exit code and stderr."""
    run_dir = next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir="))
    # the record: a save writes it last, naming the state written before it
    state = cwd / run_dir / "checkpoint" / "checkpoint.json"
    with subprocess.Popen(
        [sys.executable, "-m", "sweeper", *args],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        while not state.exists() and proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.02)
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return proc.returncode, err


@pytest.mark.slow
def test_an_interrupted_run_goes_on_from_its_checkpoint_as_if_never_stopped(tmp_path):
    code, err = _interrupt_after_first_checkpoint([*LONG_RUN, "hydra.run.dir=stopped"], tmp_path)
    assert code == 130, err[-2000:]
    assert json.loads((tmp_path / "stopped" / "result.json").read_text())["status"] == "failed"
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"interrupted: status failed -> {tmp_path}/stopped/result.json; ")
    step = json.loads((tmp_path / "stopped" / "checkpoint" / "checkpoint.json").read_text())["step"]
    assert 20 <= step < LONG_RUN_STEPS and step % 20 == 0
    # the line names the step and the command that goes on, which is run as printed
    said, command = last.split("; continue from step ", 1)[1].split(" with: ", 1)
    assert int(said) == step
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "sweeper"] and words[-1] == "trainer.resume=true"
    assert "trainer.budget_tokens=null" not in words  # what the user typed, not what it added
    resumed = subprocess.run(
        [sys.executable, *words[1:]], cwd=tmp_path, env=_env(), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed at step {step}/{LONG_RUN_STEPS} from a checkpoint" in resumed.stdout

    straight = run_cli([*LONG_RUN, "hydra.run.dir=straight"], cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-2000:]
    one, two = (
        json.loads((tmp_path / d / "result.json").read_text()) for d in ("stopped", "straight")
    )
    assert one["status"] == "completed" and one["steps"] == LONG_RUN_STEPS
    # bit for bit: the same batches (a function of the step), weights, optimizer and RNG
    assert one["loss_trace"] == two["loss_trace"] and one["val_bpb"] == two["val_bpb"]
    assert [h["val_bpb"] for h in one["history"]] == [h["val_bpb"] for h in two["history"]]
    # and it went on checkpointing (a resumed run keeps the setting it started with)
    assert (
        json.loads((tmp_path / "stopped" / "checkpoint" / "checkpoint.json").read_text())["step"]
        == LONG_RUN_STEPS
    )


def test_a_run_resumed_at_its_last_step_returns_its_result(tmp_path):
    """Killed after its last checkpoint but before result.json: nothing is left to train,
    and the result is the one the run had reached."""
    run = load_run_config(
        tiny(trainer={"checkpoint_every_eval": True, "max_steps": 6, "eval_every": 3})
    )
    first = train(run, checkpoint_saver(tmp_path, run.to_dict()), verbose=False)
    again = train(run, resume_state=load_resume_state(tmp_path), verbose=False)
    assert again["status"] == "completed" and again["steps"] == 6
    assert again["val_bpb"] == first["val_bpb"] and again["train_loss"] == first["train_loss"]
    assert again["loss_trace"] == first["loss_trace"]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A run dir as a hard kill (no result.json) after its last checkpoint leaves it."""
    root = tmp_path_factory.mktemp("killed")
    proc = run_cli([*SHORT_RUN, "hydra.run.dir=run"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (root / "run" / "result.json").unlink()
    return root / "run"


def _listing(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*"))


BAD_RESUMES = [
    # (extra overrides, what the one line names); {run} is the killed run's dir
    (["trainer.resume=true"], "add hydra.run.dir=<the interrupted run's dir>"),
    (
        ["hydra.run.dir={empty}", "trainer.resume=true"],
        "holds no checkpoint (checkpoint/checkpoint.json)",
    ),
    (
        ["hydra.run.dir={run}", "trainer.resume=true", "optimizer.matrix_lr=0.05"],
        "holds a run of another config: optimizer.matrix_lr 0.02 -> 0.05; resume with the",
    ),
    (
        ["hydra.run.dir={run}"],
        "holds a run's checkpoint (checkpoint/): continue it with trainer.resume=true",
    ),
    (
        ["hydra.run.dir={run}", "+sweep=smoke", "trainer.resume=true"],
        "a sweep resumes with sweep.resume=true",
    ),
    (
        [
            "hydra.run.dir={run}",
            "trainable._target_=tests.user_functions.quadratic",
            "trainer.resume=true",
        ],
        "trainable._target_=tests.user_functions.quadratic replaces",
    ),
]


@pytest.mark.parametrize("extra, names", BAD_RESUMES, ids=[" ".join(e) for e, _ in BAD_RESUMES])
def test_a_resume_that_cannot_go_on_is_one_line_and_touches_nothing(
    killed_run, tmp_path, extra, names
):
    before = _listing(killed_run)
    extra = [e.format(run=killed_run, empty=tmp_path / "empty") for e in extra]
    proc = run_cli([*SHORT_RUN, *extra], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], proc.stderr
    assert _listing(killed_run) == before
    assert list(tmp_path.iterdir()) == []  # no run dir, no outputs/ of Hydra's


def test_a_finished_run_is_not_resumed_nor_written_over(killed_run, tmp_path):
    finished = tmp_path / "finished"
    shutil.copytree(killed_run, finished)
    (finished / "result.json").write_text(json.dumps({"status": "completed"}))
    before = _listing(finished)
    for extra, names in (
        (["trainer.resume=true"], "holds a finished run (result.json); nothing to resume"),
        ([], "holds a run's checkpoint (checkpoint/): choose another hydra.run.dir"),
    ):
        proc = run_cli([*SHORT_RUN, f"hydra.run.dir={finished}", *extra], cwd=tmp_path, timeout=60)
        assert proc.returncode == 2 and names in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert _listing(finished) == before


def test_an_unreadable_record_is_named(killed_run, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(killed_run, broken)
    (broken / "checkpoint" / "checkpoint.json").write_text("{not json")
    proc = run_cli([*SHORT_RUN, f"hydra.run.dir={broken}", "trainer.resume=true"], cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{broken}/checkpoint/checkpoint.json cannot be read" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.slow
def test_a_killed_run_resumes_with_other_run_settings(killed_run, tmp_path):
    # how the run runs (threads, log lines, checkpointing) may change; what it trains not
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run, run_dir)
    args = [*SHORT_RUN[:-1], "trainer.log_every=1", "trainer.threads=1"]
    proc = run_cli([*args, f"hydra.run.dir={run_dir}", "trainer.resume=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed at step 4/4 from a checkpoint" in proc.stdout
    assert json.loads((run_dir / "result.json").read_text())["status"] == "completed"


def _composed(args: list[str]):
    """The run config `python -m sweeper args` trains (with the budget's own nulls)."""
    return load_run_config(compose([*args, *other_budgets_cleared(args)]))


def test_the_saved_config_decides_what_may_change(tmp_path):
    run = _composed(SHORT_RUN)
    assert train(run, checkpoint_saver(tmp_path, run.to_dict()), verbose=False)["steps"] == 4
    changed = _composed([*SHORT_RUN, "trainer.log_every=1", "trainer.threads=2"])
    check_resumable_run(str(tmp_path), changed.to_dict())  # run settings: accepted
    record = json.loads((tmp_path / "checkpoint" / "checkpoint.json").read_text())
    del record["config"]["optimizer"]["weight_decay_schedule"]  # a checkpoint of older code
    (tmp_path / "checkpoint" / "checkpoint.json").write_text(json.dumps(record))
    check_resumable_run(str(tmp_path), run.to_dict())  # a new key at its default: accepted
    other = _composed([*SHORT_RUN, "optimizer.weight_decay_schedule=linear"])
    with pytest.raises(ConfigError, match=r"weight_decay_schedule '\(absent\)' -> 'linear'"):
        check_resumable_run(str(tmp_path), other.to_dict())


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # the budget's own nulls (cli.other_budgets_cleared) are left to come back by themselves
        (
            [
                "model=tiny",
                "trainer.max_steps=5",
                "trainer.budget_tokens=null",
                "trainer.budget_flops=null",
                "trainer.tokens_per_param=null",
            ],
            "python -m sweeper model=tiny trainer.max_steps=5 'hydra.run.dir=/tmp/a b' trainer.resume=true",
        ),
        # a null the user chose beside two budgets is theirs: kept
        (
            ["trainer.max_steps=5", "trainer.budget_tokens=null"],
            "python -m sweeper trainer.max_steps=5 trainer.budget_tokens=null 'hydra.run.dir=/tmp/a b' trainer.resume=true",
        ),
        (
            ["trainer.resume=true", "data=shards", "data.path=/d/*.bin"],
            "python -m sweeper data=shards 'data.path=/d/*.bin' 'hydra.run.dir=/tmp/a b' trainer.resume=true",
        ),
        # a password is not printed: the user types it again
        (
            ["mlflow.tracking_uri=postgresql://me:pw@db/mlflow"],
            "python -m sweeper mlflow.tracking_uri=postgresql://me:***@db/mlflow 'hydra.run.dir=/tmp/a b' trainer.resume=true",
        ),
    ],
)
def test_the_resume_command_is_the_run_s_own_overrides(overrides, expected):
    assert resume_command(overrides, "/tmp/a b") == expected


def test_a_resumed_run_holds_no_second_copy_of_its_weights(tmp_path):
    import weakref

    run = load_run_config(
        tiny(trainer={"checkpoint_every_eval": True, "max_steps": 6, "eval_every": 3})
    )
    train(run, checkpoint_saver(tmp_path, run.to_dict()), verbose=False)
    state = load_resume_state(tmp_path)  # the caller keeps its dict, as __main__ does
    loaded = weakref.ref(state["model"]["lm_head.weight"])
    assert state["model"]["lm_head.weight"].device.type == "cpu"
    alive = []
    longer = load_run_config(tiny(trainer={"max_steps": 9, "eval_every": 3}))
    train(longer, lambda m, state=None: alive.append(loaded() is not None), resume_state=state)
    assert alive == [False], alive  # the loaded tensor was freed once copied into the model


@pytest.mark.parametrize("killed_save", [1, 2])
def test_a_kill_between_a_state_and_its_record_leaves_them_agreeing(
    killed_save, tmp_path, monkeypatch
):
    """Killed after a save's state was written but before its record. The first save: no
    checkpoint, a dir a new run may use (and whose next save clears the stray state). A
    later one: the record and the state it names are the previous save's, at one step.
    With one state file replaced in place, the record said step 2 and the state held 4:
    a DDP resume went on from step 10 where the interrupted run had printed 5 (CI)."""
    import sweeper.files as files
    import sweeper.train.run_checkpoint as rc

    class Killed(BaseException):
        pass

    saves = []
    save_state, write_json = rc.save_state, files.write_json_atomic

    def state_then_count(folder, state, *name):
        saves.append(save_state(folder, state, *name))

    def record_unless_the_killed_save(path, data):
        if len(saves) == killed_save:
            raise Killed
        write_json(path, data)

    monkeypatch.setattr(rc, "save_state", state_then_count)
    monkeypatch.setattr(files, "write_json_atomic", record_unless_the_killed_save)
    run = load_run_config(
        tiny(trainer={"checkpoint_every_eval": True, "max_steps": 6, "eval_every": 2})
    )
    with pytest.raises(Killed):
        train(run, checkpoint_saver(tmp_path, run.to_dict()), verbose=False)
    if killed_save == 1:
        assert not has_checkpoint(tmp_path)
        check_new_run_dir(str(tmp_path))  # a new run may start here
        monkeypatch.undo()
        train(run, checkpoint_saver(tmp_path, run.to_dict()), verbose=False)
        names = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
        assert names == ["checkpoint.json", "training_state-6.pt"]  # the stray one went
        return
    check_resumable_run(str(tmp_path), run.to_dict())
    record = json.loads((tmp_path / "checkpoint" / "checkpoint.json").read_text())
    assert record["step"] == load_resume_state(tmp_path)["step"] == 2
    assert [h["step"] for h in record["history"]] == [2]
    assert saves[-1].name == "training_state-4.pt"  # the killed save's, left for the next


def test_a_record_whose_state_is_gone_is_refused_in_one_line(tmp_path):
    run = load_run_config(
        tiny(trainer={"checkpoint_every_eval": True, "max_steps": 4, "eval_every": 2})
    )
    saver = checkpoint_saver(tmp_path, run.to_dict())
    train(run, lambda metrics, state=None: saver(metrics, state) if metrics["step"] < 4 else None)
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [
        "checkpoint.json",
        "training_state-2.pt",
    ]
    check_resumable_run(str(tmp_path), run.to_dict())
    (tmp_path / "checkpoint" / "training_state-2.pt").unlink()
    with pytest.raises(ConfigError, match=r"training_state-2\.pt is missing, the state its"):
        check_resumable_run(str(tmp_path), run.to_dict())


def test_a_checkpoint_of_older_code_resumes_and_its_state_file_goes(tmp_path):
    """Older code kept one state file, training_state.pt, and a record that named none."""
    run = load_run_config(
        tiny(trainer={"checkpoint_every_eval": True, "max_steps": 4, "eval_every": 2})
    )
    saver = checkpoint_saver(tmp_path, run.to_dict())
    train(run, lambda metrics, state=None: saver(metrics, state) if metrics["step"] < 4 else None)
    folder = tmp_path / "checkpoint"
    (folder / "training_state-2.pt").rename(folder / "training_state.pt")
    record = json.loads((folder / "checkpoint.json").read_text())
    del record["state"]
    (folder / "checkpoint.json").write_text(json.dumps(record))
    check_resumable_run(str(tmp_path), run.to_dict())
    state = load_resume_state(tmp_path)
    assert state["step"] == 2
    train(run, saver, resume_state=state, verbose=False)
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.json", "training_state-4.pt"]


def test_a_checkpoint_record_names_the_evaluations_a_ddp_driver_may_not_have_logged(tmp_path):
    """A DDP run's driver, interrupted, logs from the checkpoint's record the evaluations
    rank 0 sent after the driver's last look at its queue (__main__.run_ddp)."""
    import torch

    from sweeper.train.run_checkpoint import save_run_checkpoint, saved_evaluations_after

    assert saved_evaluations_after(tmp_path, 0) == []  # no checkpoint: nothing to add
    history = [{"step": 5, "val_bpb": 3.1}, {"step": 10, "val_bpb": 2.9, "status": "running"}]
    state = {"model": {"w": torch.zeros(2)}, "step": 10, "history": history}
    save_run_checkpoint(tmp_path, state, load_run_config(tiny()).to_dict())
    assert saved_evaluations_after(tmp_path, 5) == history[1:]
    assert saved_evaluations_after(tmp_path, 0) == history
    assert saved_evaluations_after(tmp_path, 10) == []
