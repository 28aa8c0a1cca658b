"""Declared constraints of config fields: the choices a field takes and the range a number
lies in, written beside the field and checked by one walker, `check_fields`.

    device: str = choice("auto", ("auto", "cpu", "cuda"))
    depth: int = bounded(4, ge=1)
    warmup_ratio: float = bounded(0.0, ge=0, le=1)

OmegaConf checks the types; cross-field rules stay in each dataclass's __post_init__.
"""

from __future__ import annotations

import math
import operator
from dataclasses import field, fields, is_dataclass
from typing import Any

from sweeper.config.errors import ConfigError

COMPARISONS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


def choice(default: Any, options: tuple) -> Any:
    return field(default=default, metadata={"choices": options})


def bounded(default: Any, **bounds: float) -> Any:
    """A number within `bounds` (ge, gt, le, lt); None passes where it is the default."""
    assert set(bounds) <= set(COMPARISONS), bounds
    return field(default=default, metadata=bounds)


def range_text(bounds: dict) -> str:
    """'> 0', '>= 1', 'in [0, 1]', 'in (0, 1]', as the errors write a range."""
    low = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds["gt"]) if "gt" in bounds else None
    high = (
        ("]", bounds["le"]) if "le" in bounds else (")", bounds["lt"]) if "lt" in bounds else None
    )
    if low and high:
        return f"in {low[0]}{number(low[1])}, {number(high[1])}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {number(low[1])}"
    return f"{'<=' if high[0] == ']' else '<'} {number(high[1])}"


def number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"  # 2147483647, not 2.1e+09


def within(value: float, bounds: dict) -> bool:
    return all(COMPARISONS[op](value, bound) for op, bound in bounds.items())


def check_fields(schema: type, values: dict, prefix: str) -> None:
    """Every field of `values` (the plain values of a `schema` dataclass, nested ones too)
    against its declared choices and range, and every float for being finite: inf passes
    `> 0` and fails deep inside a run."""
    for spec in fields(schema):
        value, key = values.get(spec.name), f"{prefix}{spec.name}"
        if is_dataclass(spec.default_factory) and isinstance(value, dict):
            check_fields(spec.default_factory, value, f"{key}.")
            continue
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
        options = spec.metadata.get("choices")
        if options is not None and value not in options:
            shown = ", ".join(map(str, options))
            raise ConfigError(f"{key} must be one of {shown}, got {value!r}")
        bounds = {k: spec.metadata[k] for k in COMPARISONS if k in spec.metadata}
        if bounds and isinstance(value, int | float) and not within(value, bounds):
            raise ConfigError(f"{key} must be {range_text(bounds)}, got {value}")
