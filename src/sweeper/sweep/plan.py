"""The plan of a sweep: its validated definition, the config every trial starts from, and
what each stage derives from them (its space, its points, its scheduler's clock and rungs).

`preflight.build_plan(cfg)` makes it once, from the composed config, with every check done;
everything downstream is handed the plan and re-validates nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sweeper.config.errors import ConfigError
from sweeper.config.sweep import StageSpec, SweepSpec, flatten, flatten_params
from sweeper.sweep.algorithms import metric_reader
from sweeper.sweep.rungs import rungs
from sweeper.sweep.space import (
    Space,
    SpaceError,
    grid_size,
    is_pure_grid,
    narrow_log_band,
    parse_points,
    parse_space,
)
from sweeper.sweep.stages import get_dotted
from sweeper.sweep.trainable import TrialContext, batch_of

BASE_POINT = "base"  # a point that stands for the config the stage starts from


@dataclass(frozen=True)
class SweepPlan:
    """A validated sweep: `spec` with every stage's search, scheduler and reports filled in
    from the sweep's defaults; `base`, the plain run config every trial starts from (the
    sweep's budget written in); `target`, the user's function, or None for sweeper's own
    training; `definition`, what made the trials, which a resume must match."""

    spec: SweepSpec
    base: dict
    target: str | None = None
    definition: dict = field(default_factory=dict)
    ray: dict = field(default_factory=dict)
    mlflow: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)

    @property
    def stages(self) -> list[StageSpec]:
        return self.spec.stages

    @property
    def workers(self) -> int:
        """DDP ranks of each trial (a user's function runs as one process)."""
        return 1 if self.target else int(self.base["trainer"]["workers"])

    @property
    def joins_a_cluster(self) -> bool:
        return bool(self.ray.get("address"))

    @property
    def penalty(self) -> float:
        """What a diverged trial reports to the searcher in place of its NaN: worse than any
        trial that learned something, in the metric's own unit."""
        spec = self.spec
        if spec.penalty is not None:
            return float(spec.penalty)
        worst = 1e9 if spec.mode == "min" else -1e9
        if self.target:
            return worst
        data = self.base["data"]
        if spec.metric == "val_bpb":  # a uniform guess over the vocabulary, in bits per byte
            return math.log2(data["vocab_size"]) / (data.get("bytes_per_token") or 1.0)
        if spec.metric == "train_loss":  # the same guess in nats per token
            return math.log(data["vocab_size"])
        return 0.0 if spec.mode == "max" else worst  # tokens_per_s: nothing worth its speed

    def frozen_lrs(self, base: dict) -> dict:
        """The LRs of sweep.lr_keys that `base` holds: what lr_rule=retune bands centre on."""
        frozen = {key: get_dotted(base, key) for key in self.spec.lr_keys}
        return {key: value for key, value in frozen.items() if value is not None}

    def space(self, stage: StageSpec, frozen: dict[str, Any] | None = None) -> Space:
        """The stage's search space; lr_rule=retune adds a narrow band around each frozen LR."""
        params = flatten_params(stage.params)
        if stage.lr_rule == "retune":
            for key in self.spec.lr_keys:
                if frozen and key in frozen and key not in params:
                    params[key] = narrow_log_band(float(frozen[key]), stage.retune_factor)
        try:
            return parse_space(params)
        except ValueError as error:
            raise ConfigError(f"sweep stage '{stage.name}': {error}") from None

    def points(
        self,
        stage: StageSpec,
        frozen: dict[str, Any] | None = None,
        base_values: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """The stage's `points`, flat, complete and checked against its space. A point
        `base` takes each searched param's value in `base_values` (by default `frozen`, the
        flat config the stage starts from). lr_rule=retune bands are not the user's to set:
        a point starts each from its frozen value, the centre of its band."""
        frozen = frozen or {}
        base_values = frozen if base_values is None else base_values
        space = self.space(stage, frozen)
        declared = set(flatten_params(stage.params))
        added = [name for name in space.names if name not in declared]
        try:
            points = [
                _point(number, point, space, added, base_values)
                for number, point in enumerate(stage.points, start=1)
            ]
            return parse_points(space, points, {name: frozen[name] for name in added})
        except ValueError as error:
            raise ConfigError(f"sweep stage '{stage.name}': {error}") from None

    def planned_trials(self, stage: StageSpec, base: dict) -> int:
        """Trials a stage launches: every point of a grid, else its num_samples draws, each
        at every point of the grid params a random search holds beside sampled ones."""
        space = self.space(stage, flatten(base))
        grid = stage.search == "grid" or is_pure_grid(space)
        return grid_size(space) if grid else stage.num_samples * grid_size(space)

    def stage_base(self, stage: StageSpec, base: dict) -> dict:
        """`base` with its runs evaluating (and reporting) the stage's reports_per_trial
        times; a user's function reports when it likes, and keeps its config."""
        if self.target or base["trainer"].get("num_evals") == stage.reports_per_trial:
            return base
        return {**base, "trainer": {**base["trainer"], "num_evals": stage.reports_per_trial}}

    def time_axis(self, stage: StageSpec) -> tuple[str, float]:
        """ASHA/HyperBand's clock: tokens or FLOPs (compute, so that batch sizes compare
        fairly), or the report count for a user's function without a compute budget."""
        budget = self.spec.budget
        if budget.tokens_per_trial:
            return "tokens", float(budget.tokens_per_trial)
        if budget.flops_per_trial:
            return "flops", float(budget.flops_per_trial)
        return "training_iteration", float(stage.reports_per_trial)

    def rung_fractions(self, stage: StageSpec) -> tuple[float, ...]:
        """Where the stage's scheduler ranks trials, as fractions of a trial's budget."""
        _, max_t = self.time_axis(stage)
        grace = max_t * self.spec.grace_fraction
        return tuple(
            t / max_t for t in rungs(stage.scheduler, max_t, grace, self.spec.reduction_factor)
        )

    def trial_context(
        self, stage: StageSpec, base: dict, storage: str | None = None
    ) -> TrialContext:
        """What every trial of `stage`, started from `base`, is told on its worker."""
        spec = self.spec
        return TrialContext(
            metric=spec.metric,
            penalty=self.penalty,
            target=self.target,
            lr_rule=stage.lr_rule,
            base_batch=batch_of(base),
            lr_keys=tuple(spec.lr_keys),
            # paused (Hyperband/BOHB) and retried trials resume from their last report
            checkpoint=stage.scheduler in ("hyperband", "bohb") or spec.max_failures > 0,
            threads=spec.trial_threads,
            gpus=spec.gpus_per_trial,
            sampled=tuple(self.space(stage, flatten(base)).names),
            storage=storage,
            # trials evaluate at the rungs (a user's function reports where it likes)
            rungs=() if self.target else self.rung_fractions(stage),
            rung_cooldown=spec.rung_cooldown,
            metric_read_by=metric_reader(stage.search, stage.scheduler),
            stall_seconds=spec.stall_seconds,
        )


def _point(number: int, point: Any, space: Space, added: list[str], base_values: dict) -> Any:
    """One of a stage's points as a flat {param: value}: `base` read from `base_values`."""
    if point == BASE_POINT:
        own = [name for name in space.names if name not in added]
        lacking = [name for name in own if name not in base_values]
        if lacking:
            raise SpaceError(f"sweep point {number}: base has no value for {lacking}")
        return {name: base_values[name] for name in own}
    if isinstance(point, dict):
        point = flatten(point)
        named = [key for key in point if key in added]
        if named:
            raise SpaceError(
                f"sweep point {number}: {named} are lr_rule=retune bands around the frozen "
                "values; points start them there"
            )
    return point
