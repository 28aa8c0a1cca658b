"""The config tree composes in every combination; bad input is one line, exit 2, no files."""

import dataclasses
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from sweeper.config.compose import compose, other_budgets_cleared
from sweeper.config.errors import ConfigError
from sweeper.config.paths import config_dir
from sweeper.config.schema import load_run_config

from .conftest import REPO, plan_of, run_cli, run_cli_into_closed_pipe, run_main

GROUPS = ["model", "optimizer", "scheduler", "data", "trainer"]


def _options(group):
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "override", [f"{g}={o}" for g in GROUPS for o in _options(g) if (g, o) != ("data", "shards")]
)
def test_every_group_option_composes_and_validates(override):
    # the GPU-sized models come with the GPU trainer (their sequences exceed the CPU batch)
    extra = ["trainer=gpu"] if override in ("model=d12", "model=d20") else []
    cfg = load_run_config(compose([override, *extra]))
    assert cfg.model.vocab_size == 256


def test_shards_option_composes_with_a_path(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\0\0" * 100)
    cfg = load_run_config(compose(["data=shards", f"data.path={tmp_path}/*.bin"]))
    assert cfg.data.name == "shards" and cfg.model.vocab_size == 50304


def test_every_yaml_key_is_commented_for_a_first_time_reader():
    for path in config_dir().rglob("*.yaml"):
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        assert lines[0].startswith("#"), f"{path} has no header comment"


def test_help_names_the_program_its_commands_and_the_config_groups(tmp_path):
    proc = run_cli(["--help"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sweeper: hyperparameter sweeps for GPT pretraining")
    assert "__main__" not in proc.stdout  # Hydra's default names the app by its module
    commands = (
        "python -m sweeper +sweep=lr_bs",
        "sweep.dry_run=true",
        "sweeper.fit",
        "sweeper.compare",
    )
    for command in commands:
        assert command in proc.stdout, command
    assert "sweep: full, lr, lr_bs, lr_bs_scaling, lr_scaling, scaling, smoke" in proc.stdout
    # the header's own list of sweeps names every file in sweeps/
    head = proc.stdout.split("any key below")[0]
    head = head.replace(",", " ").replace(")", " ").replace("=", " ").split()
    for path in (REPO / "sweeps").glob("*.yaml"):
        assert path.stem in head, path.stem
    assert "matrix_lr: 0.02" in proc.stdout  # the composed config follows
    assert list(tmp_path.iterdir()) == []


def test_hydra_s_short_flags_work_as_its_long_ones(tmp_path):
    """Hydra's --hydra-help names `-sc install=bash`, and the script it installs calls
    `-sc query=bash` at every <TAB>: the short forms must not be read as overrides."""
    env = {"COMP_LINE": "sweeper mod"}
    for flag in ("-sc", "--shell-completion"):
        proc = run_cli([flag, "query=bash"], cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["model.", "model="]
    proc = run_cli(["--version"], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("Hydra "), proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", [["-cn", "mine"], ["--config-dir=my_conf"], ["-cp", "x"]])
def test_another_primary_config_is_refused_with_the_way_to_add_configs(tmp_path, flag):
    proc = run_cli([*flag, "model=tiny"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: sweeper composes its own conf/")
    assert "hydra.searchpath=[file://DIR]" in proc.stderr and proc.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag_first", [False, True])
def test_cfg_after_a_budget_override_prints_the_run_s_budget(tmp_path, flag_first):
    """A budget named on the command line clears the preset's (other_budgets_cleared);
    those overrides go beside the user's, so `--cfg job` may come last, as the README's
    reproduce lines invite."""
    args = ["trainer.max_steps=100", "model.depth=3"]
    proc = run_cli(["--cfg", "job", *args] if flag_first else [*args, "--cfg", "job"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "  max_steps: 100\n" in proc.stdout and "  budget_tokens: null\n" in proc.stdout
    assert "  depth: 3\n" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job"]])
def test_printing_into_a_closed_pipe_ends_quietly(tmp_path, args):
    """`python -m sweeper --help | head -1`: ended by SIGPIPE as `cat` would be, without
    a BrokenPipeError traceback."""
    proc = run_cli_into_closed_pipe(args, cwd=tmp_path)
    assert proc.returncode == -signal.SIGPIPE, proc.stderr
    assert proc.stderr == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", [["--cfg", "job"], ["-c", "job"]])
def test_cfg_prints_the_composed_config_and_writes_nothing(tmp_path, flag):
    proc = run_cli([*flag, "model.depth=3"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "model:\n  depth: 3\n" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_defaults_match_the_schema_defaults():
    # the dataclass defaults document the same run as conf/: drift would mislead readers
    from sweeper.config.schema import RunConfig

    composed = load_run_config(compose([])).to_dict()
    schema = RunConfig().to_dict()
    for section in ("optimizer", "scheduler", "trainer"):
        assert composed[section] == schema[section], section


BAD_INPUTS = [
    (["model.depth=0"], "model.depth"),
    (["model.depth=abc"], "model.depth"),
    (["model.seq_len=1.5"], "model.seq_len"),
    (["optimizer.matrix_lr=0"], "optimizer.matrix_lr"),
    (["optimizer.embedding_lr=-1"], "optimizer.embedding_lr"),
    (["optimizer=adamw", "optimizer.lr=0"], "optimizer.lr"),
    (["trainer.total_batch_size=1000"], "= 4096, got 1000"),  # no micro-batch makes 1000
    # 20 sequences of 256: 10 is the largest micro-batch up to 16 that divides them
    (["trainer.total_batch_size=5120"], "got 5120; trainer.device_batch_size=10 makes it one"),
    (["trainer.device_batch_size=0"], "trainer.device_batch_size"),
    (["data.name=wikipedia"], "data.name"),
    (["data=wikipedia"], "data"),
    (["data=shards", "data.path=/nonexistent/*.bin"], "data.path"),
    (["trainer.device=tpu"], "trainer.device"),
    (["trainer.dtype=fp8"], "trainer.dtype"),
    (["foo.bar=1"], "foo"),
    (["+model.foo=1"], "foo"),
    (["trainer.budget_tokens=null"], "trainer.max_steps"),
    (["trainer.max_steps=5", "trainer.budget_tokens=8192"], "exactly one"),
    # a sweep writes its own budget into every trial: a trainer one would vanish unseen
    (["+sweep=smoke", "trainer.max_steps=10"], "trainer.max_steps=10: a sweep gives every"),
    (["scheduler.warmup_ratio=1.5"], "scheduler.warmup_ratio"),
    (["model.head_dim=48"], "model.head_dim"),
    (["trainer.max_loss_patience=0"], "trainer.max_loss_patience"),
    (["scheduler.warmup_frac=0.1"], "did you mean scheduler.warmup_ratio?"),
    (["trainer.max_step=3"], "did you mean trainer.max_steps?"),
    (["sweep.name=x"], "choose one first with +sweep=NAME"),
    (["sweep=smoke"], "A sweep is added, not overridden: write +sweep=smoke"),
    (["model.depth=[1"], "cannot parse override 'model.depth=[1'"),
    (["model"], "cannot parse override 'model': missing EQUAL"),
    (["--foo"], "unrecognized arguments: --foo (python -m sweeper --help)"),
    (["-m", "model.depth=1,2", "--foo"], "unrecognized arguments: --foo"),  # before any job
    (
        ["+sweep=lr_bs", "sweep.stages.5.scheduler=fifo"],
        "list index out of range (the list is shorter: its items count from 0)",
    ),
    # inf passes every "> 0" check; it would fail deep inside training
    (["trainer.budget_tokens=inf"], "trainer.budget_tokens must be a finite number, got inf"),
    (["optimizer.weight_decay=inf"], "optimizer.weight_decay must be a finite number"),
    (
        ["optimizer.weight_decay_schedule=cosine"],
        "optimizer.weight_decay_schedule must be one of constant, linear, got 'cosine'",
    ),
    (["trainer.seed=-1"], "trainer.seed must be in [0, 2^64), got -1"),
    # a budget under one optimizer step would train a whole step: many times the budget
    (["trainer.budget_tokens=100"], "trainer.budget_tokens=100, less than one optimizer step"),
    (
        ["trainer.budget_tokens=null", "trainer.budget_flops=1e9"],
        "trainer.budget_flops=1e+09 at 22,413,312 FLOPs per token is 45 tokens, less than one",
    ),
    (
        ["trainer.budget_tokens=null", "trainer.tokens_per_param=0.001"],
        "trainer.tokens_per_param=0.001 x 3,276,808 parameters is 3,277 tokens, less than one",
    ),
    # the platform's own sections are typed as well
    (["+foo=1"], "unknown config key: foo"),
    (["+ray.adress=auto"], "did you mean ray.address?"),
    (["ray.dashboard_port=99999"], "ray.dashboard_port must be in [1, 65535], got 99999"),
    (["mlflow.enabled=maybe"], "mlflow.enabled"),
    (["fit.bootstrap=-5"], "fit.bootstrap must be >= 0"),
    (["trainer.workers=3", "trainer.total_batch_size=12288"], "need 3 CPUs, but the local"),
    # a resume without the run dir would start a new sweep in a new timestamped dir
    (["+sweep=smoke", "sweep.resume=true"], "sweep.resume=true continues the sweep in the run"),
    # what only a sweep uses is still checked in a single run
    (["trainable._target_=nonexistent.fn"], "trainable._target_=nonexistent.fn cannot be"),
    (["mlflow.tracking_uri=foo://bar"], "mlflow.tracking_uri=foo://bar: MLflow has no store"),
    # found by a fresh review's bad-input hunt: each was a traceback, or ran and failed late
    (["model.depth=${nothere}"], "model.depth: Interpolation key 'nothere' not found"),
    (["trainable=null"], "trainable=null: trainable is a section"),
    (["ray=null"], "ray=null: ray is a section"),
    (["+sweep=smoke", "fit=null"], "fit=null: fit is a section"),
    (["trainable._target_="], "trainable._target_=: name a function"),
    (["hydra.run.dir="], "hydra.run.dir is empty"),
    (["data.bytes_per_token=2.0"], "data.bytes_per_token must be 1 for the byte-level"),
    (["+sweep=smoke", "sweep.stages.0.name=a/b"], "sweep.stages.0.name='a/b': a stage's"),
    (["mlflow.tracking_uri=sqlite:///"], "mlflow.tracking_uri=sqlite:/// names no database"),
    (["mlflow.tracking_uri=plain/dir"], "MLflow's file store is retired"),
    (["ray.num_gpus=0.5"], "ray.num_gpus must be a whole number"),
    (["data.val_every_n_files=1000000000"], "leaves 0 bytes for validation, fewer than"),
    (["trainer.seed=18446744073709551616"], "trainer.seed must be in [0, 2^64)"),
    (["+sweep=smoke", "ray.dashboard_host=not-a-host"], "ray.dashboard_host=not-a-host: cannot"),
    (["+sweep=smoke", "ray.dashboard_host=192.0.2.1"], "ray.dashboard_host=192.0.2.1: cannot"),
    (["+sweep=smoke", "ray.num_cpus=1e9"], "ray.num_cpus=1e+09 for a local cluster on a machine"),
    # a model whose weights alone cannot fit was built, then failed with batch-size advice
    # (or an overflow inside torch, or the system's OOM killer)
    (["model.depth=1000"], "model.depth=1000 (d_model 64000) has 49,152.0B parameters, whose"),
    (["model.depth=100000"], "has 4.92e+10B parameters"),
    # the same for a sweep's trials on the local cluster: its base model, or a stage's value
    (["+sweep=smoke", "model.depth=1000"], "model.depth=1000 (d_model 32000) has"),
    (
        ["+sweep=smoke", "+sweep.stages.1.params.model.depth.grid=[2,1000]"],
        "sweep stage 'batch_size': model.depth=1000 (grid) is not a valid run: model.depth=1000",
    ),
    # found by a new user's bad-input hunt: each ran, and the value changed nothing
    (["optimizer=adamw", "optimizer.matrix_lr=0.01"], "optimizer=adamw does not read optimizer."),
    (["optimizer.lr=0.01"], "optimizer=muon_adamw does not read optimizer.lr (its LR keys: "),
    (
        ["+sweep=lr", "optimizer=adamw"],
        "sweep.stages.0.params.optimizer.matrix_lr: optimizer=adamw does not read",
    ),
    (["data.path=train.bin"], "data.path=train.bin: the stdlib corpus reads no files of yours"),
    (["hydra.job.chdir=true"], "hydra.job.chdir=true: sweeper writes into the run dir itself"),
    # a sweep sets every trial's evaluations itself: these were accepted and changed nothing
    (["+sweep=lr", "trainer.num_evals=3"], "trainer.num_evals=3: a sweep's trials evaluate"),
    (["+sweep=lr_bs", "trainer.eval_every=5"], "sweep.reports_per_trial times, or a stage's"),
    (["--cfg", "nope"], "argument --cfg/-c: invalid choice: 'nope'"),
    (["model=tiny", "--cfg"], "argument --cfg/-c: expected one argument"),
    # Hydra's three readings of a,b come on three more lines: all in the one line
    (["optimizer.matrix_lr=0.01,0.03"], "key=[a,b], for a string key='a,b', and to run once"),
    # Hydra would warn in two lines and go on without it: the missing dir is the error
    (
        ["hydra.searchpath=[file:///nonexistent]", "+sweep=mine"],
        "hydra.searchpath: no config dir at /nonexistent",
    ),
]


@pytest.mark.parametrize("args, names", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, names):
    proc = run_main(args, cwd=tmp_path)  # the CLI's own process: test_the_cli_* below
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert names in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert list(tmp_path.iterdir()) == [], "bad input must write nothing"


@pytest.mark.parametrize(
    ("args", "names"), [(["model.depth=0"], "model.depth"), (["+sweep=smoke", "--foo"], "--foo")]
)
def test_the_cli_refuses_bad_input_in_one_line_exit_2_writing_nothing(tmp_path, args, names):
    """The table above runs the command in-process; here, the real `python -m sweeper`."""
    proc = run_cli(args, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []


def test_a_sweep_refuses_a_model_that_fits_once_but_not_as_often_as_trials_run_at_once(
    tmp_path,
):
    from sweeper.sweep.preflight import build_plan
    from sweeper.train.budget import TRAINING_BYTES_PER_PARAM, memory_bytes
    from sweeper.train.model import GPTShape

    # the shallowest model whose training state fits this machine's memory once, not twice
    have = memory_bytes(torch.device("cpu"))

    def fits_once_not_twice(preset: list[str]) -> int:
        model = load_run_config(compose(preset)).model
        for depth in range(1, 1000):
            shape = GPTShape.from_config(dataclasses.replace(model, depth=depth))
            need = shape.n_params * TRAINING_BYTES_PER_PARAM
            if 2 * need > have:
                assert need <= have
                return depth
        raise AssertionError("no depth up to 1000 needs half this machine's memory")

    depth = fits_once_not_twice(["model=tiny"])
    args = ["+sweep=smoke", f"model.depth={depth}", "ray.num_cpus=2"]
    proc = run_cli(args, cwd=tmp_path, timeout=60)
    _assert_clean_failure(proc, tmp_path, "2 trials at once need")
    assert "1 fits (sweep.concurrency=1), or choose a smaller model" in proc.stderr
    # one trial at a time fits: the sweep passes its checks
    build_plan(compose([*args, "sweep.concurrency=1"]))
    # a single run's DDP ranks on CPU each hold a copy too
    depth = fits_once_not_twice([])
    proc = run_cli([f"model.depth={depth}", "trainer.workers=2"], cwd=tmp_path, timeout=60)
    _assert_clean_failure(proc, tmp_path, "2 DDP ranks need")
    assert "1 fits (trainer.workers=1), or choose a smaller model" in proc.stderr


@pytest.mark.parametrize(
    "overrides, device, copies, fewer",
    [
        (["ray.num_cpus=8"], "cpu", 8, "sweep.concurrency=3"),
        (["ray.num_cpus=8", "sweep.concurrency=2"], "cpu", 2, "sweep.concurrency=3"),
        (["ray.num_cpus=8", "sweep.cpus_per_trial=4"], "cpu", 2, "sweep.concurrency=3"),
        (["ray.num_cpus=8", "trainer.workers=2"], "cpu", 8, None),
        # GPU trials: those packed onto one GPU share it, whatever the CPUs allow
        (["ray.num_cpus=8", "ray.num_gpus=1", "sweep.gpus_per_trial=0.25"], "cuda", 4, "0.333"),
        (["ray.num_cpus=8", "ray.num_gpus=2", "sweep.gpus_per_trial=1"], "cuda", 1, "0.333"),
        (["ray.num_cpus=2", "ray.num_gpus=1", "sweep.gpus_per_trial=0.25"], "cuda", 2, "0.333"),
    ],
)
def test_the_trials_sharing_a_device_are_counted_from_the_cluster_and_the_sweep(
    overrides, device, copies, fewer, monkeypatch
):
    from sweeper.sweep.feasibility import local_trial_memory

    plan = plan_of(["+sweep=smoke", *overrides])
    if device == "cuda":  # where trials go is all that is asked of torch here
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    memory = local_trial_memory(plan)
    assert (memory.device.type, memory.copies) == (device, copies)
    if fewer is None:
        assert memory.fewer is None
    else:
        assert fewer in memory.fewer(3)
    joined = dataclasses.replace(plan, ray={**plan.ray, "address": "auto"})
    assert local_trial_memory(joined) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there: cuda is valid")
def test_cuda_on_a_machine_without_one_is_one_line(tmp_path):
    proc = run_cli(["trainer.device=cuda"], cwd=tmp_path, timeout=60)
    _assert_clean_failure(proc, tmp_path, "trainer.device=cuda but torch sees no CUDA device")


@pytest.mark.parametrize("values", ["1,0", "range(0,2)"])
def test_a_multirun_jobs_bad_value_is_one_line_before_anything_runs(tmp_path, values):
    # -m overrides hold Hydra sweep syntax: each job Hydra would launch is checked first
    args = ["-m", f"model.depth={values}", "trainer.max_steps=2", "trainer.budget_tokens=null"]
    proc = run_cli(args, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["error: model.depth must be >= 1, got 0"]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == [], "the good job must not have run either"


def test_a_multirun_glob_lists_the_config_groups_options():
    from sweeper.command import multirun_jobs

    # glob() needs Hydra's config loader to list model/'s files (it was "ConfigLoader is
    # not set"); the jobs are the group's options matching it, crossed with the other sweep
    jobs = multirun_jobs(["model=glob(*,exclude=d*)", "model.depth=1,2"])
    assert sorted(jobs) == [
        [f"model={name}", f"model.depth={depth}"] for name in ("small", "tiny") for depth in (1, 2)
    ]
    assert multirun_jobs(["model=glob(t*)"]) == [["model=tiny"]]


def test_a_multirun_glob_that_matches_nothing_is_one_line(tmp_path):
    proc = run_cli(["-m", "model=glob(zz*)", "trainer.max_steps=2"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: model=glob(zz*): sweeps over no value, so no job would run"
    ]
    assert list(tmp_path.iterdir()) == []


def test_config_error_names_key_in_process():
    with pytest.raises(ConfigError, match="model.depth"):
        load_run_config({"model": {"depth": 0}})


BUDGETS_CLEARED = [
    # one budget named: the preset's others are cleared, whichever the preset set
    (["trainer.max_steps=5"], ["budget_tokens", "budget_flops", "tokens_per_param"]),
    (
        ["trainer=gpu", "trainer.budget_flops=1e15"],
        ["max_steps", "budget_tokens", "tokens_per_param"],
    ),
    (["-m", "trainer.max_steps=5,10"], ["budget_tokens", "budget_flops", "tokens_per_param"]),
    (["trainer.budget_tokens=null", "trainer.max_steps=5"], ["budget_flops", "tokens_per_param"]),
    # nothing chosen, or two: the command line is left as written (two are refused)
    (["model.depth=2"], []),
    (["trainer.budget_tokens=null"], []),
    (["trainer.max_steps=5", "trainer.budget_tokens=8192"], []),
    (["trainer.max_steps_x=5"], []),
]


@pytest.mark.parametrize("overrides, cleared", BUDGETS_CLEARED)
def test_one_budget_on_the_command_line_replaces_the_presets(overrides, cleared):
    assert other_budgets_cleared(overrides) == [f"trainer.{key}=null" for key in cleared]


def test_single_run_writes_result_json(tmp_path):
    args = [
        "model=tiny",
        "trainer.max_steps=4",  # in place of the cpu preset's budget_tokens
        "trainer.total_batch_size=512",
        "trainer.device_batch_size=8",
        "trainer.eval_every=2",
        "trainer.eval_tokens=1024",
        f"hydra.run.dir={tmp_path}/run",
    ]
    proc = run_cli(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "completed" and result["steps"] == 4
    assert result["mfu"] is None and result["device"] == "cpu" and result["workers"] == 1
    assert "val bpb" in proc.stdout  # progress was printed
    # and drawn: the loss as it trained, beside its LR schedule
    assert proc.stdout.strip().splitlines()[-1].endswith("/run/result.json, curves.png")
    assert (tmp_path / "run" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "signame, background",
    # Ctrl+C; kill, docker stop; kill of a run a script or `nohup ... &` started, which a
    # shell without job control starts with SIGINT ignored
    [("SIGINT", False), ("SIGTERM", False), ("SIGTERM", True)],
)
def test_an_interrupted_run_leaves_a_failed_result_json(tmp_path, signame, background):
    import signal

    def as_a_background_job():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    args = [
        "model=tiny",
        "trainer.max_steps=100000",
        "trainer.budget_tokens=null",
        "trainer.total_batch_size=512",
        "trainer.device_batch_size=8",
        "trainer.log_every=1",
        f"hydra.run.dir={tmp_path}/run",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), PYTHONUNBUFFERED="1")
    with subprocess.Popen(
        [sys.executable, "-m", "sweeper", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_a_background_job if background else None,
    ) as proc:
        for line in proc.stdout:  # training has started once a step's line is printed
            if line.startswith("step"):
                break
        proc.send_signal(getattr(signal, signame))
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()  # the signal was lost: the run would train on
            raise
    assert proc.returncode == 130, err[-2000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result == {"status": "failed", "error": "interrupted (Ctrl+C, or SIGTERM from kill)"}
    assert err.strip().splitlines()[-1].startswith("interrupted: status failed ->"), err
    assert "Traceback" not in err


def _assert_clean_failure(proc, tmp_path, names, keep=()):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep), "nothing may be written"


def test_a_micro_batch_too_big_for_memory_is_one_line_and_a_failed_result(tmp_path):
    # 100,000 x 256 tokens: the embedding's output alone is 24.4 GiB, over the 8 GiB of
    # address space given here (and over this machine's memory), so the allocation fails
    batch = ["trainer.device_batch_size=100000", "trainer.total_batch_size=25600000"]
    batch += ["trainer.budget_tokens=25600000"]  # one step: less is refused up front
    proc = run_cli([*batch, "hydra.run.dir=run"], cwd=tmp_path, memory_limit=8 * 2**30)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("error: out of memory (asked for 24.4 GiB more)"), lines[0]
    assert "trainer.device_batch_size=100000" in lines[0]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "failed" and "allocate" in result["error"]


def test_corrupt_shard_is_named_before_anything_runs(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, 5000]  # claims 5000 tokens ...
    (data / "train_000.bin").write_bytes(header.tobytes() + np.zeros(10, np.uint16).tobytes())
    proc = run_cli(["data=shards", f"data.path={data}/*.bin"], cwd=tmp_path, timeout=60)
    _assert_clean_failure(proc, tmp_path, "train_000.bin", keep=["data"])


@pytest.mark.parametrize(
    "tokens, args, names",
    [
        (np.full(20_000, 300), ["data.vocab_size=256"], "token id 300 >= data.vocab_size 256"),
        (np.arange(100), [], "too small to hold out validation"),
        (
            (np.arange(20_000) % 255 + 1).astype(np.int32),
            [],
            "looks like 32-bit ints (every second 16-bit word is 0)",
        ),
    ],
    ids=["id over the vocabulary", "too small", "int32 ids"],
)
def test_shard_contents_are_checked_before_the_run_dir_is_made(tmp_path, tokens, args, names):
    # once the run dir exists, Hydra has rewritten its .hydra/: a resume must not get there
    (tmp_path / "data").mkdir()
    tokens = tokens if tokens.dtype == np.int32 else tokens.astype(np.uint16)
    tokens.tofile(tmp_path / "data" / "train_000.bin")
    proc = run_cli(
        ["data=shards", f"data.path={tmp_path}/data/*.bin", *args], cwd=tmp_path, timeout=60
    )
    _assert_clean_failure(proc, tmp_path, names, keep=["data"])


def test_a_validation_shard_shorter_than_one_window_is_named(tmp_path):
    (tmp_path / "data").mkdir()
    np.arange(20_000).astype(np.uint16).tofile(tmp_path / "data" / "train_000.bin")
    np.arange(10).astype(np.uint16).tofile(tmp_path / "data" / "val.bin")
    args = [f"data.path={tmp_path}/data/train_*.bin", f"data.val_path={tmp_path}/data/val.bin"]
    proc = run_cli(["data=shards", "data.vocab_size=20000", *args], cwd=tmp_path, timeout=60)
    names = "val.bin holds 10 tokens, fewer than model.seq_len + 1 = 257"
    _assert_clean_failure(proc, tmp_path, names, keep=["data"])


def test_a_directory_as_a_shard_is_named_before_anything_runs(tmp_path):
    (tmp_path / "data").mkdir()
    proc = run_cli(["data=shards", f"data.path={tmp_path}/data"], cwd=tmp_path, timeout=60)
    _assert_clean_failure(proc, tmp_path, "is not a file", keep=["data"])


def test_a_run_dir_that_is_a_file_is_named_and_kept(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = run_cli([f"hydra.run.dir={tmp_path}/notes.txt"], cwd=tmp_path, timeout=60)
    _assert_clean_failure(proc, tmp_path, "notes.txt is a file", keep=["notes.txt"])
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_sweep_file_with_a_syntax_error_is_one_line(tmp_path):
    mine = tmp_path / "mine" / "sweep"
    mine.mkdir(parents=True)
    (mine / "broken.yaml").write_text("sweep:\n  name: broken\n  stages: [\n")
    proc = run_cli(
        [f"hydra.searchpath=[file://{tmp_path}/mine]", "+sweep=broken"], cwd=tmp_path, timeout=60
    )
    _assert_clean_failure(proc, tmp_path, "broken", keep=["mine"])


@pytest.mark.parametrize(
    "text, names",
    [
        ("- a\n- b\n", "sweep: a sweep file holds a mapping of keys (name, stages, ...), got list"),
        (  # stages as a mapping over the base's list: Hydra's reason is on its next line
            "# @package _global_\ndefaults:\n  - /sweep_base@sweep: default\nsweep:\n"
            "  stages:\n    lr: {num_samples: 2}\n",
            "raised while composing config: Cannot merge DictConfig with ListConfig",
        ),
    ],
)
def test_a_sweep_file_of_the_wrong_shape_is_one_line(tmp_path, text, names):
    mine = tmp_path / "mine" / "sweep"
    mine.mkdir(parents=True)
    (mine / "odd.yaml").write_text(text)
    proc = run_cli([f"hydra.searchpath=[file://{tmp_path}/mine]", "+sweep=odd"], tmp_path)
    _assert_clean_failure(proc, tmp_path, names, keep=["mine"])


def test_a_users_own_sweep_file_is_found_through_the_search_path(tmp_path):
    from sweeper.config.compose import compose as compose_api

    mine = tmp_path / "sweep"
    mine.mkdir()
    (mine / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /sweep_base@sweep: default\n"
        "sweep:\n  name: mine\n  budget: {tokens_per_trial: 1000}\n"
        "  stages:\n    - name: wd\n      params:\n"
        "        optimizer: {weight_decay: {uniform: [0.0, 0.2]}}\n"
    )
    cfg = compose_api([f"hydra.searchpath=[file://{tmp_path}]", "+sweep=mine"])
    assert cfg.sweep.name == "mine" and cfg.sweep.stages[0].params.optimizer.weight_decay


def test_unreachable_ray_address_is_one_line_within_seconds(tmp_path):
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    proc = run_cli(["+sweep=smoke", f"ray.address=127.0.0.1:{port}"], cwd=tmp_path, timeout=60)
    assert time.monotonic() - start < 30
    _assert_clean_failure(proc, tmp_path, "ray.address")


@pytest.mark.parametrize(
    "content, reason",
    [('{"name": "lr"', "Expecting"), ("[1, 2]", "a JSON list"), ('{"name": "lr"}', "'base'")],
)
def test_a_sweep_state_that_cannot_be_read_is_one_line_and_left_alone(tmp_path, content, reason):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "sweep_state.json").write_text(content)
    proc = run_cli(["+sweep=smoke", "sweep.resume=true", f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {run_dir}/sweep_state.json is not a sweep state sweeper")
    assert reason in line and "another hydra.run.dir" in line
    assert [p.name for p in run_dir.iterdir()] == ["sweep_state.json"]
    assert (run_dir / "sweep_state.json").read_text() == content


def test_a_run_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    proc = run_cli(["trainer.max_steps=2", f"hydra.run.dir={tmp_path}/afile/run"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: hydra.run.dir={tmp_path}/afile/run cannot be made: {tmp_path}/afile is a file\n"
    )


def test_a_run_dir_the_kernel_refuses_is_one_line_even_for_root(tmp_path):
    # /proc refuses a new directory whatever the permission bits say (they pass for root)
    proc = run_cli(["trainer.max_steps=2", "hydra.run.dir=/proc/sweeper-run"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (
        "error: hydra.run.dir=/proc/sweeper-run cannot be made: /proc is not writable\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_multirun_into_an_earlier_multiruns_dir_is_refused_and_its_records_kept(tmp_path):
    job = ["-m", "model=tiny", "trainer.max_steps=2", "mlflow.enabled=false"]
    job += ["trainer.budget_tokens=null", "hydra.sweep.dir=mr"]
    first = run_cli([*job, "optimizer.matrix_lr=0.01,0.02"], cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    records = {p: p.read_bytes() for p in (tmp_path / "mr").rglob("*") if p.is_file()}
    assert tmp_path / "mr" / "0" / "result.json" in records

    again = run_cli([*job, "optimizer.matrix_lr=0.03"], cwd=tmp_path, timeout=120)
    assert again.returncode == 2, again.stderr[-2000:]
    assert again.stderr == (
        "error: hydra.sweep.dir=mr holds an earlier multirun (multirun.yaml): its jobs' "
        "records would be written over; choose another hydra.sweep.dir\n"
    )
    after = {p: p.read_bytes() for p in (tmp_path / "mr").rglob("*") if p.is_file()}
    assert after == records
