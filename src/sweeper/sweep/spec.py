"""The typed sweep definition (`cfg.sweep`), validated before Ray starts.

Every mistake a user can make in a sweep file or override (an unknown search, bohb search
without the bohb scheduler, an empty or inverted range, a parameter key the run config
does not have) becomes one ConfigError line here, so nothing is started or written.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from sweeper.config.errors import ConfigError
from sweeper.config.schema import OPTIMIZER_LRS, typed
from sweeper.sweep.algorithms import SCHEDULERS, SEARCHES, check_compatible
from sweeper.sweep.rungs import check_reduction_factor
from sweeper.sweep.space import Space, SpaceError, parse_points, parse_space

LR_RULES = ("none", "sqrt", "linear", "retune")
BATCH_KEY = "trainer.total_batch_size"
# what sweeper.train.loop reports at every evaluation that a sweep can rank trials by
# (tests/test_train.py holds the trainer to it)
BUILTIN_METRICS = ("val_bpb", "train_loss", "tokens_per_s")
# which way each is better: the other way a sweep looks for the worst config (and, under
# max, finds a diverged trial's penalty the best)
BUILTIN_MODES = {"val_bpb": "min", "train_loss": "min", "tokens_per_s": "max"}


@dataclass
class BudgetSpec:
    tokens_per_trial: float | None = None
    flops_per_trial: float | None = None


@dataclass
class StageSpec:
    name: str = "stage"
    params: dict[str, Any] = field(default_factory=dict)
    search: str | None = None  # null: the sweep's default
    scheduler: str | None = None
    num_samples: int = 8
    lr_rule: str = "none"  # how frozen LRs follow a batch-size change
    retune_factor: float = 2.0  # lr_rule=retune: search LRs in [v / f, v * f]
    points: list[Any] = field(default_factory=list)  # configurations to try first
    # trials past the end of a range where the stage's best sat (0: none; sweep/extend.py)
    extend_trials: int = 0
    # evaluations per trial in this stage (null: sweep.reports_per_trial); a fifo stage
    # ranks only the last one, so fewer spare the time of the others
    reports_per_trial: int | None = None


@dataclass
class BohbSpec:
    """hpbandster's BOHB model settings (its defaults). Its KDEs are fit to the best
    ``top_n_percent`` of results at the largest budget with enough of them; a
    ``random_fraction`` of proposals stay random; ``bandwidth_factor`` widens the KDE that
    proposals are drawn from."""

    random_fraction: float = 1 / 3
    bandwidth_factor: float = 3.0
    top_n_percent: int = 15
    num_samples: int = 64
    min_bandwidth: float = 1e-3


@dataclass
class SweepSpec:
    name: str = "sweep"
    metric: str = "val_bpb"
    mode: str = "min"
    search: str = "tpe"
    scheduler: str = "asha"
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    stages: list[StageSpec] = field(default_factory=list)
    max_trials: int | None = None
    max_flops: float | None = None
    max_seconds: float | None = None
    concurrency: int | None = None
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    reports_per_trial: int = 8
    grace_fraction: float = 0.25
    reduction_factor: float = 3.0
    # > 0: rungs rank a cooled-down fork of each trial (train.py); null: see rung_cooldown_for
    rung_cooldown: float | None = None
    brackets: int | None = None  # null: all of HyperBand's, ASHA's one
    bohb: BohbSpec = field(default_factory=BohbSpec)
    penalty: float | None = None
    seed: int = 0
    baseline: bool = True
    # after the stages: the best config and the baseline trained again on this many fresh
    # seeds (trainer.seed + 1, + 2, ...), the improvement against seed-to-seed noise
    confirm_seeds: int = 0
    max_failures: int = 1
    resume: bool = False
    dry_run: bool = False  # print the plan (stages, trials, FLOPs) and start nothing
    lr_keys: list[str] = field(default_factory=list)

    @property
    def trial_threads(self) -> int:
        """torch threads of each trial (and of the baseline): its CPU share, at least one."""
        return max(1, int(self.cpus_per_trial))

    def stage_search(self, stage: StageSpec) -> str:
        return stage.search or self.search

    def stage_scheduler(self, stage: StageSpec) -> str:
        return stage.scheduler or self.scheduler

    def stage_reports(self, stage: StageSpec) -> int:
        return stage.reports_per_trial or self.reports_per_trial


# sweep.rung_cooldown when it is null, for sweeper's own training ranked on val_bpb: the
# fraction of a trial's steps so far that its fork at a rung cools down over. Measured on
# lr_bs over seven seeds (BENCHMARKS.md, "Rungs that rank cooled-down forks").
AUTO_RUNG_COOLDOWN = 0.25


def rung_cooldown_for(spec: SweepSpec, custom_trainable: bool) -> float:
    """sweep.rung_cooldown as the sweep runs it. Null (the default) forks where a fork can
    be made and scored: sweeper's own training, ranked on val_bpb (a user's function has no
    fork, and another metric no cooled value to rank). A number is taken as it is
    (validate_spec refuses one that cannot fork)."""
    if spec.rung_cooldown is not None:
        return spec.rung_cooldown
    return 0.0 if custom_trainable or spec.metric != "val_bpb" else AUTO_RUNG_COOLDOWN


def load_sweep_spec(tree: Any) -> SweepSpec:
    """`cfg.sweep` (DictConfig or dict) -> SweepSpec, types checked by OmegaConf."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(tree, resolve=True) if OmegaConf.is_config(tree) else tree
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
    from sweeper.sweep.space import KINDS

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


def chooses_optimizer(spec: SweepSpec) -> bool:
    """Whether a stage searches optimizer.name: which LRs are read then depends on the trial."""
    return any("optimizer.name" in flatten_params(stage.params) for stage in spec.stages)


def lr_keys_read(spec: SweepSpec, optimizer: str) -> list[str]:
    """sweep.lr_keys less the optimizer LRs that sweeper's `optimizer` does not read. Such an
    LR would otherwise follow the batch size (and show in the reproduce line as a change
    that does nothing) or get an lr_rule=retune band (a searched dimension that does
    nothing). A sweep with a stage that sets optimizer.name keeps them all."""
    if chooses_optimizer(spec) or optimizer not in OPTIMIZER_LRS:
        return list(spec.lr_keys)
    read = {f"optimizer.{key}" for key in OPTIMIZER_LRS[optimizer]}
    known = {f"optimizer.{key}" for keys in OPTIMIZER_LRS.values() for key in keys}
    return [key for key in spec.lr_keys if key in read or key not in known]


def stage_space(spec: SweepSpec, stage: StageSpec, frozen: dict[str, Any] | None = None) -> Space:
    """The stage's search space; lr_rule=retune adds a narrow band around each frozen LR."""
    from sweeper.sweep.space import narrow_log_band

    params = flatten_params(stage.params)
    if stage.lr_rule == "retune":
        for key in spec.lr_keys:
            if frozen and key in frozen and key not in params:
                params[key] = narrow_log_band(float(frozen[key]), stage.retune_factor)
    try:
        return parse_space(params)
    except ValueError as error:
        raise ConfigError(f"sweep stage '{stage.name}': {error}") from None


BASE_POINT = "base"  # a point that stands for the config the stage starts from


def stage_points(
    spec: SweepSpec,
    stage: StageSpec,
    frozen: dict[str, Any] | None = None,
    base_values: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The stage's `points`, flat, complete and checked against its space (see
    `parse_points`). A point `base` takes each searched param's value in `base_values` (by
    default `frozen`: the flat config the stage starts from), so the stage tries its
    starting config first. Under lr_rule=retune the LR bands are not the user's to set: a
    point starts each from its frozen value, the centre of its band."""
    frozen = frozen or {}
    base_values = frozen if base_values is None else base_values
    space = stage_space(spec, stage, frozen)
    declared = set(flatten_params(stage.params))
    added = [name for name in space.names if name not in declared]
    try:
        points = []
        for number, point in enumerate(stage.points, start=1):
            if point == BASE_POINT:
                own = [name for name in space.names if name not in added]
                lacking = [name for name in own if name not in base_values]
                if lacking:
                    raise SpaceError(f"sweep point {number}: base has no value for {lacking}")
                point = {name: base_values[name] for name in own}
            elif isinstance(point, dict):
                point = flatten(point)
                named = [key for key in point if key in added]
                if named:
                    raise SpaceError(
                        f"sweep point {number}: {named} are lr_rule=retune bands around the "
                        "frozen values; points start them there"
                    )
            points.append(point)
        return parse_points(space, points, {name: frozen[name] for name in added})
    except ValueError as error:
        raise ConfigError(f"sweep stage '{stage.name}': {error}") from None


def _check_bohb(bohb: BohbSpec) -> None:
    for key, ok, allowed in (
        ("random_fraction", 0 <= bohb.random_fraction <= 1, "in [0, 1]"),
        ("bandwidth_factor", bohb.bandwidth_factor > 0, "> 0"),
        ("top_n_percent", 0 < bohb.top_n_percent < 100, "in (0, 100)"),
        ("num_samples", bohb.num_samples >= 1, ">= 1"),
        ("min_bandwidth", bohb.min_bandwidth > 0, "> 0"),
    ):
        _check(ok, f"sweep.bohb.{key} must be {allowed}, got {getattr(bohb, key)}")


def validate_spec(spec: SweepSpec, run_values: dict[str, Any], custom_trainable: bool) -> None:
    """Cross-field checks; `run_values` is the run config, flat ({dotted key: value})."""
    _check(spec.mode in ("min", "max"), f"sweep.mode must be min or max, got {spec.mode!r}")
    _check(bool(spec.stages), f"sweep '{spec.name}' has no stages")
    if custom_trainable:
        _check(bool(spec.metric), "sweep.metric must name a metric your function reports")
    else:
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
    # the sweep-wide defaults, also where every stage names its own (a typo is still a typo)
    _check(
        spec.search in SEARCHES,
        f"sweep.search must be one of {', '.join(SEARCHES)}, got {spec.search!r}",
    )
    _check(
        spec.scheduler in SCHEDULERS,
        f"sweep.scheduler must be one of {', '.join(SCHEDULERS)}, got {spec.scheduler!r}",
    )
    _check(spec.seed >= 0, f"sweep.seed must be >= 0, got {spec.seed}")
    _check(spec.confirm_seeds >= 0, f"sweep.confirm_seeds must be >= 0, got {spec.confirm_seeds}")
    _check(
        spec.penalty is None or math.isfinite(spec.penalty),
        f"sweep.penalty must be a finite number or null, got {spec.penalty}",
    )
    budgets = [
        k for k in ("tokens_per_trial", "flops_per_trial") if getattr(spec.budget, k) is not None
    ]
    if not custom_trainable:
        _check(
            len(budgets) == 1,
            "set exactly one of sweep.budget.tokens_per_trial, "
            f"sweep.budget.flops_per_trial; got {', '.join(budgets) or 'none'}",
        )
    for key in budgets:
        value = getattr(spec.budget, key)
        _check(value > 0 and math.isfinite(value), f"sweep.budget.{key} must be > 0, got {value}")
    for key in ("max_trials", "max_flops", "max_seconds", "concurrency"):
        value = getattr(spec, key)
        _check(value is None or value > 0, f"sweep.{key} must be > 0, got {value}")
    _check(spec.cpus_per_trial > 0, f"sweep.cpus_per_trial must be > 0, got {spec.cpus_per_trial}")
    _check(
        spec.gpus_per_trial >= 0, f"sweep.gpus_per_trial must be >= 0, got {spec.gpus_per_trial}"
    )
    _check(
        spec.reports_per_trial >= 1,
        f"sweep.reports_per_trial must be >= 1, got {spec.reports_per_trial}",
    )
    _check(
        0 < spec.grace_fraction <= 1,
        f"sweep.grace_fraction must be in (0, 1], got {spec.grace_fraction}",
    )
    _check(
        spec.reduction_factor > 1,
        f"sweep.reduction_factor must be > 1, got {spec.reduction_factor}",
    )
    _check(
        spec.rung_cooldown is None or 0 <= spec.rung_cooldown <= 1,
        f"sweep.rung_cooldown must be in [0, 1] or null, got {spec.rung_cooldown}",
    )
    _check(
        not spec.rung_cooldown or (not custom_trainable and spec.metric == "val_bpb"),
        "sweep.rung_cooldown forks sweeper's own training and scores val_bpb; "
        f"got {'a custom trainable' if custom_trainable else f'sweep.metric={spec.metric}'}",
    )
    _check(
        spec.brackets is None or spec.brackets >= 1,
        f"sweep.brackets must be >= 1 or null, got {spec.brackets}",
    )
    _check_bohb(spec.bohb)
    if not custom_trainable:
        for key in spec.lr_keys:  # a typo would leave that LR behind when the batch changes
            _check(key in run_values, f"sweep.lr_keys: unknown config key '{key}'")
    _check(spec.max_failures >= 0, "sweep.max_failures must be >= 0")
    names = [s.name for s in spec.stages]
    _check(len(set(names)) == len(names), f"sweep stage names must be unique, got {names}")
    for index, name in enumerate(names):  # each names files: stage_<name>.png, ray/stage0_<name>
        _check(
            bool(re.fullmatch(r"[A-Za-z0-9_.-]+", str(name))) and name not in (".", ".."),
            f"sweep.stages.{index}.name={name!r}: a stage's name names its files; use "
            "letters, digits, _ . and -",
        )
    _check(
        bool(re.fullmatch(r"[A-Za-z0-9_.-]+", str(spec.name))),
        f"sweep.name={spec.name!r}: use letters, digits, _ . and - (it names the sweep in "
        "MLflow, where sweeper.compare looks it up)",
    )
    for index, stage in enumerate(spec.stages):
        where = f"sweep stage '{stage.name}'"
        _check(
            stage.num_samples >= 1, f"{where}: num_samples must be >= 1, got {stage.num_samples}"
        )
        _check(
            stage.lr_rule in LR_RULES,
            f"{where}: lr_rule must be one of {', '.join(LR_RULES)}, got {stage.lr_rule!r}",
        )
        _check(stage.retune_factor > 1, f"{where}: retune_factor must be > 1")
        _check(
            stage.extend_trials >= 0,
            f"{where}: extend_trials must be >= 0, got {stage.extend_trials}",
        )
        _check(
            stage.reports_per_trial is None or stage.reports_per_trial >= 1,
            f"{where}: reports_per_trial must be >= 1 or null, got {stage.reports_per_trial}",
        )
        if not custom_trainable:
            for key in flatten_params(stage.params):
                _check(key in run_values, f"{where}: unknown config key '{key}' in params")
        # retune bands are continuous: check with a stand-in frozen value for every LR key
        if stage.lr_rule == "retune" and spec.stage_search(stage) == "grid":
            has_grid = any(p.kind == "grid" for p in stage_space(spec, stage).params)
            # random search runs grid values and samples bands; the model-based ones only sample
            fix = "random" if has_grid else "tpe (or random)"
            raise ConfigError(
                f"{where}: lr_rule=retune searches a band around each frozen LR, which search "
                f"'grid' cannot sample; use sweep.stages.{index}.search={fix}"
            )
        frozen = dict.fromkeys(spec.lr_keys, 1e-3)
        space = stage_space(spec, stage, frozen)
        try:
            check_compatible(spec.stage_search(stage), spec.stage_scheduler(stage), space)
            check_reduction_factor(spec.stage_scheduler(stage), spec.reduction_factor)
        except ValueError as error:
            raise ConfigError(f"{where}: {error}") from None
        if stage.points:
            _check(
                spec.stage_search(stage) != "grid"
                and not any(p.kind == "grid" for p in space.params),
                f"{where}: points need a sampled space; a grid already runs every value",
            )
            _check(
                len(stage.points) <= stage.num_samples,
                f"{where}: {len(stage.points)} points but num_samples={stage.num_samples}",
            )
            # a `base` point is checked against the composed config; a later stage's base
            # is only known once the stages before it have run, and is checked again then
            stage_points(spec, stage, frozen, base_values=run_values)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


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
