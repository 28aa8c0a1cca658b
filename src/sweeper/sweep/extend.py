"""A best value at the end of its range, and the stage's round past it (`extend_trials`).

A best at an end of its range says the optimum may lie beyond it (`range_edges` names the
override that widens it). With `sweep.stages.N.extend_trials`, the stage looks itself: N
more trials search only the params at an end, in the range just past it (half its width
further; for a grid or choice, the next values by its spacing), the others at the best.
The stage's best is then the best of both rounds.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import time

from sweeper.config.errors import ConfigError
from sweeper.config.schema import BUDGET_KEYS, load_run_config
from sweeper.config.sweep import StageSpec, flatten, flatten_params
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.space import (
    LIST_KINDS,
    ParamSpec,
    extended_range,
    extended_values,
    parse_space,
    range_edge,
)
from sweeper.sweep.stages import sweep_run
from sweeper.sweep.state import SweepState, spent_flops
from sweeper.text import float_text, rounded_text
from sweeper.train.budget import check_budget

EXPERIMENT_SUFFIX = "_extended"  # the round's Ray Tune experiment: stage{i}_{name}_extended


def plan_round(
    plan: SweepPlan,
    stage: StageSpec,
    start: dict,
    after: dict,
    edges: list[dict],
    records: list[dict],
    state: SweepState,
    started: float,
) -> tuple[StageSpec | None, float]:
    """The round to run (None: none) and the FLOPs the stage's first round spent. Says
    why an end is not searched past, and when the sweep's caps leave no room for it."""
    spec, own_trainable = plan.spec, not plan.target
    searched = searched_params(plan, stage.name, start)
    trials = stage.extend_trials
    if spec.max_trials is not None:
        trials = min(trials, spec.max_trials - state.trial_count() - len(records))
    ranges, skipped = extension_ranges(stage, searched, edges, after, own_trainable, max(trials, 1))
    for line in skipped:
        print(f"[{stage.name}] {line}")
    spent = spent_flops(records)
    over_time = spec.max_seconds is not None and time.time() - started >= spec.max_seconds
    over_flops = state.total_flops() + spent >= (spec.max_flops or math.inf)
    if not ranges:
        return None, spent
    if trials <= 0 or over_time or over_flops:
        print(f"[{stage.name}] no round past the end of its range: the sweep's cap is reached")
        return None, spent
    # a grid trains every point of it (a random search, at each draw): as many new values
    # per grid param as `trials` holds
    grids = [n for n, p in ranges.items() if p.kind == "grid"]
    per_param = max(math.floor(trials ** (1 / max(len(grids), 1)) + 1e-9), 1)
    for n in grids:
        ranges[n] = dataclasses.replace(ranges[n], values=ranges[n].values[:per_param])
    points = math.prod(len(ranges[n].values) for n in grids)
    round_two = extension_stage(stage, ranges, max(trials // points, 1))
    shown = ", ".join(
        f"{n} {'at' if p.kind in LIST_KINDS else 'in'} {_span_text(p)}" for n, p in ranges.items()
    )
    planned = plan.planned_trials(round_two, after)
    print(
        f"[{stage.name}] its best sits at an end of its range: {planned} more "
        f"trial{'s' if planned != 1 else ''} past it, {shown}, the other params at the best"
    )
    return round_two, spent


def extension_ranges(
    stage: StageSpec,
    searched: list[ParamSpec],
    edges: list[dict],
    after: dict,
    own_trainable: bool,
    count: int = 1,
) -> tuple[dict[str, ParamSpec], list[str]]:
    """The ranges to search past each end in `edges` (range_edges of the stage), `count`
    new values for a grid or choice, and a line for each end that cannot be searched past.
    `after` is the config with the stage's best frozen in: the next round's base. Only the
    stage's own declared params extend; an lr_rule=retune band's note already says to widen
    it with retune_factor."""
    declared = set(flatten_params(stage.params))
    by_name = {p.name: p for p in searched}
    ranges, skipped = {}, []
    for edge in edges:
        name, side = edge["param"], edge["side"]
        param = by_name.get(name)
        if name not in declared or param is None:
            continue
        # range_edges leaves out ends with nothing past them (`nothing_past`)
        if param.kind in LIST_KINDS:
            wider = extended_values(param, side, count)
        else:
            wider = extended_range(param, side)
        problem = None
        if own_trainable:
            wider, problem = valid_part(after, wider)
        if wider is None:
            skipped.append(f"cannot search past the {side} end of {name}: {problem}")
            continue
        if problem:  # part of it makes runs: a list's first values, a range up to a bound
            skipped.append(f"past the {side} end of {name}, only {_span_text(wider)}: {problem}")
        ranges[name] = wider
    return ranges, skipped


def _span_text(param: ParamSpec) -> str:
    """[1, 2] of a list, [0.001, 0.01] of a range (4 digits)."""
    if param.kind in LIST_KINDS:
        return str(list(param.values))
    return f"[{param.low:.4g}, {param.high:.4g}]"


def _spec_args(param: ParamSpec) -> list:
    """A list's values, or a range's [low, high], as a sweep file writes them."""
    return list(param.values) if param.kind in LIST_KINDS else [param.low, param.high]


def valid_part(base: dict, param: ParamSpec) -> tuple[ParamSpec | None, str | None]:
    """The part of `param` whose values make valid runs from `base` (an LR at 0 does not), as
    preflight checks declared ranges, and why the rest do not; None and why where none does.
    A list keeps its values up to the first that fails (nearest the end first); a float range
    with one good end is cut where runs end (`_last_run`: a warm-down past 0.8 stops at 1);
    an integer range is kept only whole (batch sizes are no interval: 2049 is no run, 3072 is)."""
    if param.kind in LIST_KINDS:
        for i, value in enumerate(param.values):
            if problem := invalid_run(base, param.name, value):
                kept = dataclasses.replace(param, values=param.values[:i]) if i else None
                return kept, problem
        return param, None
    low_problem = invalid_run(base, param.name, param.low)
    high_problem = invalid_run(base, param.name, param.high)
    if low_problem is None and high_problem is None:
        return param, None
    problem = high_problem or low_problem
    if param.integer or (low_problem and high_problem):
        return None, problem
    if high_problem:
        low, high = param.low, _last_run(base, param, param.low, param.high)
    else:
        low, high = _last_run(base, param, param.high, param.low), param.high
    if low >= high:
        return None, problem
    return dataclasses.replace(param, low=low, high=high), problem


def _last_run(base: dict, param: ParamSpec, run: float, no_run: float) -> float:
    """The value farthest from `run` towards `no_run` that still makes a run, by bisection
    (on the param's own scale): the config's bounds on a float (a ratio <= 1, a warm-up and
    warm-down that sum to at most 1) are thresholds. Then the shortest number near it that
    is still a run, within a thousandth of the range: 1 rather than 0.99999999997."""
    scale, unscale = (math.log, math.exp) if param.log else (float, float)
    good, bad = scale(run), scale(no_run)
    for _ in range(24):  # to 2^-24 of the range: well inside the thousandth kept below
        middle = (good + bad) / 2
        if invalid_run(base, param.name, unscale(middle)):
            bad = middle
        else:
            good = middle
    value, width = unscale(good), abs(scale(no_run) - scale(run))
    for digits in range(1, 17):
        short = float(f"{value:.{digits}g}")
        if abs(scale(short) - good) <= 1e-3 * width and not invalid_run(base, param.name, short):
            return short
    return value


def invalid_run(base: dict, name: str, value) -> str | None:
    """Why `name`=`value` would not make a valid run from `base`; None when it would."""
    try:
        check_budget(load_run_config(sweep_run(base, {name: value})))
    except ConfigError as error:
        return str(error)
    return None


def nothing_past(param: ParamSpec, side: str, start: dict, own_trainable: bool) -> bool:
    """Whether no value lies past `param`'s `side` end: none by the space's own rules (a
    weight decay or warm-up below 0), or, for sweeper's own training, none that makes a run
    from `start` (a batch below one sequence, a warm-up of 0.6 beside a warm-down of 0.4). A
    best value there is the best the param can take, not a sign that the optimum lies
    outside the range."""
    if param.kind in LIST_KINDS:
        past = extended_values(param, side, 1)
        return past is None or bool(
            own_trainable and invalid_run(start, param.name, past.values[0])
        )
    past = extended_range(param, side)
    if past is None or not own_trainable:
        return past is None
    if param.integer:  # its ends are past the end already; no interval (batch 2048 runs, 4095 not)
        return all(invalid_run(start, param.name, end) for end in (past.low, past.high))
    return valid_part(start, past)[0] is None  # a float range: is there more than its end?


def widening_override(
    index: int, declared: dict, param: ParamSpec, side: str, start: dict, own_trainable: bool
) -> str | None:
    """The Hydra override that searches past `param`'s `side` end when the sweep runs
    again: its range widened by what an extend_trials round would search
    (`extended_range`), or its list with the next value past the end (`extended_values`),
    for an end with something past it (not `nothing_past`). None where the widened range
    makes no valid run from `start` (a user's function is not checked: sweeper cannot see
    what it accepts), or where the stage's `declared` params name it by a dotted key
    (`optimizer.matrix_lr:`), which no override can reach."""
    if not _nested(declared, param.name.split(".")):
        return None
    key = f"sweep.stages.{index}.params.{param.name}.{param.kind}"
    if param.kind in LIST_KINDS:
        past = extended_values(param, side, 1)
        if past is None:
            return None
        values = sorted([*param.values, *past.values])
        # the list's values exactly, as the sweep tried them
        exact = (float_text(v) if isinstance(v, float) else str(v) for v in values)
        return f"{key}=[{','.join(exact)}]"
    past, cut = extended_range(param, side), None
    if past is not None and own_trainable:
        past, cut = valid_part(start, past)
    if past is None:
        return None
    low, high = min(param.low, past.low), max(param.high, past.high)
    # 4 digits are enough for a bound, but not for one cut where runs end: it is exact
    text = float_text if cut else rounded_text
    return f"{key}=[{text(low)},{text(high)}]"


def _nested(params: dict, parts: list[str]) -> bool:
    """Whether `params` holds the spec of parts[0].parts[1]... one level per part."""
    level = params.get(parts[0])
    return isinstance(level, dict) and (len(parts) == 1 or _nested(level, parts[1:]))


def extension_stage(stage: StageSpec, ranges: dict[str, ParamSpec], num_samples: int) -> StageSpec:
    """The round as a stage of its own: the same search, scheduler and LR rule, only the
    extended params (a list its new values), no given points, and no further round."""
    params = {name: {p.kind: _spec_args(p)} for name, p in ranges.items()}
    return dataclasses.replace(
        stage, params=params, num_samples=num_samples, points=[], extend_trials=0
    )


def merge_round(records: list[dict], best: dict, extra: list[dict]) -> list[dict]:
    """Both rounds' records, each second-round one completed with the first round's best for
    the params it held fixed, so that every record names a whole point of the space. It also
    keeps `extended_from` (that best) and `round_params` (its own): under an LR rule its LRs
    were scaled twice (start -> the best's batch -> its own), which in floats differs from
    the one scaling its merged params would give (runner.frozen_config)."""
    return records + [
        {
            **r,
            "params": {**best["params"], **r["params"]},
            "extended_from": best["params"],
            "round_params": r["params"],
        }
        for r in extra
    ]


def extended_ranges(round_two: StageSpec) -> dict[str, list]:
    """{param: [low, high]} of the ranges a round searched, {param: [values]} of its lists
    (kept in sweep_state.json)."""
    return {p.name: _spec_args(p) for p in parse_space(round_two.params).params}


# --- best values at the edge of their range --------------------------------------------
def range_edges(
    plan: SweepPlan,
    stage_name: str,
    start: dict,
    best: dict | None,
    extended: dict[str, list] | None = None,
) -> list[dict]:
    """The stage's best values at an end of their range (`range_edge`) with values past it
    (not `nothing_past`), where the optimum may lie outside. `start`: the config the stage
    started from (its retune bands centre on its LRs); `extended`: what an extend_trials
    round added. Each edge's `widen` is the override that searches past it in the next
    sweep (None where none reaches it or the range past it makes no run); its `note` says so."""
    if best is None:
        return []
    own_trainable = not plan.target
    index, stage = _stage_spec(plan, stage_name)
    declared = set(flatten_params(stage.params))
    edges = []
    for param in searched_params(plan, stage_name, start, extended):
        if param.name in COMPUTE_KEYS:
            continue  # more compute trains to a lower loss: its largest value is no optimum
        value = best["params"].get(param.name)
        side = range_edge(param, value)
        if side is None or nothing_past(param, side, start, own_trainable):
            continue
        if param.low is not None:
            scope = f"range [{rounded_text(param.low)}, {rounded_text(param.high)}]"
            hint = "widen the range"
        else:
            scope, hint = f"values {list(param.values)}", "add values beyond it"
        widen = None
        if param.name not in declared:  # an lr_rule=retune band around a frozen LR
            hint = f"raise sweep.stages.{index}.retune_factor ({stage.retune_factor:g})"
        else:
            widen = widening_override(index, stage.params, param, side, start, own_trainable)
        if widen:
            hint += ": " + shlex.quote(widen)  # quoted: zsh refuses an unmatched [...] glob
            # `++`: most sweep files do not set the key, and `+` fails where one does
            if not stage.extend_trials:
                hint += (
                    f" (or ++sweep.stages.{index}.extend_trials=4: the sweep looks there itself)"
                )
        edges.append(
            {
                "param": param.name,
                "value": value,
                "side": side,
                "widen": widen,
                "note": f"best {param.name}={rounded_text(value)} is at the {side} end of its "
                f"{scope}: the optimum may lie {'above' if side == 'high' else 'below'} "
                f"it; {hint}",
            }
        )
    return edges


# a run's compute budget (config.BUDGET_KEYS), which a scaling grid searches over
COMPUTE_KEYS = frozenset(f"trainer.{key}" for key in BUDGET_KEYS)


def _stage_spec(plan: SweepPlan, stage_name: str):
    return next((i, s) for i, s in enumerate(plan.stages) if s.name == stage_name)


def searched_params(
    plan: SweepPlan, stage_name: str, start: dict, extended: dict[str, list] | None = None
) -> list[ParamSpec]:
    """The params a stage searched, as ParamSpecs (its retune bands included), each range
    spanning what an extend_trials round added to it."""
    _, stage = _stage_spec(plan, stage_name)
    params = list(plan.space(stage, flatten(start)).params)
    for i, p in enumerate(params):
        added = (extended or {}).get(p.name)
        if added is not None and p.kind in LIST_KINDS:
            params[i] = dataclasses.replace(p, values=tuple(sorted({*p.values, *added})))
        elif added is not None:
            low, high = added
            params[i] = dataclasses.replace(p, low=min(p.low, low), high=max(p.high, high))
    return params


def search_ranges(
    plan: SweepPlan, stage_name: str, start: dict, extended: dict[str, list] | None = None
) -> dict[str, tuple]:
    """name -> (low, high) of each ranged param the stage searched (for its plot)."""
    params = searched_params(plan, stage_name, start, extended)
    return {p.name: (p.low, p.high) for p in params if p.low is not None}
