"""What a command is checked for before Hydra starts it: the composed config as a sweep
plan or a run config, the run dir, the cluster and the MLflow store. Each mistake is one
line (a ConfigError), with nothing started or written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sweeper.config.compose import check_syntax, chosen_budgets, compose, hydra_setting
from sweeper.config.errors import ConfigError, one_line
from sweeper.config.paths import config_dir
from sweeper.config.schema import (
    NONEMPTY_DIR_KEY,
    RunConfig,
    check_optimizer_reads,
    check_platform_sections,
    load_run_config,
)
from sweeper.rundir import (
    check_dir_contents,
    check_multirun_dir,
    check_not_foreign,
    check_not_in_use,
    check_run_dir,
)
from sweeper.sweep.cluster import check_local_cluster, local_cluster_size, probe
from sweeper.sweep.estimate import PROBE_MAX_FLOPS, finished, measure_speed, plan_text
from sweeper.sweep.feasibility import slots_for
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.preflight import build_plan, resumable_state
from sweeper.text import flops_text, mask_secrets
from sweeper.tracking.mlflow_store import check_config_in_a_process, check_store
from sweeper.train.budget import check_budget, check_model_fits
from sweeper.user_function import load_user_function, trainable_target

# how often a run evaluates: in a sweep, sweep.reports_per_trial decides
EVAL_CADENCE_KEYS = ("trainer.num_evals", "trainer.eval_every")


@dataclass(frozen=True)
class Job:
    """A checked command: the composed config and what it runs, a sweep's plan or one run
    (sweeper's own training, `run`, or a user's function, `target`)."""

    cfg: Any
    plan: SweepPlan | None = None
    run: RunConfig | None = None
    target: str | None = None

    @property
    def dry_run(self) -> bool:
        return self.plan is not None and self.plan.spec.dry_run


def check(overrides: list[str], multirun: bool = False) -> Job:
    """Every check of the command `overrides` make, before Hydra starts it."""
    job = check_config(compose(overrides))
    if job.target is None:  # a user's function reads its optimizer section its way
        optimizer = job.run.optimizer.name if job.run else job.plan.base["optimizer"]["name"]
        for override in overrides:
            if not override.startswith("~"):  # removing a key sets nothing
                check_optimizer_reads(optimizer, override.split("=", 1)[0].lstrip("+"), override)
    if job.plan is not None:
        check_no_emptied_mapping(overrides)
    if job.plan is not None and job.target is None:
        check_sweep_overrides(overrides)
    check_chdir(overrides)
    if multirun:
        check_multirun_dir(hydra_setting(overrides, "hydra.sweep.dir"), overrides)
    else:
        run_dir = hydra_setting(overrides, "hydra.run.dir")
        if run_dir is not None:
            check_run_dir(str(run_dir))
            check_not_in_use(str(run_dir))
            check_not_foreign(str(run_dir), bool(job.cfg.get(NONEMPTY_DIR_KEY)))
        check_dir_contents(job, None if run_dir is None else str(run_dir))
    return job


def check_config(cfg) -> Job:
    """The composed config as the job it makes: a sweep's plan or one run's config."""
    from omegaconf import OmegaConf

    if "sweep" in cfg and not OmegaConf.is_dict(cfg.sweep):  # a sweep file that is a list
        got = type(OmegaConf.to_container(cfg.sweep)).__name__ if cfg.sweep is not None else "null"
        raise ConfigError(
            f"sweep: a sweep file holds a mapping of keys (name, stages, ...), got {got}"
        )
    check_platform_sections(cfg)
    run = load_run_config(cfg)
    target = trainable_target(cfg)
    if "sweep" in cfg and run.trainer.resume:
        raise ConfigError(
            "trainer.resume=true goes on with a single run; a sweep resumes with sweep.resume=true"
        )
    if run.trainer.resume and target:
        raise ConfigError(
            f"trainer.resume=true goes on with sweeper's own training, which "
            f"trainable._target_={target} replaces; it keeps no checkpoint of sweeper's"
        )
    joins = bool(cfg.get("ray", {}).get("address"))
    check_device(run, joins and "sweep" in cfg)
    check_data(run, target)
    if "sweep" not in cfg:
        check_single_run(cfg, run, target, joins)
        return Job(cfg, run=run, target=target)
    if joins:
        probe(str(cfg.ray.address))  # an unreachable cluster: one line, nothing written
    else:
        check_local_cluster(cfg.ray)
    plan = build_plan(cfg)
    check_store(cfg)  # an unreachable MLflow server: one line, nothing written
    return Job(cfg, plan=plan, target=target)


def check_device(run: RunConfig, elsewhere: bool) -> None:
    """trainer.device=cuda where the run trains here (not on a cluster's nodes)."""
    if run.trainer.device == "cuda" and not elsewhere:
        import torch

        if not torch.cuda.is_available():  # trials that run here would all fail on it
            raise ConfigError(
                "trainer.device=cuda but torch sees no CUDA device here; "
                "use trainer.device=auto or cpu"
            )


def check_data(run: RunConfig, target: str | None) -> None:
    """Token shards readable, or the embedded corpus long enough to split; a user's function
    reads its own data (and its driver never imports torch, which the data module does)."""
    if run.data.name != "shards" and target:
        return
    from sweeper.train import data

    if run.data.name == "shards":
        data.check_shards(run.data, run.model.seq_len)
    else:
        data.check_stdlib_split(run.data.val_every_n_files, run.model.seq_len)


def check_single_run(cfg, run: RunConfig, target: str | None, joins: bool) -> None:
    """One run: its budget and model where it trains, its DDP ranks on the local cluster,
    a user's function importable, and the MLflow store it logs to."""
    check_budget(run)
    if not target and not (joins and run.trainer.workers > 1):
        from sweeper.train.device import resolve_device

        # here, where the run will train; CPU DDP ranks each hold a copy in its memory
        ranks = run.trainer.workers if resolve_device(run.trainer.device).type == "cpu" else 1
        check_model_fits(
            run, copies=ranks, copies_are="DDP ranks", fewer=lambda n: f"trainer.workers={n}"
        )
    if run.trainer.workers > 1:
        if joins:
            probe(str(cfg.ray.address))
        else:
            check_ddp_fits(cfg, run)
    if target:
        load_user_function(target)
    check_config_in_a_process(cfg)


def check_ddp_fits(cfg, run: RunConfig) -> None:
    """Ray Train would wait for ever for ranks the local cluster cannot place."""
    cpus = local_cluster_size(cfg.ray)[0]
    threads = run.trainer.threads or 1
    need = run.trainer.workers * threads
    if need > cpus:
        raise ConfigError(
            f"trainer.workers={run.trainer.workers} ranks x {threads} CPU (trainer.threads) "
            f"need {need} CPUs, but the local Ray cluster has {cpus:g} (ray.num_cpus)"
        )
    check_local_cluster(cfg.ray)


def check_sweep_overrides(overrides: list[str]) -> None:
    """A sweep writes its own budget and evaluation count into every trial: a trainer one
    named on the command line would be dropped unseen."""
    named = [
        f"trainer.{k}={v}" for k, v in chosen_budgets(overrides).items() if v.lower() != "null"
    ]
    if named:
        raise ConfigError(
            f"{named[0]}: a sweep gives every trial the same budget, "
            "sweep.budget.tokens_per_trial (or sweep.budget.flops_per_trial); set that"
        )
    cadence = [o for o in overrides if o.lstrip("+").split("=")[0] in EVAL_CADENCE_KEYS]
    if cadence:
        raise ConfigError(
            f"{cadence[0]}: a sweep's trials evaluate (and report) sweep.reports_per_trial "
            "times, or a stage's own sweep.stages.N.reports_per_trial; set that"
        )


def check_no_emptied_mapping(overrides: list[str]) -> None:
    """`sweep.stages.0.params={}`: Hydra merges an empty mapping into the file's, which
    leaves it as it was, so the stage would still search every param of the file."""
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key.startswith("sweep.") and value.replace(" ", "") == "{}":
            raise ConfigError(
                f"{override}: an empty mapping merges into the sweep file's {key} and leaves "
                f"it as it was; remove one entry with ~{key}.NAME, or edit the sweep file"
            )


def check_chdir(overrides: list[str]) -> None:
    """hydra.job.chdir: relative paths (data.path, the MLflow store) are read from where the
    command starts, and sweeper writes into the run dir itself."""
    chdir = hydra_setting(overrides, "hydra.job.chdir")
    chdir = None if chdir is None else str(chdir)
    chdir = chdir.lower() if chdir in ("True", "False") else chdir  # as YAML writes a bool
    if chdir is not None and str(chdir).strip().lower() not in ("false", "null", "0", "no", "off"):
        raise ConfigError(
            f"hydra.job.chdir={chdir}: sweeper writes into the run dir itself and reads "
            "relative paths (data.path, the MLflow store) from where it starts; leave it false"
        )


def print_plans(jobs: list[list[str]], checked: list[Job], multirun: bool) -> None:
    """`sweep.dry_run=true`: each job's plan, with nothing started."""
    for number, (overrides, job) in enumerate(zip(jobs, checked)):
        if multirun:
            shown = mask_secrets(" ".join(overrides))
            print(f"{'' if number == 0 else chr(10)}job {number}: {shown}")
        if job.dry_run:
            print_plan(job.plan, overrides)
        else:
            print("  a single run (sweep.dry_run plans sweeps)")


def print_plan(plan: SweepPlan, overrides: list[str]) -> None:
    """The sweep's plan (sweep/estimate.py), timed on this machine where its trials train
    on this machine's CPUs."""
    spec = plan.spec
    slots = None if plan.joins_a_cluster else slots_for(plan, *local_cluster_size(plan.ray))
    state, out = None, None
    if run_dir := hydra_setting(overrides, "hydra.run.dir"):
        out = Path(str(run_dir)).resolve()
        state = resumable_state(out, plan) if spec.resume else None
    speed = None
    local_cpus = slots is not None and not spec.gpus_per_trial and plan.workers == 1
    if local_cpus and not plan.target and not (state is not None and finished(plan, state)):
        print("timing a few training steps of the base config here ...", flush=True)
        try:
            speed = measure_speed(plan.base, spec.trial_threads)
            if speed is None:
                print(
                    f"  (not timed: a few steps of this model train over "
                    f"{flops_text(PROBE_MAX_FLOPS)} FLOPs, more than a dry run spends; "
                    "the plan gives FLOPs only)"
                )
        except (RuntimeError, OSError, MemoryError) as error:  # the plan stands without it
            print(f"  (not timed: {one_line(error)})")
    print(plan_text(plan, slots, state, out, speed))


def multirun_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs a `-m` run launches: Hydra's basic sweeper's own expansion of `a,b`,
    `range()` and `choice()` into one override list per job. Empty where another sweeper
    plugin is chosen (its syntax is its own): those jobs are checked as they start."""
    if any(o.lstrip("+").startswith("hydra/sweeper=") for o in overrides):
        return []
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    check_syntax(overrides)  # a syntax error named by its override, as without -m
    try:
        # glob() lists a config group's options: Hydra's config loader does
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
            batches = BasicSweeper.split_arguments(parsed, None)
    except HydraException as error:
        raise ConfigError(str(error).splitlines()[0]) from None
    for override in parsed:
        if override.is_sweep_override() and not list(override.sweep_string_iterator()):
            raise ConfigError(f"{override.input_line}: sweeps over no value, so no job would run")
    return [job for batch in batches for job in batch]
