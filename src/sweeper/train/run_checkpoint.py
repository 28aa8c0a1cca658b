"""A single run's checkpoint, and `trainer.resume=true`, which continues from it.

With `trainer.checkpoint_every_eval=true`, `python -m sweeper` keeps the run's training
state (model, optimizer, RNG, step, history) in `<run dir>/checkpoint/` at each evaluation,
with `checkpoint.json`, written last: the state file, its step and the run config. The same
command plus `hydra.run.dir=<that dir> trainer.resume=true` goes on from that step; batches
are a function of the step (data.BatchSampler), so the run ends as it would have without
the stop, bit for bit on the same machine.

A sweep's trials checkpoint through Ray Tune instead (sweep/trainable.py), and a sweep
resumes with `sweep.resume=true`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path

from sweeper.config.errors import ConfigError
from sweeper.text import mask_secrets
from sweeper.train.checkpoint import STATE_FILE, load_state, save_state

CHECKPOINT_DIR = "checkpoint"
RECORD_FILE = "checkpoint.json"
# how a run runs, not what it trains: a resume may change these
RUN_SETTINGS = frozenset(
    {
        "trainer.resume",
        "trainer.checkpoint_every_eval",
        "trainer.threads",
        "trainer.log_every",
        "trainer.dist_timeout_s",
    }
)


def checkpoint_folder(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether a save was committed there: its record is written last (a state file
    without one is a save cut short, which the run's next save removes)."""
    return (checkpoint_folder(run_dir) / RECORD_FILE).is_file()


def save_run_checkpoint(run_dir: str | Path, state: dict, run_config: dict) -> None:
    """The training state in a file of its step's, then the record that names it, its step
    and the run's config, then the older states go. The record's atomic rename is the
    commit, so a kill at any moment leaves a record and the state it names at the same
    step (one state file replaced in place could end up an evaluation ahead of its record)."""
    from sweeper.files import write_json_atomic

    folder = checkpoint_folder(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"training_state-{state['step']}.pt"
    save_state(folder, state, name)
    # the evaluations too: after an interrupt, a DDP run's driver logs from here those that
    # rank 0 sent after the driver's last look at its queue (saved_evaluations_after)
    record = {
        "step": state["step"],
        "state": name,
        "history": state.get("history", []),
        "config": run_config,
    }
    write_json_atomic(folder / RECORD_FILE, record)
    for older in folder.glob("training_state*.pt"):  # STATE_FILE: a checkpoint of older code
        if older.name != name:
            older.unlink(missing_ok=True)


def checkpoint_saver(run_dir: str | Path, run_config: dict) -> Callable:
    """The `report` hook of train() that keeps a single run's checkpoint."""

    def report(metrics: dict, state=None) -> None:
        if state is not None:
            save_run_checkpoint(run_dir, state(), run_config)

    return report


def saved_evaluations_after(run_dir: str | Path, step: int) -> list[dict]:
    """The evaluations in the run's checkpoint record taken after `step` (none if there is
    no readable record)."""
    try:
        return [metrics for metrics in read_record(run_dir)["history"] if metrics["step"] > step]
    except (ConfigError, KeyError, TypeError):
        return []


def read_record(run_dir: str | Path) -> dict:
    """checkpoint.json of the run in `run_dir`; ConfigError if it cannot be read."""
    path = checkpoint_folder(run_dir) / RECORD_FILE
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
            raise ValueError("no config in it")
        return record
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) else str(error)
        raise ConfigError(f"trainer.resume=true: {path} cannot be read ({reason})") from None


def finished(run_dir: str | Path) -> bool:
    """Whether the run in `run_dir` ended (its result.json says completed or diverged)."""
    try:
        result = json.loads((Path(run_dir) / "result.json").read_text())
        return result.get("status") in ("completed", "diverged")
    except (OSError, ValueError, AttributeError):
        return False  # none yet (killed), or unreadable: the checkpoint decides


def check_new_run_dir(run_dir: str) -> None:
    """A new single run may not start in a dir that holds another run's checkpoint: it
    would write over it (an interrupted run's way to go on, a finished run's weights)."""
    if not has_checkpoint(run_dir):
        return
    how = "" if finished(run_dir) else "continue it with trainer.resume=true, or "
    raise ConfigError(
        f"hydra.run.dir={run_dir} holds a run's checkpoint ({CHECKPOINT_DIR}/): "
        f"{how}choose another hydra.run.dir"
    )


def check_resumable_run(run_dir: str, run_config: dict) -> None:
    """`trainer.resume=true` into `run_dir`: it must hold a checkpoint of this same run
    that has not finished. Raises ConfigError naming what is wrong."""
    from sweeper.sweep.state import (
        ABSENT,
        as_json,
        at_schema_default,
        changes_text,
        differences,
    )

    if not has_checkpoint(run_dir):
        raise ConfigError(
            f"trainer.resume=true: hydra.run.dir={run_dir} holds no checkpoint "
            f"({CHECKPOINT_DIR}/{RECORD_FILE}); a run keeps one at each evaluation with "
            "trainer.checkpoint_every_eval=true"
        )
    if finished(run_dir):
        raise ConfigError(
            f"trainer.resume=true: hydra.run.dir={run_dir} holds a finished run "
            "(result.json); nothing to resume"
        )
    record = read_record(run_dir)
    state = checkpoint_folder(run_dir) / state_name(record)
    if not state.is_file():
        raise ConfigError(
            f"trainer.resume=true: {state} is missing, the state its {RECORD_FILE} names"
        )
    saved = record["config"]
    changed = [
        (key, old, new)
        for key, old, new in differences(as_json(saved), as_json(run_config))
        # a key added to the schema after the checkpoint, at the value older code behaved as
        if key not in RUN_SETTINGS and not (old == ABSENT and at_schema_default(key, new))
    ]
    if changed:
        raise ConfigError(
            f"trainer.resume=true: hydra.run.dir={run_dir} holds a run of another config: "
            f"{changes_text(changed)}; resume with the overrides that started it"
        )


def state_name(record: dict) -> str:
    """The state file a record names (older code kept one, STATE_FILE, and named none)."""
    return record.get("state", STATE_FILE)


def load_resume_state(run_dir: str | Path) -> dict:
    return load_state(checkpoint_folder(run_dir), state_name(read_record(run_dir)))


def resume_command(overrides: Sequence[str], run_dir: str | Path) -> str:
    """The shell line that continues an interrupted run: its own overrides, then the run
    dir and trainer.resume=true (a later override of a key wins in Hydra)."""
    from sweeper.config.compose import other_budgets_cleared
    from sweeper.config.schema import BUDGET_KEYS

    kept = [o for o in overrides if o.split("=")[0].lstrip("+") != "trainer.resume"]
    # the `trainer.X=null` the command line's one budget brought with it come back by
    # themselves (cli.other_budgets_cleared): the line shows what the user typed
    nulls = [o for o in kept if o in {f"trainer.{key}=null" for key in BUDGET_KEYS}]
    typed = [o for o in kept if o not in nulls]
    if nulls and sorted(other_budgets_cleared(typed)) == sorted(nulls):
        kept = typed
    line = ["python", "-m", "sweeper", *kept, f"hydra.run.dir={run_dir}", "trainer.resume=true"]
    return mask_secrets(shlex.join(line))  # a password is typed again, not printed
