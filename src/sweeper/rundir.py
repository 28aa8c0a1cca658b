"""The run dir a command writes to, checked before Hydra writes there: a directory that can
be made, and one that holds nothing this command would write over (another sweep's state,
a run's record or checkpoint), or, to resume, the very run or sweep it goes on with. Then
the dir is taken for this process alone (`take_run_dir`): one process per run dir."""

from __future__ import annotations

import fcntl
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from sweeper.config.errors import ConfigError
from sweeper.config.schema import NONEMPTY_DIR_KEY
from sweeper.files import remove_stale_temps, write_text_atomic
from sweeper.sweep.preflight import resumable_state
from sweeper.sweep.state import STATE_NAME
from sweeper.text import mask_secrets
from sweeper.train.run_checkpoint import CHECKPOINT_DIR, check_new_run_dir, check_resumable_run

RESULT = "result.json"  # a single run's record
LOCK_NAME = ".sweeper.lock"  # held (flock) by the one process that writes in a run dir
# what marks a dir as one of sweeper's runs: a non-empty dir with none of them is someone else's
OWN_MARKS = (LOCK_NAME, ".hydra", STATE_NAME, RESULT, CHECKPOINT_DIR)
_HELD: dict[str, int] = {}  # run dir -> the open lock file: the lock lives as the process does


def check_run_dir(run_dir: str, key: str = "hydra.run.dir") -> None:
    """hydra.run.dir (or `key`) as given: a directory there, or one that can be made there."""
    if not run_dir.strip():  # Hydra would run in the working directory, over its files
        raise ConfigError(f"{key} is empty; name a directory for the run's files")
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"{key}={run_dir} is a file, not a directory")
    ancestor = os.path.dirname(os.path.abspath(run_dir))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{key}={run_dir} cannot be made: {ancestor} is a file")
    if not os.path.isdir(run_dir) and not can_make_a_dir_in(ancestor):
        raise ConfigError(f"{key}={run_dir} cannot be made: {ancestor} is not writable")
    if os.path.isdir(run_dir) and not can_make_a_dir_in(run_dir):
        raise ConfigError(f"{key}={run_dir} is not writable; choose another {key}")


def can_make_a_dir_in(parent: str) -> bool:
    """Whether a directory can be made in `parent`, by making one and removing it: the
    permission bits (os.access) pass for root where the kernel still refuses (/sys, /proc,
    read-only mounts), and Hydra's own mkdir then fails with a traceback."""
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent))
    except OSError:
        return False
    return True


def check_dir_contents(job, run_dir: str | None) -> None:
    """What `run_dir` (None: Hydra's default, a new dir each time) holds, for `job`."""
    sweep = job.plan is not None
    resume_sweep = sweep and job.plan.spec.resume
    resume_run = job.run is not None and job.run.trainer.resume
    if (resume_sweep or resume_run) and not run_dir:  # Hydra would make a new, empty dir
        what = "sweep" if sweep else "run"
        raise ConfigError(
            f"{'sweep' if sweep else 'trainer'}.resume=true continues the {what} in the run "
            f"dir it names: add hydra.run.dir=<the interrupted {what}'s dir> (its path is in "
            "the line it printed when it stopped)"
        )
    if not run_dir:
        return
    if resume_run:
        check_resumable_run(run_dir, job.run.to_dict())
        return
    if resume_sweep:
        if not os.path.isdir(run_dir):  # a mistyped path: a whole new sweep would start
            raise ConfigError(
                f"sweep.resume=true: hydra.run.dir={run_dir} does not exist, so holds no "
                "sweep to resume; name the interrupted sweep's dir"
            )
        # refused here, before Hydra rewrites the dir's .hydra/ files as the job starts
        found = resumable_state(Path(run_dir).resolve(), job.plan)
        if found is None and (Path(run_dir) / RESULT).exists():
            raise ConfigError(
                f"sweep.resume=true: hydra.run.dir={run_dir} holds a single run "
                f"({RESULT}), not a sweep; name the interrupted sweep's dir"
            )
        return
    if not sweep:
        check_new_run_dir(run_dir)
    check_nothing_written_over(run_dir, sweep)


def check_nothing_written_over(run_dir: str, sweep: bool) -> None:
    """A new sweep or run in `run_dir` would write over an old sweep's state (and with it
    the way to resume it) or a single run's record."""
    if (Path(run_dir) / STATE_NAME).exists():
        what = "continue it with sweep.resume=true, or " if sweep else ""
        raise ConfigError(
            f"hydra.run.dir={run_dir} holds a sweep already ({STATE_NAME}): "
            f"{what}choose another hydra.run.dir"
        )
    if (Path(run_dir) / RESULT).exists():
        raise ConfigError(
            f"hydra.run.dir={run_dir} holds a run already ({RESULT}): a new "
            f"{'sweep' if sweep else 'run'} there would write over its record; "
            "choose another hydra.run.dir"
        )


def check_multirun_dir(sweep_dir, overrides: list[str]) -> None:
    """hydra.sweep.dir as a -m command sets it: an earlier multirun's dir would have its
    jobs' records (result.json, a sweep's state, .hydra/) written over, job by job. Hydra's
    default dir is new each time (it holds the time); a resumed job goes on from its own."""
    if sweep_dir is None:
        return
    sweep_dir = str(sweep_dir)
    check_run_dir(sweep_dir, key="hydra.sweep.dir")
    resumes = any(
        o.lstrip("+").split("=")[0] in ("sweep.resume", "trainer.resume")
        and o.split("=", 1)[1].lower() == "true"
        for o in overrides
    )
    earlier = Path(sweep_dir) / "multirun.yaml"  # what Hydra writes there first
    if earlier.exists() and not resumes:
        raise ConfigError(
            f"hydra.sweep.dir={sweep_dir} holds an earlier multirun ({earlier.name}): its "
            "jobs' records would be written over; choose another hydra.sweep.dir"
        )


def check_not_in_use(run_dir: str, key: str = "hydra.run.dir") -> None:
    """Another process writing in `run_dir` (it holds the dir's lock): refused, naming it."""
    lock = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return  # no lock file: no sweeper process has taken the dir
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # fails while another holds it
    except BlockingIOError:
        raise in_use(run_dir, key, fd) from None
    finally:
        os.close(fd)  # closing releases a shared lock taken just to test


def in_use(run_dir: str, key: str, fd: int) -> ConfigError:
    """The error for a dir whose lock another process holds, naming it (the lock file's
    line)."""
    os.lseek(fd, 0, os.SEEK_SET)
    holder = " ".join(os.read(fd, 4096).decode(errors="replace").split()) or "another process"
    return ConfigError(
        f"{key}={run_dir} is in use by {holder}; wait for it to end, or choose another {key}"
    )


def take_run_dir(run_dir: str, key: str = "hydra.run.dir") -> None:
    """Make `run_dir` and hold its lock until this process ends; a second process on the
    same dir stops at `check_not_in_use` or here. What a killed writer left half-written
    there is removed."""
    run_dir = os.path.abspath(run_dir)
    if run_dir in _HELD:
        return
    os.makedirs(run_dir, exist_ok=True)
    fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        error = in_use(run_dir, key, fd)
        os.close(fd)
        raise error from None
    os.ftruncate(fd, 0)
    command = shlex.join([os.path.basename(sys.executable), *sys.orig_argv[1:]])
    command = mask_secrets(" ".join(command.split()))[:300]
    os.write(fd, f"pid {os.getpid()} ({command})\n".encode())
    _HELD[run_dir] = fd
    remove_stale_temps(run_dir)


def mask_hydra_records(run_dir: str) -> None:
    """Hydra's record of the command in the run dir (.hydra/*.yaml), a URI's password
    masked like every other file there."""
    for path in Path(run_dir, ".hydra").glob("*.yaml"):
        text = path.read_text()
        if (masked := mask_secrets(text)) != text:
            write_text_atomic(path, masked)


def new_default_dir(root: str) -> str:
    """Hydra's default dir, `root/DATE/HH-MM-SS`, made here and so this command's alone: a
    command started in the same second gets `HH-MM-SS-2` (mkdir fails where one exists)."""
    now = time.localtime()
    day, second = time.strftime("%Y-%m-%d", now), time.strftime("%H-%M-%S", now)
    os.makedirs(os.path.join(root, day), exist_ok=True)
    for number in range(1, 10_000):
        path = os.path.join(root, day, second if number == 1 else f"{second}-{number}")
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path
    raise ConfigError(f"{root}/{day}: no free dir for {second}; set hydra.run.dir")


def check_not_foreign(run_dir: str, allowed: bool, key: str = "hydra.run.dir") -> None:
    """A non-empty dir that is not one of sweeper's runs (a project's folder, a home dir):
    the run's files would be mixed into it, unless the user says that is what they want."""
    if allowed or not os.path.isdir(run_dir):
        return
    entries = os.listdir(run_dir)
    if entries and not any(mark in entries for mark in OWN_MARKS):
        shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConfigError(
            f"{key}={run_dir} holds files that are not a sweeper run ({shown}): choose an "
            f"empty or new dir, or add {NONEMPTY_DIR_KEY}=true to write there anyway"
        )
