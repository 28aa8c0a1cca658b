"""The sweep search-space DSL: typed parameter specs and pure translators to each backend.

A stage's ``params`` block maps a dotted config key to a spec::

    optimizer.matrix_lr: {log_uniform: [1.0e-3, 1.0e-1]}   # float, log scale, low > 0
    optimizer.warmup:    {uniform: [0.0, 0.1]}             # float
    model.n_layer:       {int: [2, 6]}                     # integer, both bounds inclusive
    model.d_model:       {log_int: [64, 512]}              # integer, log scale, inclusive
    optimizer.name:      {choice: [adamw, muon]}           # categorical, sampled
    data.seed:           {grid: [0, 1, 2]}                 # every value exactly once
    train.dropout:       0.0                               # fixed value, not searched

Every bound is inclusive in every backend; the translators below absorb each library's own
convention (Tune's integer upper bound is exclusive, Optuna's and ConfigSpace's are not).
Ray, Optuna and ConfigSpace are imported inside the translators so this module imports fast.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sweeper.config.sweep import KINDS, LIST_KINDS, RANGE_KINDS

LOG_KINDS = frozenset({"log_uniform", "log_int"})
INT_KINDS = frozenset({"int", "log_int"})


class SpaceError(ValueError):
    """A sweep ``params`` block that cannot be turned into a search space."""


@dataclass(frozen=True)
class ParamSpec:
    """One searched parameter. ``low``/``high`` for range kinds, ``values`` for list kinds."""

    name: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    values: tuple[Any, ...] = ()

    @property
    def log(self) -> bool:
        return self.kind in LOG_KINDS

    @property
    def integer(self) -> bool:
        return self.kind in INT_KINDS


@dataclass(frozen=True)
class Space:
    """Searched params in declaration order, plus the fixed (not searched) values."""

    params: tuple[ParamSpec, ...]
    fixed: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


def _fail(name: object, message: str) -> SpaceError:
    return SpaceError(f"sweep param {name!r}: {message}")


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _shown(value: object) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _parse_bounds(name: str, kind: str, bounds: object) -> tuple[float | int, float | int]:
    if not isinstance(bounds, (list, tuple)) or len(bounds) != 2:
        raise _fail(name, f"{kind} needs [low, high], got {_shown(bounds)}")
    if not all(_is_number(b) for b in bounds):
        raise _fail(name, f"{kind} needs numeric bounds, got {_shown(bounds)}")
    if not all(math.isfinite(b) for b in bounds):
        raise _fail(name, f"{kind} needs finite bounds, got {_shown(bounds)}")
    if kind in INT_KINDS and not all(isinstance(b, numbers.Integral) for b in bounds):
        raise _fail(name, f"{kind} needs integer bounds, got {_shown(bounds)}")
    low, high = bounds
    if kind in LOG_KINDS and not 0 < low < high:
        raise _fail(name, f"{kind} needs 0 < low < high, got {_shown(bounds)}")
    if not low < high:
        raise _fail(name, f"{kind} needs low < high, got {_shown(bounds)}")
    if kind in INT_KINDS:
        return int(low), int(high)
    return float(low), float(high)


def _parse_values(name: str, kind: str, values: object) -> tuple[Any, ...]:
    if not isinstance(values, (list, tuple)) or not values:
        raise _fail(name, f"{kind} needs a non-empty list of values, got {_shown(values)}")
    for value in values:
        # Optuna's CategoricalDistribution and ConfigSpace only take scalars; keep every
        # backend able to express every spec.
        if not _is_scalar(value):
            raise _fail(name, f"{kind} values must be scalars, got {value!r}")
    for i, value in enumerate(values):
        # Equality, not hashing: ConfigSpace also treats 1, 1.0 and True as the same choice.
        if any(value == earlier for earlier in values[:i]):
            raise _fail(name, f"{kind} has duplicate value {value!r} in {_shown(values)}")
    return tuple(values)


def parse_param(name: str, spec: Mapping[Any, Any]) -> ParamSpec:
    """Parse one ``{kind: args}`` mapping into a :class:`ParamSpec`."""
    unknown = [k for k in spec if k not in KINDS]
    if unknown:
        raise _fail(name, f"unknown spec key(s) {unknown}; expected one of {list(KINDS)}")
    kinds = list(spec)
    if len(kinds) != 1:
        hint = (
            f" (to change a stage's param on the command line, remove its old kind: "
            f"~sweep.stages.N.params.{name}.{kinds[0]})"
            if kinds
            else ""
        )
        raise _fail(name, f"a spec needs exactly one kind of {list(KINDS)}, got {kinds}{hint}")
    kind = kinds[0]
    if kind in RANGE_KINDS:
        low, high = _parse_bounds(name, kind, spec[kind])
        return ParamSpec(name=name, kind=kind, low=low, high=high)
    return ParamSpec(name=name, kind=kind, values=_parse_values(name, kind, spec[kind]))


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise _fail(name, "param names must be non-empty strings")
    # Ray's Optuna and BOHB searchers split suggested keys on '/' into nested dicts, which
    # would silently move the value away from the dotted key the trainable looks up.
    if "/" in name:
        raise _fail(name, "param names are dotted config keys and must not contain '/'")
    return name


def parse_space(params: Mapping[str, Any]) -> Space:
    """Parse a stage's ``params`` mapping; raise :class:`SpaceError` naming the bad param."""
    if not isinstance(params, Mapping):
        raise SpaceError(f"sweep params must be a mapping of key -> spec, got {params!r}")
    specs: list[ParamSpec] = []
    fixed: dict[str, Any] = {}
    for raw_name, spec in params.items():
        name = _check_name(raw_name)
        if isinstance(spec, Mapping):
            specs.append(parse_param(name, spec))
        elif _is_scalar(spec):
            fixed[name] = spec
        else:
            raise _fail(
                name, f"expected a spec such as {{choice: [...]}} or a scalar, got {spec!r}"
            )
    if not specs:
        raise SpaceError(f"sweep params: nothing to search, only fixed values {sorted(fixed)}")
    return Space(params=tuple(specs), fixed=fixed)


def _check_point_value(param: ParamSpec, value: object) -> str | None:
    """Why `value` is not a value `param` can take (None: it is)."""
    if param.kind in LIST_KINDS:
        ok = any(value == allowed for allowed in param.values)
        return None if ok else f"is not one of {_shown(param.values)}"
    if not _is_number(value):
        return "is not a number"
    if param.integer and value != int(value):
        return "is not an integer"
    if not param.low <= value <= param.high:
        return f"is outside {param.kind} [{param.low}, {param.high}]"
    return None


def parse_points(
    space: Space, points: object, fill: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Configurations to try first, checked against the space: each a flat
    ``{dotted name: value}`` with a value inside its param's spec for every searched param.
    ``fill`` gives the values of params a point may leave out (a retune band's frozen LR).
    Every searcher gets the same complete points: Tune's and Optuna's would sample a
    missing value, BOHB would hand an incomplete configuration to its model."""
    if not isinstance(points, (list, tuple)):
        raise SpaceError(f"sweep points must be a list of {{param: value}}, got {points!r}")
    fill = fill or {}
    by_name = {p.name: p for p in space.params}
    parsed = []
    for number, point in enumerate(points, start=1):
        where = f"sweep point {number}"
        if not isinstance(point, Mapping):
            raise SpaceError(f"{where}: expected {{param: value}} or base, got {point!r}")
        unknown = [key for key in point if key not in by_name]
        if unknown:
            raise SpaceError(
                f"{where}: {unknown} not searched in this stage (its params: {list(by_name)})"
            )
        missing = [name for name in by_name if name not in point and name not in fill]
        if missing:
            raise SpaceError(f"{where}: no value for {missing}")
        complete = {}
        for name, param in by_name.items():
            value = point[name] if name in point else fill[name]
            problem = _check_point_value(param, value)
            if problem:
                raise SpaceError(f"{where}: {name}={value!r} {problem}")
            if param.kind in RANGE_KINDS:  # 1 for a float param, 4.0 for an int one
                value = int(value) if param.integer else float(value)
            complete[name] = value
        parsed.append(complete)
    return parsed


def bounding_values(param: ParamSpec) -> list[Any]:
    """Every value of a list kind, else a range's two ends (integers as integers): the
    values that bound what a param can do to a run (its cost, its validity)."""
    if param.values:
        return list(param.values)
    return [int(v) if param.integer else v for v in (param.low, param.high)]


def grid_size(space: Space) -> int:
    """Number of grid points: the product of the grid value counts (1 without grid params)."""
    return math.prod(len(p.values) for p in space.params if p.kind == "grid")


def is_pure_grid(space: Space) -> bool:
    """True when every searched param is a ``grid`` spec (fully enumerable, no sampling)."""
    return all(p.kind == "grid" for p in space.params)


def narrow_log_band(value: float, factor: float) -> dict[str, list[float]]:
    """A log-uniform spec spanning ``[value / factor, value * factor]`` around a frozen value."""
    if not _is_number(value) or not value > 0:
        raise SpaceError(f"narrow_log_band needs a value > 0, got {value!r}")
    if not _is_number(factor) or not factor > 1:
        raise SpaceError(f"narrow_log_band needs a factor > 1, got {factor!r}")
    return {"log_uniform": [value / factor, value * factor]}


# A best value this close to a bound, as a share of the range on the spec's own scale, is
# flagged: with a stage's handful of trials, the optimum may lie outside the range.
EDGE_FRACTION = 0.1


def range_edge(param: ParamSpec, value: Any, fraction: float = EDGE_FRACTION) -> str | None:
    """'low' or 'high' when `value` sits at that end of `param`'s range: within `fraction`
    of the range from a bound (log scale for log kinds), or the smallest or largest of
    three or more numeric grid/choice values. None inside the range, for categorical values,
    and for two-value lists (where every winner is an end)."""
    if not _is_number(value):
        return None
    if param.kind in LIST_KINDS:
        values = param.values
        if len(values) < 3 or not all(_is_number(v) for v in values):
            return None
        return "low" if value == min(values) else "high" if value == max(values) else None
    scale = math.log if param.log else float
    low, high = scale(param.low), scale(param.high)
    position = (scale(value) - low) / (high - low)
    return "low" if position <= fraction else "high" if position >= 1 - fraction else None


# A stage whose best sat at an end of its range searches next this share of the range's
# width past that end (on the spec's own scale): far enough to find a better value nearby,
# not so far that a handful of trials spreads too thin to find it.
EXTEND_FRACTION = 0.5


def extended_range(
    param: ParamSpec, side: str, fraction: float = EXTEND_FRACTION
) -> ParamSpec | None:
    """The range just past `param`'s `side` end ('low' or 'high'), `fraction` of its width
    wide on its own scale; None where nothing lies past that end. List kinds have no range
    to extend. An integer range starts one step past the end (the end itself was tried) and
    holds two values at least. A linear range of values >= 0 stays >= 0 (a weight decay or
    a warm-up below 0 means nothing)."""
    if param.kind in LIST_KINDS:
        return None
    if param.log:
        ratio = (param.high / param.low) ** fraction
        below, above = param.low / ratio, param.high * ratio
    else:
        width = (param.high - param.low) * fraction
        below, above = param.low - width, param.high + width
    low, high = (param.high, above) if side == "high" else (below, param.low)
    if param.integer:  # two values at least (a range needs low < high)
        if side == "high":
            low, high = param.high + 1, max(math.floor(high), param.high + 2)
        else:
            low, high = min(math.ceil(low), param.low - 2), param.low - 1
    if param.log or param.low >= 0:
        low = max(low, (1 if param.log else 0) if param.integer else 0.0)
    if low >= high:
        return None
    return replace(param, low=low, high=high)


def extended_values(param: ParamSpec, side: str, count: int) -> ParamSpec | None:
    """The next `count` values past the `side` end ('low' or 'high') of a numeric grid or
    choice, nearest first, continuing its spacing: equal steps go on by that step (1, 2, 3
    -> 4, 5); positive values otherwise by the ratio of the two values nearest that end
    (batch sizes 4096, 8192, 16384 -> 2048, 1024 below; floats to 3 significant digits,
    `_round_past`). An integer list stays integer, without repeats; values that were all
    >= 0 stay >= 0, and a ratio's stay > 0 (>= 1 for integers). None where nothing lies
    past that end."""
    values = sorted(param.values) if all(_is_number(v) for v in param.values) else []
    if count < 1 or len(values) < 2:
        return None
    integer = all(isinstance(v, numbers.Integral) for v in values)
    end, near = (values[0], values[1]) if side == "low" else (values[-1], values[-2])
    steps = [b - a for a, b in zip(values, values[1:], strict=False)]
    equal_steps = all(math.isclose(d, steps[0], rel_tol=1e-9) for d in steps)
    by_ratio = values[0] > 0 and not equal_steps
    new: list = []
    for k in range(1, count + 1):
        value = end * (end / near) ** k if by_ratio else end + k * (end - near)
        if integer:
            value = round(value)
        elif by_ratio:  # 8.53, not 8.5333333333 from 0.16 * 0.16 / 0.003
            value = _round_past(value, new[-1] if new else end)
        else:  # equal steps keep the list's own digits, less the last bits' noise (0.3)
            value = float(f"{value:.12g}")
        if by_ratio:  # a ratio keeps values > 0, but an integer can round down to 0
            allowed = value >= 1 if integer else value > 0
        else:  # a list of values >= 0 (a weight decay, a warm-up) stays >= 0
            allowed = value >= 0 or values[0] < 0
        if not allowed or value in values or value in new:
            break
        new.append(value)
    return replace(param, values=tuple(new)) if new else None


def _round_past(value: float, previous: float) -> float:
    """`value` to 3 significant digits, as a person writes a grid's next value, or to as
    many more as keep it within a twentieth of its step from `previous` (a ratio near 1:
    1.0005 after 1.0003, not 1.0 or 1.001)."""
    for digits in range(3, 13):
        rounded = float(f"{value:.{digits}g}")
        if abs(rounded - value) <= abs(value - previous) / 20:
            return rounded
    return value


def _refuse_grid(param: ParamSpec, backend: str) -> None:
    if param.kind == "grid":
        raise _fail(param.name, f"grid values cannot be sampled by {backend}; use choice")


def to_tune(space: Space) -> dict[str, Any]:
    """Flat ``{dotted name: ray.tune domain}`` for the searched params (fixed ones excluded)."""
    from ray import tune

    def domain(p: ParamSpec) -> Any:
        if p.kind == "choice":
            return tune.choice(list(p.values))
        if p.kind == "grid":
            return tune.grid_search(list(p.values))
        if p.integer:  # Tune's randint/lograndint exclude their upper bound; the DSL includes it
            return (tune.lograndint if p.log else tune.randint)(p.low, p.high + 1)
        return (tune.loguniform if p.log else tune.uniform)(p.low, p.high)

    return {p.name: domain(p) for p in space.params}


def to_optuna(space: Space) -> dict[str, Any]:
    """Flat ``{dotted name: optuna distribution}``; Optuna's int ``high`` is inclusive."""
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    def distribution(p: ParamSpec) -> Any:
        _refuse_grid(p, "optuna")
        if p.kind == "choice":
            return CategoricalDistribution(list(p.values))
        if p.integer:
            return IntDistribution(p.low, p.high, log=p.log)
        return FloatDistribution(p.low, p.high, log=p.log)

    return {p.name: distribution(p) for p in space.params}


def to_configspace(space: Space, seed: int | None = None) -> Any:
    """A ``ConfigSpace.ConfigurationSpace`` with the same (inclusive) bounds. ConfigSpace
    hands '.' in names back unchanged, so dotted keys need no encoding (tests/test_space.py)."""
    import ConfigSpace as CS

    def hyperparameter(p: ParamSpec) -> Any:
        _refuse_grid(p, "ConfigSpace/BOHB")
        if p.kind == "choice":
            return CS.CategoricalHyperparameter(p.name, list(p.values))
        if p.integer:
            return CS.UniformIntegerHyperparameter(p.name, p.low, p.high, log=p.log)
        return CS.UniformFloatHyperparameter(p.name, p.low, p.high, log=p.log)

    config_space = CS.ConfigurationSpace(seed=seed)
    config_space.add([hyperparameter(p) for p in space.params])
    return config_space


def to_builtin(value: Any) -> Any:
    """Numpy scalars (``np.int64``, ``np.str_``, ...) as Python builtins, recursively through
    dicts, lists and tuples: Tune's domains and BOHB hand them back, and OmegaConf refuses them."""
    if isinstance(value, Mapping):
        return {k: to_builtin(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_builtin(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item()
    return value
