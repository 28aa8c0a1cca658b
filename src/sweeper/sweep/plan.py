"""What a sweep checks and prepares before Ray starts.

Every mistake these functions can find (a bad stage value, a trial bigger than the cluster,
a user function with the wrong signature, a run dir that holds another sweep) is a
one-line ConfigError while nothing has been started or written. `base_config` makes the
plain dict that every trial of the sweep starts from.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sweeper.config.errors import ConfigError
from sweeper.config.schema import (
    BUILTIN_TRAINABLE,
    RUN_SECTIONS,
    check_optimizer_reads,
    load_run_config,
)
from sweeper.sweep.space import bounding_values
from sweeper.sweep.spec import (
    SweepSpec,
    chooses_optimizer,
    flatten,
    flatten_params,
    load_sweep_spec,
    lr_keys_read,
    rung_cooldown_for,
    stage_space,
    validate_spec,
)
from sweeper.sweep.stages import fit_micro_batch, get_dotted, hydra_value, sweep_run
from sweeper.sweep.state import SweepState, check_resumable, sweep_definition
from sweeper.sweep.trainable import load_target

# the sections that configure the platform, not a run
PLATFORM_KEYS = ("sweep", "ray", "mlflow", "trainable", "hydra", "fit")


def trainable_target(cfg) -> str | None:
    """The user's function ("pkg.module.fn"), or None for sweeper's own training run."""
    target = cfg.get("trainable", {}).get("_target_", BUILTIN_TRAINABLE)
    if target is None or not str(target).strip():
        raise ConfigError(
            f"trainable._target_={target or ''}: name a function (pkg.module.fn), or leave "
            f"it at {BUILTIN_TRAINABLE} for sweeper's own training"
        )
    return None if target == BUILTIN_TRAINABLE else target


def validate_sweep(cfg) -> SweepSpec:
    """Every check that can run before Ray starts; raises ConfigError."""
    from omegaconf import OmegaConf

    spec = load_sweep_spec(cfg.sweep)
    target = trainable_target(cfg)
    run_values = flatten(OmegaConf.to_container(cfg, resolve=True))
    validate_spec(spec, run_values, custom_trainable=target is not None)
    # from here on a number: what the trials, the resume check and the summary see
    spec.rung_cooldown = rung_cooldown_for(spec, custom_trainable=target is not None)
    if spec.confirm_seeds and "trainer.seed" not in run_values:  # a user's config may lack it
        raise ConfigError(
            f"sweep.confirm_seeds={spec.confirm_seeds} trains again on other values of "
            "trainer.seed, which this config does not have"
        )
    if target:
        load_user_function(target)
    else:
        spec.lr_keys = lr_keys_read(spec, run_values.get("optimizer.name"))
        check_searched_keys_are_read(spec, run_values.get("optimizer.name"))
        check_no_placement_searched(spec)
        base = base_config(cfg, spec, None)
        check_stage_values(spec, base, local_trial_memory(spec, cfg))
        check_flop_cap(spec, base)
        threads = cfg.trainer.get("threads")
        if threads is not None and threads != spec.trial_threads:  # it would be ignored
            raise ConfigError(
                f"trainer.threads={threads}: a trial trains on its CPU share, "
                f"sweep.cpus_per_trial={spec.cpus_per_trial:g} ({spec.trial_threads} "
                f"thread{'s' if spec.trial_threads > 1 else ''}); set that instead"
            )
        one_process = int(cfg.trainer.workers) == 1
        if cfg.trainer.device == "cuda" and one_process and not spec.gpus_per_trial:
            raise ConfigError(
                "trainer.device=cuda but sweep.gpus_per_trial=0: give each trial a GPU "
                "(sweep.gpus_per_trial=1, or 0.5 for two trials on one)"
            )
    if not cfg.get("ray", {}).get("address"):
        from sweeper.sweep.cluster import local_cluster_size

        workers = 1 if target else int(cfg.trainer.workers)
        check_trial_fits(spec, workers, *local_cluster_size(cfg.ray))
    return spec


def check_searched_keys_are_read(spec: SweepSpec, optimizer: str | None) -> None:
    """No stage searches an optimizer key the sweep's optimizer leaves unread (+sweep=lr
    with optimizer=adamw: Muon's LRs), where every trial would train the same run. A sweep
    with a stage that chooses optimizer.name may search them all."""
    if optimizer is None or chooses_optimizer(spec):
        return
    for index, stage in enumerate(spec.stages):
        for key in flatten_params(stage.params):
            check_optimizer_reads(optimizer, key, f"sweep.stages.{index}.params.{key}")


def check_flop_cap(spec: SweepSpec, base: dict) -> None:
    """sweep.max_flops lets at least one trial of sweeper's training train its budget:
    under one, the cap stops every trial part way and no stage has a value to freeze."""
    if spec.max_flops is None:
        return
    from sweeper.sweep.estimate import stage_plans

    plans = stage_plans(spec, base, None, [])
    cheapest = min((plan.trial_flops[0] for plan in plans if plan.trial_flops), default=None)
    if cheapest is not None and spec.max_flops < cheapest:
        raise ConfigError(
            f"sweep.max_flops={spec.max_flops:.3g} is less than one trial (the cheapest "
            f"trains {cheapest:.3g} FLOPs): no trial could finish its budget"
        )


# where and on how much a trial runs, which the cluster's resources are reserved for before
# any trial starts: a stage that searched them would ask Ray for what it never reserved
PLACEMENT_KEYS = {
    "trainer.device": "trainer.device=... with sweep.gpus_per_trial",
    "trainer.workers": "trainer.workers=...",
    "trainer.threads": "sweep.cpus_per_trial",
}


def check_no_placement_searched(spec: SweepSpec) -> None:
    """No stage searches where its trials run; a path it searches is absolute (Ray runs
    each trial in a directory of its own, where a relative one finds nothing)."""
    for index, stage in enumerate(spec.stages):
        for key, param in flatten_params(stage.params).items():
            where = f"sweep.stages.{index}.params.{key}"
            if key in PLACEMENT_KEYS:
                raise ConfigError(
                    f"{where}: where a trial runs is no hyperparameter to search; set it "
                    f"for the whole sweep ({PLACEMENT_KEYS[key]})"
                )
            if key in ("data.path", "data.val_path") and isinstance(param, dict):
                for values in param.values():
                    for value in values if isinstance(values, list | tuple) else [values]:
                        if isinstance(value, str) and not os.path.isabs(value):
                            raise ConfigError(
                                f"{where}: {value} is relative, and a trial runs in a "
                                f"directory of its own; write {os.path.abspath(value)}"
                            )


def load_user_function(target: str):
    """The user's function `target` names, checked: importable, of (config, report)."""
    if "." not in target.strip("."):
        raise ConfigError(
            f"trainable._target_={target}: name the function with its module, pkg.module.fn"
        )
    try:
        fn = load_target(target)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"trainable._target_={target} cannot be imported: {error}") from None
    except Exception as error:  # the module fails as it is imported (a SyntaxError names
        # its file and line): its own bug, not the platform's
        raise ConfigError(
            f"trainable._target_={target}: importing its module raised "
            f"{type(error).__name__}: {error}"
        ) from None
    check_trainable_signature(target, fn)
    return fn


def user_function_config(cfg) -> dict:
    """What a user's function is given: the whole composed tree as plain values, less the
    platform's own sections (its own, `+mine.layers=3`, stay)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=True)
    for key in PLATFORM_KEYS:
        tree.pop(key, None)
    return tree


def check_trainable_signature(target: str, fn: Any) -> None:
    """A user's trainable is called as fn(config, report): anything else would fail in
    every trial, after Ray started."""
    import inspect

    usage = f"trainable._target_={target} must be a function of (config, report)"
    if not callable(fn):
        raise ConfigError(f"{usage}; it is a {type(fn).__name__}")
    if inspect.isclass(fn):  # calling it makes an object, which reports nothing
        raise ConfigError(f"{usage}; it is a class")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none to read: let the trial say
        return
    try:
        signature.bind({}, print)
    except TypeError as error:
        raise ConfigError(f"{usage}; its signature is {signature} ({error})") from None


def resumable_state(out: Path, spec: SweepSpec, base: dict) -> SweepState | None:
    """The saved state of the sweep in `out` (None: nothing saved), if it is this sweep."""
    state = SweepState.load(out)
    if state is not None:
        try:
            check_resumable(state, spec.name, base, sweep_definition(spec))
        except ValueError as error:
            raise ConfigError(str(error)) from None
    return state


def check_trial_fits(spec: SweepSpec, workers: int, cpus: float, gpus: float) -> None:
    """One trial's CPUs and GPUs (per DDP rank, times the ranks) must fit the local cluster:
    Ray would otherwise keep such a trial pending for ever, with a warning in its logs."""
    ranks = f" x {workers} ranks (trainer.workers)" if workers > 1 else ""
    for kind, per_trial, have in (
        ("cpu", spec.cpus_per_trial, cpus),
        ("gpu", spec.gpus_per_trial, gpus),
    ):
        need = per_trial * workers
        if need > have:
            raise ConfigError(
                f"sweep.{kind}s_per_trial={per_trial:g}{ranks} needs {need:g} {kind.upper()}"
                f"{'' if need == 1 else 's'} per trial, but the local Ray cluster has "
                f"{have:g} (ray.num_{kind}s); "
                "ask for less, or join a bigger cluster with ray.address"
            )


# a stage's values are also checked together, every combination, when there are at most
# this many: a budget in FLOPs with the deepest model of a grid can be under one step
COMBINATIONS_CHECKED = 128


@dataclasses.dataclass(frozen=True)
class TrialMemory:
    """The device a local cluster's trials train on, and how many of them share it at
    once: the trials the machine's CPUs run together (times their DDP ranks), or those
    packed onto one GPU by a fractional sweep.gpus_per_trial."""

    device: Any  # torch.device
    copies: int = 1
    copies_are: str = "copies"
    fewer: Callable[[int], str] | None = None

    def check(self, run) -> None:
        from sweeper.train.budget import check_model_fits

        check_model_fits(run, self.device, self.copies, self.copies_are, self.fewer)


def slots_for(spec: SweepSpec, workers: int, cpus: float, gpus: float) -> int:
    """Trials a cluster of `cpus` and `gpus` runs at once: each resource over one trial's
    share (times its DDP ranks), capped by sweep.concurrency; at least 1."""
    slots = [spec.concurrency or math.inf]
    if spec.cpus_per_trial:
        slots.append(cpus // (spec.cpus_per_trial * workers))
    if spec.gpus_per_trial:
        slots.append(gpus // (spec.gpus_per_trial * workers))
    fewest = min(slots)
    return 1 if fewest == math.inf else max(1, int(fewest))


def local_trial_memory(spec: SweepSpec, cfg) -> TrialMemory | None:
    """Where a trial of a local cluster trains: a GPU where it is given one, else the CPU
    (Ray hides the GPUs from a trial given none). None on a cluster the sweep joins, whose
    nodes this machine cannot see."""
    if cfg.get("ray", {}).get("address"):
        return None
    import torch

    from sweeper.sweep.cluster import local_cluster_size

    workers = int(cfg.trainer.workers)
    slots = slots_for(spec, workers, *local_cluster_size(cfg.ray))
    if spec.gpus_per_trial and torch.cuda.is_available():
        share = spec.gpus_per_trial
        per_gpu = int(min(slots, 1 // share)) if share < 1 else 1
        return TrialMemory(
            torch.device("cuda"),
            per_gpu,
            f"trials on one GPU (sweep.gpus_per_trial={share:g})",
            lambda fit: f"sweep.gpus_per_trial={1 / fit:.3g}",
        )
    if workers > 1:
        return TrialMemory(
            torch.device("cpu"),
            slots * workers,
            f"copies at once ({slots} trial{'s' * (slots > 1)} x {workers} DDP ranks)",
        )
    return TrialMemory(
        torch.device("cpu"),
        slots,
        "trials at once",
        lambda fit: f"sweep.concurrency={fit}",
    )


def check_stage_values(spec: SweepSpec, base: dict, memory: TrialMemory | None = None) -> None:
    """Each value a stage can hand a trial, written alone into the base config, must make a
    valid run. Otherwise a grid batch size of no whole number of sequences, or a fixed
    LR below zero, fails every trial it reaches after Ray has started and the run dir is
    written. Ranges are checked at both ends, and integer ranges also one step in from the
    low end: a constraint like "a multiple of 4096" fails there, and a grid or choice is
    what such a key needs. Then the values together, where the combinations are few; a
    stage of grids and choices is then held to its combinations alone. With the `memory`
    the trials train in (a local cluster's), each model must also fit it, as many times as
    trials share it.
    Later stages start from earlier stages' best, which satisfies the same schema."""
    from sweeper.train.budget import check_budget

    run = load_run_config(fit_micro_batch(base))  # the baseline's run, and every stage's start
    check_budget(run)  # the budget written in, before any stage's values
    if memory is not None:
        memory.check(run)
    frozen = frozen_lrs(spec, base)
    for stage in spec.stages:
        space = stage_space(spec, stage, frozen)
        options = {key: [(value, "fixed")] for key, value in space.fixed.items()}
        for param in space.params:
            values = bounding_values(param)
            if param.integer and param.low + 1 < param.high:
                values.insert(1, int(param.low) + 1)
            options[param.name] = [(value, param.kind) for value in values]
        alone = [{key: option} for key, choices in options.items() for option in choices]
        together = []
        if 1 < len(options) and math.prod(map(len, options.values())) <= COMBINATIONS_CHECKED:
            together = [dict(zip(options, combo)) for combo in itertools.product(*options.values())]
        # a stage of grids and choices alone runs exactly its combinations: there a value that
        # fails alone but in none of them (lr_bs_scaling's smallest FLOPs budget with the
        # base config's batch, never its own) is no trial's, and is let pass
        exact = bool(together) and all(param.values for param in space.params)
        failed_alone = []
        for candidate in alone + together:
            error = _run_error(base, candidate, memory)
            if error is None:
                continue
            if exact and len(candidate) == 1:
                failed_alone.append((candidate, error))
                continue
            # name a single value where one in this combination fails alone too
            for single, single_error in failed_alone:
                if single.items() <= candidate.items():
                    candidate, error = single, single_error
                    break
            shown = ", ".join(
                f"{k}={hydra_value(v)} ({kind})" for k, (v, kind) in candidate.items()
            )
            raise ConfigError(
                f"sweep stage '{stage.name}': {shown} "
                f"{'is' if len(candidate) == 1 else 'together are'} not a valid run: {error}"
            )


def frozen_lrs(spec: SweepSpec, base: dict) -> dict:
    """The LRs of sweep.lr_keys that `base` holds: what an lr_rule=retune band is centred
    on before the stages have run."""
    frozen = {key: get_dotted(base, key) for key in spec.lr_keys}
    return {key: value for key, value in frozen.items() if value is not None}


def _run_error(base: dict, candidate: dict, memory: TrialMemory | None) -> ConfigError | None:
    """Why the base config with `candidate`'s values ({key: (value, kind)}) is no valid run
    (in `memory`, where given: a model too big for it)."""
    from sweeper.train.budget import check_budget

    try:
        run = load_run_config(sweep_run(base, {k: v for k, (v, _) in candidate.items()}))
        check_budget(run)
        if memory is not None:
            memory.check(run)
    except ConfigError as error:
        return error
    return None


def base_config(cfg, spec: SweepSpec, target: str | None) -> dict:
    """The plain nested dict every trial starts from, with the sweep's budget written in
    and relative paths made absolute (Ray runs trials in their own working directories)."""
    tree = user_function_config(cfg)
    if target:
        return tree
    trainer = tree["trainer"]
    for key in ("max_steps", "budget_tokens", "budget_flops", "tokens_per_param"):
        trainer[key] = None
    trainer["budget_tokens"] = spec.budget.tokens_per_trial
    trainer["budget_flops"] = spec.budget.flops_per_trial
    trainer["num_evals"] = spec.reports_per_trial
    for key in ("path", "val_path"):
        if tree["data"].get(key):
            tree["data"][key] = os.path.abspath(tree["data"][key])
    return {k: tree[k] for k in RUN_SECTIONS}


def with_reports(base: dict, reports: int, target: str | None) -> dict:
    """`base` with its runs evaluating (and reporting) `reports` times: a stage's own
    reports_per_trial. A user's function reports when it likes: its config is kept."""
    if target or base["trainer"].get("num_evals") == reports:
        return base
    return {**base, "trainer": {**base["trainer"], "num_evals": reports}}
