"""The typed schema of a sweep file (`cfg.sweep`): its vocabulary, each key's type, choices
and range. What needs more than one key (a search that cannot run with a scheduler, a param
the run config lacks) is checked where the plan is built (`sweep/preflight.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sweeper.config.errors import ConfigError
from sweeper.config.fields import bounded, choice
from sweeper.config.schema import plain, typed

SEARCHES = ("random", "grid", "tpe", "gp", "bohb")
SCHEDULERS = ("fifo", "asha", "hyperband", "bohb")
# the search-space DSL's kinds (sweep/space.py): ranges, and lists of values
RANGE_KINDS = ("log_uniform", "uniform", "int", "log_int")
LIST_KINDS = ("choice", "grid")
KINDS = RANGE_KINDS + LIST_KINDS
LR_RULES = ("none", "sqrt", "linear", "retune")
# what sweeper's own training reports at every evaluation that a sweep can rank trials by
# (tests/test_train.py holds the trainer to it), and which way each is better
BUILTIN_MODES = {"val_bpb": "min", "train_loss": "min", "tokens_per_s": "max"}
BUILTIN_METRICS = tuple(BUILTIN_MODES)
# sweep.rung_cooldown when it is null, for sweeper's own training ranked on val_bpb: the
# fraction of a trial's steps so far that its fork at a rung cools down over (BENCHMARKS.md,
# "Rungs that rank cooled-down forks")
AUTO_RUNG_COOLDOWN = 0.25


@dataclass
class BudgetSpec:
    """Compute per trial (set one): the time axis of ASHA and HyperBand."""

    tokens_per_trial: float | None = bounded(None, gt=0)
    flops_per_trial: float | None = bounded(None, gt=0)


@dataclass
class StageSpec:
    name: str = "stage"
    params: dict[str, Any] = field(default_factory=dict)
    search: str | None = choice(None, SEARCHES)  # null: the sweep's default
    scheduler: str | None = choice(None, SCHEDULERS)
    num_samples: int = bounded(8, ge=1)
    lr_rule: str = choice("none", LR_RULES)  # how frozen LRs follow a batch-size change
    retune_factor: float = bounded(2.0, gt=1)  # lr_rule=retune: search LRs in [v / f, v * f]
    points: list[Any] = field(default_factory=list)  # configurations to try first
    # trials past the end of a range where the stage's best sat (0: none; sweep/extend.py)
    extend_trials: int = bounded(0, ge=0)
    # evaluations per trial in this stage (null: sweep.reports_per_trial); a fifo stage
    # ranks only the last one, so fewer spare the time of the others
    reports_per_trial: int | None = bounded(None, ge=1)


@dataclass
class BohbSpec:
    """hpbandster's BOHB model settings (its defaults). Its KDEs are fit to the best
    ``top_n_percent`` of results at the largest budget with enough of them; a
    ``random_fraction`` of proposals stay random; ``bandwidth_factor`` widens the KDE that
    proposals are drawn from."""

    random_fraction: float = bounded(1 / 3, ge=0, le=1)
    bandwidth_factor: float = bounded(3.0, gt=0)
    top_n_percent: int = bounded(15, gt=0, lt=100)
    num_samples: int = bounded(64, ge=1)
    min_bandwidth: float = bounded(1e-3, gt=0)


@dataclass
class SweepSpec:
    name: str = "sweep"
    metric: str = "val_bpb"
    mode: str = choice("min", ("min", "max"))
    search: str = choice("tpe", SEARCHES)
    scheduler: str = choice("asha", SCHEDULERS)
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    stages: list[StageSpec] = field(default_factory=list)
    max_trials: int | None = bounded(None, gt=0)
    max_flops: float | None = bounded(None, gt=0)
    max_seconds: float | None = bounded(None, gt=0)
    concurrency: int | None = bounded(None, gt=0)
    cpus_per_trial: float = bounded(1.0, gt=0)
    gpus_per_trial: float = bounded(0.0, ge=0)
    reports_per_trial: int = bounded(8, ge=1)
    grace_fraction: float = bounded(0.25, gt=0, le=1)
    reduction_factor: float = bounded(3.0, gt=1)
    # > 0: rungs rank a cooled-down fork of each trial (train/loop.py); null: AUTO_RUNG_COOLDOWN
    # for sweeper's own training ranked on val_bpb, else 0
    rung_cooldown: float | None = bounded(None, ge=0, le=1)
    brackets: int | None = bounded(None, ge=1)  # null: all of HyperBand's, ASHA's one
    bohb: BohbSpec = field(default_factory=BohbSpec)
    penalty: float | None = None  # what a diverged trial reports (null: see plan.penalty)
    seed: int = bounded(0, ge=0, le=2**31 - 1)  # the searchers seed numpy's generators
    baseline: bool = True
    # after the stages: the best config and the baseline trained again on this many fresh
    # seeds (trainer.seed + 1, + 2, ...), the improvement against seed-to-seed noise
    confirm_seeds: int = bounded(0, ge=0)
    max_failures: int = bounded(1, ge=0)
    # a trial silent for 10x its slowest gap between reports, and this long, is ended as
    # failed (sweep/stall.py); null: never
    stall_seconds: float | None = bounded(60.0, gt=0)
    resume: bool = False
    dry_run: bool = False  # print the plan (stages, trials, FLOPs) and start nothing
    lr_keys: list[str] = field(default_factory=list)

    @property
    def trial_threads(self) -> int:
        """torch threads of each trial (and of the baseline): its CPU share, at least one."""
        return max(1, int(self.cpus_per_trial))


def load_sweep_spec(tree: Any) -> SweepSpec:
    """`cfg.sweep` (DictConfig or dict) -> SweepSpec, types, choices and ranges checked."""
    container = plain(tree)
    stages = container.get("stages") if isinstance(container, dict) else None
    if stages is not None and not isinstance(stages, list):
        raise ConfigError(f"sweep.stages must be a list of stages, got {stages!r}")
    if isinstance(stages, list):
        # each stage on its own: OmegaConf's error for a list item has no index in its key
        container = {**container, "stages": []}
    spec = typed(SweepSpec, container, "sweep.")
    if isinstance(stages, list):
        spec.stages = [
            typed(StageSpec, stage, f"sweep.stages.{i}.") for i, stage in enumerate(stages)
        ]
    return spec


def flatten_params(params: dict, prefix: str = "") -> dict[str, Any]:
    """Params may nest like the config (`optimizer: {matrix_lr: {log_uniform: [..]}}`, which
    plain Hydra overrides can address) or use dotted keys; both become dotted keys. A dict
    whose keys are all DSL kinds is a spec, not a level of nesting."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not value:
            continue  # a level emptied by a `~` override
        if isinstance(value, dict) and set(value) & set(KINDS) and not set(value) <= set(KINDS):
            unknown = sorted(set(value) - set(KINDS))
            raise ConfigError(
                f"sweep param '{name}': unknown spec kind {', '.join(unknown)} "
                f"(kinds: {', '.join(KINDS)})"
            )
        inner = (
            flatten_params(value, f"{name}.")
            if isinstance(value, dict) and not set(value) <= set(KINDS)
            else {name: value}
        )
        for twice in inner.keys() & flat.keys():
            # `optimizer.matrix_lr: ...` beside `optimizer: {matrix_lr: ...}`: one would
            # silently replace the other
            raise ConfigError(
                f"sweep param '{twice}' is given twice (as a dotted key and nested): keep one"
            )
        flat.update(inner)
    return flat


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
