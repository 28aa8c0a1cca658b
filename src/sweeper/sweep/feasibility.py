"""Whether every trial of a plan can run: each value a stage can hand a trial makes a valid
run, the model fits the memory its trials share, one trial fits the local cluster, and the
FLOP cap leaves room for one trial. Each failure is one ConfigError before Ray starts."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sweeper.config.errors import ConfigError
from sweeper.config.schema import load_run_config
from sweeper.config.sweep import flatten_params
from sweeper.sweep.cluster import local_cluster_size
from sweeper.sweep.estimate import stage_estimates
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.space import bounding_values
from sweeper.sweep.stages import fit_micro_batch, sweep_run
from sweeper.text import hydra_value
from sweeper.train.budget import check_budget, check_model_fits

# where and on how much a trial runs, which the cluster's resources are reserved for before
# any trial starts: a stage that searched them would ask Ray for what it never reserved
PLACEMENT_KEYS = {
    "trainer.device": "trainer.device=... with sweep.gpus_per_trial",
    "trainer.workers": "trainer.workers=...",
    "trainer.threads": "sweep.cpus_per_trial",
}
# a stage's values are also checked together, every combination, when there are at most
# this many: a budget in FLOPs with the deepest model of a grid can be under one step
COMBINATIONS_CHECKED = 128


def check_feasible(plan: SweepPlan) -> None:
    """Every check of this module that applies to `plan`."""
    if not plan.target:
        check_no_placement_searched(plan)
        check_stage_values(plan, local_trial_memory(plan))
        check_flop_cap(plan)
    if not plan.joins_a_cluster:
        check_trial_fits(plan, *local_cluster_size(plan.ray))


def check_no_placement_searched(plan: SweepPlan) -> None:
    """No stage searches where its trials run; a path it searches is absolute (Ray runs
    each trial in a directory of its own, where a relative one finds nothing)."""
    for index, stage in enumerate(plan.stages):
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


def check_flop_cap(plan: SweepPlan) -> None:
    """sweep.max_flops lets at least one trial train its budget: under one, the cap stops
    every trial part way and no stage has a value to freeze."""
    cap = plan.spec.max_flops
    if cap is None:
        return
    plans = stage_estimates(plan, plan.base)
    cheapest = min((p.trial_flops[0] for p in plans if p.trial_flops), default=None)
    if cheapest is not None and cap < cheapest:
        raise ConfigError(
            f"sweep.max_flops={cap:.3g} is less than one trial (the cheapest "
            f"trains {cheapest:.3g} FLOPs): no trial could finish its budget"
        )


def slots_for(plan: SweepPlan, cpus: float, gpus: float, capped: bool = True) -> int:
    """Trials a cluster of `cpus` and `gpus` runs at once: each resource over one trial's
    share (times its DDP ranks), capped by sweep.concurrency where `capped`; at least 1."""
    spec, workers = plan.spec, plan.workers
    slots = [spec.concurrency or math.inf] if capped else [math.inf]
    if spec.cpus_per_trial:
        slots.append(cpus // (spec.cpus_per_trial * workers))
    if spec.gpus_per_trial:
        slots.append(gpus // (spec.gpus_per_trial * workers))
    fewest = min(slots)
    return 1 if fewest == math.inf else max(1, int(fewest))


def check_trial_fits(plan: SweepPlan, cpus: float, gpus: float) -> None:
    """One trial's CPUs and GPUs (per DDP rank, times the ranks) must fit the local cluster:
    Ray would otherwise keep such a trial pending for ever, with a warning in its logs."""
    workers = plan.workers
    ranks = f" x {workers} ranks (trainer.workers)" if workers > 1 else ""
    for kind, per_trial, have in (
        ("cpu", plan.spec.cpus_per_trial, cpus),
        ("gpu", plan.spec.gpus_per_trial, gpus),
    ):
        need = per_trial * workers
        if need > have:
            raise ConfigError(
                f"sweep.{kind}s_per_trial={per_trial:g}{ranks} needs {need:g} {kind.upper()}"
                f"{'' if need == 1 else 's'} per trial, but the local Ray cluster has "
                f"{have:g} (ray.num_{kind}s); "
                "ask for less, or join a bigger cluster with ray.address"
            )


@dataclass(frozen=True)
class TrialMemory:
    """The device a local cluster's trials train on, and how many of them share it at
    once: the trials the machine's CPUs run together (times their DDP ranks), or those
    packed onto one GPU by a fractional sweep.gpus_per_trial."""

    device: Any  # torch.device
    copies: int = 1
    copies_are: str = "copies"
    fewer: Callable[[int], str] | None = None

    def check(self, run) -> None:
        check_model_fits(run, self.device, self.copies, self.copies_are, self.fewer)


def local_trial_memory(plan: SweepPlan) -> TrialMemory | None:
    """Where a trial of a local cluster trains: a GPU where it is given one, else the CPU.
    None on a cluster the sweep joins, whose nodes this machine cannot see."""
    if plan.joins_a_cluster:
        return None
    import torch

    workers, share = plan.workers, plan.spec.gpus_per_trial
    slots = slots_for(plan, *local_cluster_size(plan.ray))
    if share and torch.cuda.is_available():
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
        torch.device("cpu"), slots, "trials at once", lambda fit: f"sweep.concurrency={fit}"
    )


def check_stage_values(plan: SweepPlan, memory: TrialMemory | None = None) -> None:
    """Each value a stage can hand a trial, written alone into the base config, must make a
    valid run; otherwise it fails every trial it reaches, after Ray has started. Ranges are
    checked at both ends, and integer ranges one step in from the low end too ("a multiple
    of 4096" fails there). Then the values together, where the combinations are few. With
    the `memory` the trials train in, each model must also fit it as often as trials share
    it. Later stages start from earlier stages' best, which satisfies the same schema."""
    base = plan.base
    run = load_run_config(fit_micro_batch(base))  # the baseline's run, and every stage's start
    check_budget(run)  # the budget written in, before any stage's values
    if memory is not None:
        memory.check(run)
    frozen = plan.frozen_lrs(base)
    for stage in plan.stages:
        space = plan.space(stage, frozen)
        options = _bounding_options(space)
        alone = [{key: option} for key, choices in options.items() for option in choices]
        together = []
        if 1 < len(options) and math.prod(map(len, options.values())) <= COMBINATIONS_CHECKED:
            together = [dict(zip(options, combo)) for combo in itertools.product(*options.values())]
        # a stage of grids and choices runs exactly its combinations: a value that fails
        # alone but in none of them (lr_bs_scaling's smallest FLOPs budget with the base
        # config's batch, never its own) is no trial's, and is let pass
        exact = bool(together) and all(param.values for param in space.params)
        failed_alone = []
        for candidate in alone + together:
            error = _run_error(base, candidate, memory)
            if error is None:
                continue
            if exact and len(candidate) == 1:
                failed_alone.append((candidate, error))
                continue
            for single, single_error in failed_alone:  # name the value that fails alone
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


def _bounding_options(space) -> dict[str, list[tuple[Any, str]]]:
    """{param: [(value, kind), ...]}: the values that bound each param, fixed ones too."""
    options = {key: [(value, "fixed")] for key, value in space.fixed.items()}
    for param in space.params:
        values = bounding_values(param)
        if param.integer and param.low + 1 < param.high:
            values.insert(1, int(param.low) + 1)
        options[param.name] = [(value, param.kind) for value in values]
    return options


def _run_error(base: dict, candidate: dict, memory: TrialMemory | None) -> ConfigError | None:
    """Why the base config with `candidate`'s values ({key: (value, kind)}) is no valid run
    (in `memory`, where given: a model too big for it)."""
    try:
        run = load_run_config(sweep_run(base, {k: v for k, (v, _) in candidate.items()}))
        check_budget(run)
        if memory is not None:
            memory.check(run)
    except ConfigError as error:
        return error
    return None
