"""The sweep's plan, built once from the composed config with every check done before Ray
starts: the keys the schema cannot check alone, the user's function, the config every trial
starts from, and whether each trial can run (`feasibility`). Each mistake is one
ConfigError line, with nothing started or written."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from sweeper.config.errors import ConfigError
from sweeper.config.schema import OPTIMIZER_LRS, RUN_SECTIONS, check_optimizer_reads
from sweeper.config.sweep import (
    AUTO_RUNG_COOLDOWN,
    BUILTIN_METRICS,
    BUILTIN_MODES,
    SweepSpec,
    flatten,
    flatten_params,
    load_sweep_spec,
)
from sweeper.sweep.algorithms import check_compatible
from sweeper.sweep.feasibility import check_feasible
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.rungs import check_reduction_factor
from sweeper.sweep.state import SweepState, check_resumable, sweep_definition
from sweeper.user_function import PLATFORM_KEYS, load_user_function, trainable_target

NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a name that names files and MLflow runs
MAX_RUNGS = 32  # where a stage's scheduler ranks its trials (eta=3 from 1/64 of a budget: 4)


def build_plan(cfg) -> SweepPlan:
    """The checked plan of the sweep `cfg` composes; raises ConfigError."""
    from omegaconf import OmegaConf

    spec = load_sweep_spec(cfg.sweep)
    target = trainable_target(cfg)
    tree = OmegaConf.to_container(cfg, resolve=True)
    run_values = flatten(tree)
    check_sweep_keys(spec, run_values, own_training=target is None)
    if spec.rung_cooldown is None:  # from here on a number, as the trials see it
        forks = target is None and spec.metric == "val_bpb"
        spec.rung_cooldown = AUTO_RUNG_COOLDOWN if forks else 0.0
    if spec.confirm_seeds and "trainer.seed" not in run_values:  # a user's config may lack it
        raise ConfigError(
            f"sweep.confirm_seeds={spec.confirm_seeds} trains again on other values of "
            "trainer.seed, which this config does not have"
        )
    if target:
        load_user_function(target)
    else:
        optimizer = run_values.get("optimizer.name")
        spec.lr_keys = lr_keys_read(spec, optimizer)
        check_searched_keys_are_read(spec, optimizer)
        check_trial_placement(spec, tree["trainer"])
    definition = sweep_definition(spec)  # before the defaults below: what a state records
    for stage in spec.stages:
        stage.search = stage.search or spec.search
        stage.scheduler = stage.scheduler or spec.scheduler
        stage.reports_per_trial = stage.reports_per_trial or spec.reports_per_trial
    plan = SweepPlan(
        spec=spec,
        base=base_config(tree, spec, target),
        target=target,
        definition=definition,
        ray=tree.get("ray") or {},
        mlflow=tree.get("mlflow") or {},
        fit=tree.get("fit") or {},
    )
    for index in range(len(spec.stages)):
        check_stage(plan, index, run_values)
    check_feasible(plan)
    return plan


def check_sweep_keys(spec: SweepSpec, run_values: dict[str, Any], own_training: bool) -> None:
    """What the schema cannot check key by key; `run_values`: the composed config, flat."""
    _check(bool(spec.stages), f"sweep '{spec.name}' has no stages")
    if own_training:
        _check(
            spec.metric in BUILTIN_METRICS,
            f"sweep.metric must be one of {', '.join(BUILTIN_METRICS)} (what a training run "
            f"reports), got {spec.metric!r}",
        )
        better = BUILTIN_MODES[spec.metric]
        _check(
            spec.mode == better,
            f"sweep.mode={spec.mode} with sweep.metric={spec.metric}, which is better "
            f"{'lower' if better == 'min' else 'higher'}: the sweep would look for the worst "
            f"config; set sweep.mode={better}",
        )
        budgets = [k for k, v in vars(spec.budget).items() if v is not None]
        _check(
            len(budgets) == 1,
            "set exactly one of sweep.budget.tokens_per_trial, "
            f"sweep.budget.flops_per_trial; got {', '.join(budgets) or 'none'}",
        )
        for key in spec.lr_keys:  # a typo would leave that LR behind when the batch changes
            _check(key in run_values, f"sweep.lr_keys: unknown config key '{key}'")
    else:
        _check(bool(spec.metric), "sweep.metric must name a metric your function reports")
    _check(
        not spec.rung_cooldown or (own_training and spec.metric == "val_bpb"),
        "sweep.rung_cooldown forks sweeper's own training and scores val_bpb; "
        f"got {f'sweep.metric={spec.metric}' if own_training else 'a custom trainable'}",
    )
    names = [s.name for s in spec.stages]
    _check(len(set(names)) == len(names), f"sweep stage names must be unique, got {names}")
    for index, name in enumerate(names):  # each names files: stage_<name>.png, ray/stage0_<name>
        _check(
            bool(NAME.fullmatch(str(name))) and name not in (".", ".."),
            f"sweep.stages.{index}.name={name!r}: a stage's name names its files; use "
            "letters, digits, _ . and -",
        )
    _check(
        bool(NAME.fullmatch(str(spec.name))),
        f"sweep.name={spec.name!r}: use letters, digits, _ . and - (it names the sweep in "
        "MLflow, where sweeper.compare looks it up)",
    )


def check_rung_count(plan: SweepPlan, stage) -> None:
    """A reduction factor near 1 ranks trials at thousands of rungs (each one an evaluation)."""
    count = len(plan.rung_fractions(stage))
    if count > MAX_RUNGS:
        spec = plan.spec
        # the smallest factor with MAX_RUNGS rungs from the grace period to the full budget
        least = (1 / spec.grace_fraction) ** (1 / MAX_RUNGS)
        raise ConfigError(
            f"sweep.reduction_factor={spec.reduction_factor:g} makes {count} rungs in stage "
            f"'{stage.name}' (trials are evaluated and ranked at each); at most {MAX_RUNGS}: "
            f"use {math.ceil(least * 100) / 100:g} or more"
        )


def check_stage(plan: SweepPlan, index: int, run_values: dict[str, Any]) -> None:
    """A stage's params, its search with its scheduler and space, and its points."""
    stage = plan.stages[index]
    where = f"sweep stage '{stage.name}'"
    if not plan.target:
        for key in flatten_params(stage.params):
            _check(key in run_values, f"{where}: unknown config key '{key}' in params")
    if stage.lr_rule == "retune" and stage.search == "grid":
        # random search runs grid values and samples bands; the model-based ones only sample
        has_grid = any(p.kind == "grid" for p in plan.space(stage).params)
        raise ConfigError(
            f"{where}: lr_rule=retune searches a band around each frozen LR, which search "
            f"'grid' cannot sample; use sweep.stages.{index}.search="
            f"{'random' if has_grid else 'tpe (or random)'}"
        )
    frozen = dict.fromkeys(plan.spec.lr_keys, 1e-3)  # a stand-in for every frozen LR
    space = plan.space(stage, frozen)
    try:
        check_compatible(stage.search, stage.scheduler, space)
        check_reduction_factor(stage.scheduler, plan.spec.reduction_factor)
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from None
    check_rung_count(plan, stage)
    if stage.points:
        _check(
            stage.search != "grid" and not any(p.kind == "grid" for p in space.params),
            f"{where}: points need a sampled space; a grid already runs every value",
        )
        _check(
            len(stage.points) <= stage.num_samples,
            f"{where}: {len(stage.points)} points but num_samples={stage.num_samples}",
        )
        # a `base` point is checked against the composed config; a later stage's base
        # is only known once the stages before it have run, and is checked again then
        plan.points(stage, frozen, base_values=run_values)


def chooses_optimizer(spec: SweepSpec) -> bool:
    """Whether a stage searches optimizer.name: which LRs are read then depends on the trial."""
    return any("optimizer.name" in flatten_params(stage.params) for stage in spec.stages)


def lr_keys_read(spec: SweepSpec, optimizer: str | None) -> list[str]:
    """sweep.lr_keys less the optimizer LRs that `optimizer` does not read: such an LR would
    follow the batch size (a change in the reproduce line that does nothing) or get a retune
    band (a searched dimension that does nothing). A stage choosing optimizer.name keeps all."""
    if chooses_optimizer(spec) or optimizer not in OPTIMIZER_LRS:
        return list(spec.lr_keys)
    read = {f"optimizer.{key}" for key in OPTIMIZER_LRS[optimizer]}
    known = {f"optimizer.{key}" for keys in OPTIMIZER_LRS.values() for key in keys}
    return [key for key in spec.lr_keys if key in read or key not in known]


def check_searched_keys_are_read(spec: SweepSpec, optimizer: str | None) -> None:
    """No stage searches an optimizer key the sweep's optimizer leaves unread (+sweep=lr
    with optimizer=adamw: Muon's LRs), where every trial would train the same run."""
    if optimizer is None or chooses_optimizer(spec):
        return
    for index, stage in enumerate(spec.stages):
        for key in flatten_params(stage.params):
            check_optimizer_reads(optimizer, key, f"sweep.stages.{index}.params.{key}")


def check_trial_placement(spec: SweepSpec, trainer: dict) -> None:
    """trainer.threads and trainer.device as a sweep's trials would run them: a trial's
    threads are its CPU share, and a cuda trial needs a GPU share."""
    threads = trainer.get("threads")
    if threads is not None and threads != spec.trial_threads:  # it would be ignored
        raise ConfigError(
            f"trainer.threads={threads}: a trial trains on its CPU share, "
            f"sweep.cpus_per_trial={spec.cpus_per_trial:g} ({spec.trial_threads} "
            f"thread{'s' if spec.trial_threads > 1 else ''}); set that instead"
        )
    if trainer.get("device") == "cuda" and int(trainer["workers"]) == 1 and not spec.gpus_per_trial:
        raise ConfigError(
            "trainer.device=cuda but sweep.gpus_per_trial=0: give each trial a GPU "
            "(sweep.gpus_per_trial=1, or 0.5 for two trials on one)"
        )


def base_config(tree: dict, spec: SweepSpec, target: str | None) -> dict:
    """The plain nested dict every trial starts from, with the sweep's budget written in
    and relative paths made absolute (Ray runs trials in their own working directories).
    A user's function gets the whole tree less the platform's sections."""
    tree = {k: v for k, v in tree.items() if k not in PLATFORM_KEYS}
    if target:
        return tree
    trainer = dict(tree["trainer"])
    for key in ("max_steps", "budget_tokens", "budget_flops", "tokens_per_param"):
        trainer[key] = None
    trainer["budget_tokens"] = spec.budget.tokens_per_trial
    trainer["budget_flops"] = spec.budget.flops_per_trial
    trainer["num_evals"] = spec.reports_per_trial
    data = dict(tree["data"])
    for key in ("path", "val_path"):
        if data.get(key):
            data[key] = os.path.abspath(data[key])
    return {**{k: tree[k] for k in RUN_SECTIONS}, "trainer": trainer, "data": data}


def resumable_state(out: Path, plan: SweepPlan) -> SweepState | None:
    """The saved state of the sweep in `out` (None: nothing saved), if it is this sweep."""
    state = SweepState.load(out)
    if state is not None:
        try:
            check_resumable(state, plan.spec.name, plan.base, plan.definition)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    return state


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
