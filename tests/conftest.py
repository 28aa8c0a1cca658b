"""Shared fixtures: a tiny preset behind every fast test (torchtitan's `debugmodel` habit)
and the local Ray cluster of the in-process sweep tests."""

from __future__ import annotations

import contextlib
import copy
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

TINY = {
    "model": {"depth": 2, "aspect_ratio": 32, "head_dim": 32, "seq_len": 64},
    "trainer": {
        "device": "cpu",
        "device_batch_size": 8,
        "total_batch_size": 512,
        "max_steps": 10,
        "budget_tokens": None,
        "eval_every": 5,
        "eval_tokens": 2048,
        "log_every": 5,
        "threads": 1,
    },
}


def tiny(**sections) -> dict:
    """The tiny run config with per-section overrides: tiny(trainer={"max_steps": 3})."""
    cfg = copy.deepcopy(TINY)
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


@pytest.fixture
def tiny_config():
    return tiny


def run_cli(
    args: list[str],
    cwd: Path,
    timeout: float = 120,
    module: str = "sweeper",
    memory_limit: int | None = None,
    env: dict[str, str] | None = None,
):
    """`python -m <module> args` in `cwd`, like a user would; returns CompletedProcess.
    `memory_limit` (bytes of address space) makes the process a machine with that much;
    `env`: variables set on top of this one's. The tests' own functions
    (`trainable._target_=tests.X.fn`) import from any `cwd`."""
    env = dict(
        os.environ, **(env or {}), PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")])
    )
    env["RAY_USAGE_STATS_ENABLED"] = "0"

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))

    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit_memory if memory_limit else None,
    )


def run_cli_into_closed_pipe(args: list[str], cwd: Path, module: str = "sweeper"):
    """`python -m <module> args | head` once head has quit: stdout is a pipe nobody reads.
    Returns the CompletedProcess, stderr captured."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), RAY_USAGE_STATS_ENABLED="0")
    try:
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=cwd,
            env=env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)


# a sweep of a few seconds per trial: tiny model, tiny budget, tiny eval; the fit's
# bootstrap is left to the one sweep that checks it (test_compare.py's smoke sweep)
TINY_SWEEP = [
    "+sweep=smoke",
    "sweep.budget.tokens_per_trial=8192",
    "sweep.reports_per_trial=4",
    "trainer.eval_tokens=1024",
    "trainer.total_batch_size=512",
    "sweep.baseline=false",
    "fit.bootstrap=0",
]


@contextlib.contextmanager
def local_ray():
    """A fresh 2-CPU Ray cluster in this process; its workers import tests.* functions."""
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src")])
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    """One cluster per test module (test_ddp.py overrides it with one per test)."""
    with local_ray():
        yield


def plan_of(overrides: list[str]):
    """The checked plan of the sweep `overrides` compose, as `python -m sweeper` builds it."""
    from sweeper.config.compose import compose
    from sweeper.sweep.preflight import build_plan

    return build_plan(compose(overrides))


def plan_for(spec, base: dict | None = None, target: str | None = None):
    """A plan around a hand-made SweepSpec, for the helpers that derive from one."""
    from sweeper.sweep.plan import SweepPlan

    return SweepPlan(spec=spec, base=base or {}, target=target)


def run_main(args: list[str], cwd: Path):
    """`python -m sweeper args` in this process, for commands that stop before Hydra runs a
    job (bad input, dry runs): the same checks and output as the CLI, without a Python
    start-up and its imports each time. Returns what run_cli returns (returncode, stdout,
    stderr)."""
    import io
    import signal
    from types import SimpleNamespace

    from sweeper.__main__ import main

    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, here, sigterm = sys.argv, os.getcwd(), signal.getsignal(signal.SIGTERM)
    sys.argv = ["sweeper", *args]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.argv = argv
        os.chdir(here)
        signal.signal(signal.SIGTERM, sigterm)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
