"""The sweep search-space DSL: parsing, translation to each backend, bound semantics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sweeper.sweep.space import (
    ParamSpec,
    Space,
    SpaceError,
    extended_range,
    extended_values,
    grid_size,
    is_pure_grid,
    narrow_log_band,
    parse_points,
    parse_space,
    range_edge,
    to_builtin,
    to_configspace,
    to_optuna,
    to_tune,
)

LR = "optimizer.matrix_lr"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"log_uniform": [1e-4, 0.2]}, ParamSpec(LR, "log_uniform", 1e-4, 0.2)),
        ({"uniform": [-1, 1]}, ParamSpec(LR, "uniform", -1.0, 1.0)),
        ({"int": [1, 3]}, ParamSpec(LR, "int", 1, 3)),
        ({"log_int": [16, 256]}, ParamSpec(LR, "log_int", 16, 256)),
        ({"choice": ["adamw", "muon"]}, ParamSpec(LR, "choice", values=("adamw", "muon"))),
        ({"choice": [1, "x", None, 2.5]}, ParamSpec(LR, "choice", values=(1, "x", None, 2.5))),
        ({"grid": [0, 1, 2]}, ParamSpec(LR, "grid", values=(0, 1, 2))),
        ({"grid": (True,)}, ParamSpec(LR, "grid", values=(True,))),
    ],
)
def test_parse_space_specs(spec, expected):
    space = parse_space({LR: spec})
    assert space.params == (expected,)
    assert space.fixed == {}


def test_parse_space_keeps_order_and_fixed_values():
    space = parse_space(
        {"b.x": {"uniform": [0, 1]}, "a.fixed": 0.1, "a.y": {"int": [1, 2]}, "c": "text"}
    )
    assert space.names == ("b.x", "a.y")
    assert space.fixed == {"a.fixed": 0.1, "c": "text"}


def test_float_bounds_become_floats_and_int_bounds_ints():
    (param,) = parse_space({LR: {"uniform": [0, 2]}}).params
    assert isinstance(param.low, float) and isinstance(param.high, float)
    (param,) = parse_space({LR: {"int": [np.int64(1), 4]}}).params
    assert type(param.low) is int and type(param.high) is int


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({LR: {"normal": [0, 1]}}, "unknown spec key(s) ['normal']"),
        ({LR: {"uniform": [0, 1], "q": 0.1}}, "unknown spec key(s) ['q']"),
        ({LR: {"uniform": [0, 1], "int": [0, 1]}}, "exactly one kind"),
        ({LR: {}}, "exactly one kind"),
        ({LR: {"uniform": [0.0]}}, "uniform needs [low, high], got [0.0]"),
        ({LR: {"uniform": [0, 1, 2]}}, "uniform needs [low, high]"),
        ({LR: {"uniform": 0.5}}, "uniform needs [low, high], got 0.5"),
        ({LR: {"uniform": ["a", 1]}}, "uniform needs numeric bounds, got ['a', 1]"),
        ({LR: {"uniform": [True, 2]}}, "numeric bounds"),
        ({LR: {"uniform": [0, math.inf]}}, "finite bounds"),
        ({LR: {"int": [1, 2.5]}}, "int needs integer bounds, got [1, 2.5]"),
        ({LR: {"uniform": [1, 1]}}, "uniform needs low < high, got [1, 1]"),
        ({LR: {"int": [3, 1]}}, "int needs low < high, got [3, 1]"),
        ({LR: {"log_uniform": [0.0, 0.2]}}, "log_uniform needs 0 < low < high, got [0.0, 0.2]"),
        ({LR: {"log_uniform": [-1, 0.2]}}, "log_uniform needs 0 < low < high"),
        ({LR: {"log_uniform": [0.2, 0.1]}}, "log_uniform needs 0 < low < high"),
        ({LR: {"log_int": [0, 8]}}, "log_int needs 0 < low < high, got [0, 8]"),
        ({LR: {"choice": []}}, "choice needs a non-empty list of values, got []"),
        ({LR: {"grid": []}}, "grid needs a non-empty list"),
        ({LR: {"grid": "abc"}}, "grid needs a non-empty list of values, got 'abc'"),
        ({LR: {"grid": [1, 2, 1]}}, "grid has duplicate value 1 in [1, 2, 1]"),
        ({LR: {"choice": ["a", "a"]}}, "choice has duplicate value 'a'"),
        ({LR: {"choice": [[0.9, 0.95]]}}, "choice values must be scalars, got [0.9, 0.95]"),
        ({LR: [1e-3, 1e-2]}, "expected a spec such as {choice: [...]} or a scalar"),
        ({"a/b": {"uniform": [0, 1]}}, "must not contain '/'"),
    ],
)
def test_parse_space_refuses(params, fragment):
    with pytest.raises(SpaceError) as info:
        parse_space(params)
    message = str(info.value)
    assert fragment in message
    assert repr(next(iter(params))) in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({1: {"uniform": [0, 1]}}, "sweep param 1: param names must be non-empty strings"),
        ({"": {"uniform": [0, 1]}}, "non-empty strings"),
        ({"a": 0.1, "b": "x"}, "nothing to search, only fixed values ['a', 'b']"),
        ({}, "nothing to search"),
        ([("a", {"uniform": [0, 1]})], "must be a mapping"),
    ],
)
def test_parse_space_refuses_the_whole_block(params, fragment):
    with pytest.raises(ValueError, match="sweep param") as info:
        parse_space(params)
    assert fragment in str(info.value)


def test_space_error_is_a_value_error():
    assert issubclass(SpaceError, ValueError)


@pytest.mark.parametrize(
    ("spec", "cls", "bounds"),
    [
        # (lower, upper) as Tune stores them: its integer upper bound is exclusive.
        ({"log_uniform": [1e-4, 0.2]}, "Float", (1e-4, 0.2)),
        ({"uniform": [0, 1]}, "Float", (0.0, 1.0)),
        ({"int": [1, 3]}, "Integer", (1, 4)),
        ({"log_int": [16, 256]}, "Integer", (16, 257)),
        ({"choice": ["a", "b"]}, "Categorical", None),
    ],
)
def test_to_tune_domains(spec, cls, bounds):
    domain = to_tune(parse_space({LR: spec, "fixed": 1}))[LR]
    assert type(domain).__name__ == cls
    if bounds is not None:
        assert (domain.lower, domain.upper) == bounds
    from ray.tune.search.sample import LogUniform, Uniform

    expected_sampler = LogUniform if next(iter(spec)).startswith("log") else Uniform
    assert isinstance(domain.get_sampler(), expected_sampler)


def test_to_tune_grid_and_keys():
    domains = to_tune(parse_space({"a.b": {"grid": [1, 2]}, "c": {"choice": [3]}, "d": 0}))
    assert domains["a.b"] == {"grid_search": [1, 2]}
    assert domains["c"].categories == [3]
    assert list(domains) == ["a.b", "c"]


@pytest.mark.parametrize(
    ("spec", "cls", "kwargs"),
    [
        (
            {"log_uniform": [1e-4, 0.2]},
            "FloatDistribution",
            {"low": 1e-4, "high": 0.2, "log": True},
        ),
        ({"uniform": [0, 1]}, "FloatDistribution", {"low": 0.0, "high": 1.0}),
        ({"int": [1, 3]}, "IntDistribution", {"low": 1, "high": 3}),
        ({"log_int": [16, 256]}, "IntDistribution", {"low": 16, "high": 256, "log": True}),
        ({"choice": ["a", None]}, "CategoricalDistribution", {"choices": ("a", None)}),
    ],
)
def test_to_optuna_distributions(spec, cls, kwargs):
    from optuna import distributions

    translated = to_optuna(parse_space({LR: spec, "fixed": 1}))
    assert translated == {LR: getattr(distributions, cls)(**kwargs)}


@pytest.mark.parametrize(
    ("spec", "cls", "attrs"),
    [
        ({"log_uniform": [1e-4, 0.2]}, "UniformFloatHyperparameter", (1e-4, 0.2, True)),
        ({"uniform": [0, 1]}, "UniformFloatHyperparameter", (0.0, 1.0, False)),
        ({"int": [1, 3]}, "UniformIntegerHyperparameter", (1, 3, False)),
        ({"log_int": [16, 256]}, "UniformIntegerHyperparameter", (16, 256, True)),
    ],
)
def test_to_configspace_ranges(spec, cls, attrs):
    hp = to_configspace(parse_space({LR: spec, "fixed": 1}))[LR]
    assert type(hp).__name__ == cls
    assert (hp.lower, hp.upper, hp.log) == attrs


def test_to_configspace_choice_and_names():
    cs = to_configspace(parse_space({"a.b": {"choice": ["x", 2, None]}, "c": {"int": [1, 2]}}))
    assert cs["a.b"].choices == ("x", 2, None)
    assert sorted(cs.keys()) == ["a.b", "c"]


@pytest.mark.parametrize("translate", [to_optuna, to_configspace])
def test_samplers_refuse_grid_specs(translate):
    with pytest.raises(SpaceError, match="sweep param 'a.b': grid values cannot be sampled"):
        translate(parse_space({"a.b": {"grid": [1, 2]}}))


BOUNDS_SPACE = {"n.int": {"int": [1, 3]}, "n.log_int": {"log_int": [1, 3]}}


@pytest.mark.parametrize("name", sorted(BOUNDS_SPACE))
def test_int_bounds_are_inclusive_in_tune(name):
    domain = to_tune(parse_space(BOUNDS_SPACE))[name]
    draws = domain.sample(size=2000, random_state=np.random.default_rng(0))
    assert set(int(v) for v in draws) == {1, 2, 3}


@pytest.mark.parametrize("name", sorted(BOUNDS_SPACE))
def test_int_bounds_are_inclusive_in_optuna_and_configspace(name):
    space = parse_space(BOUNDS_SPACE)
    dist = to_optuna(space)[name]
    assert (dist.low, dist.high) == (1, 3)
    cs = to_configspace(space, seed=0)
    assert (cs[name].lower, cs[name].upper) == (1, 3)
    assert {c[name] for c in cs.sample_configuration(300)} == {1, 2, 3}


def test_float_samples_stay_inside_bounds_everywhere():
    space = parse_space({LR: {"log_uniform": [1e-4, 0.2]}, "u": {"uniform": [-1, 1]}})
    domains = to_tune(space)
    rng = np.random.default_rng(0)
    cs = to_configspace(space, seed=0)
    for name, (low, high) in {LR: (1e-4, 0.2), "u": (-1.0, 1.0)}.items():
        tune_draws = domains[name].sample(size=500, random_state=rng)
        cs_draws = [c[name] for c in cs.sample_configuration(500)]
        assert all(low <= v <= high for v in [*tune_draws, *cs_draws])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # hpbandster calls old ConfigSpace APIs
def test_configspace_hands_back_dotted_names_unchanged():
    from hpbandster.optimizers.config_generators.bohb import BOHB

    space = parse_space({LR: {"log_uniform": [1e-4, 0.2]}, "model.n_layer": {"int": [1, 3]}})
    cs = to_configspace(space, seed=0)
    assert set(dict(cs.sample_configuration())) == {LR, "model.n_layer"}
    config, _ = BOHB(cs).get_config(None)
    assert set(config) == {LR, "model.n_layer"}


@pytest.mark.parametrize(
    ("params", "size", "pure"),
    [
        ({"a": {"grid": [1, 2, 3]}, "b": {"grid": ["x", "y"]}, "c": 0}, 6, True),
        ({"a": {"grid": [1, 2, 3]}, "b": {"uniform": [0, 1]}}, 3, False),
        ({"b": {"uniform": [0, 1]}}, 1, False),
    ],
)
def test_grid_size_and_purity(params, size, pure):
    space = parse_space(params)
    assert grid_size(space) == size
    assert is_pure_grid(space) is pure


@pytest.mark.parametrize(
    ("spec", "value", "side"),
    [
        # log scale: [0.001, 0.1] spans two decades, so the outer tenths end at 10^-2.8 and 10^-1.2
        ({"log_uniform": [0.001, 0.1]}, 0.0015, "low"),
        ({"log_uniform": [0.001, 0.1]}, 0.0017, None),  # 0.0015 and 0.0017 straddle 10^-2.8
        ({"log_uniform": [0.001, 0.1]}, 0.01, None),  # the middle on a log scale
        ({"log_uniform": [0.001, 0.1]}, 0.06, None),
        ({"log_uniform": [0.001, 0.1]}, 0.07, "high"),  # 0.0631 is the top tenth's start
        ({"log_uniform": [0.001, 0.1]}, 0.1, "high"),
        ({"uniform": [0.0, 1.0]}, 0.1, "low"),  # linear scale, the bound's tenth included
        ({"uniform": [0.0, 1.0]}, 0.05, "low"),
        ({"uniform": [0.0, 1.0]}, 0.5, None),
        ({"uniform": [0.0, 1.0]}, 0.95, "high"),
        ({"int": [2, 12]}, 2, "low"),
        ({"int": [2, 12]}, 3, "low"),
        ({"int": [2, 12]}, 4, None),
        ({"int": [2, 12]}, 12, "high"),
        ({"log_int": [64, 1024]}, 64, "low"),
        ({"log_int": [64, 1024]}, 256, None),
        ({"grid": [4096, 8192, 16384]}, 4096, "low"),  # the smallest of three or more
        ({"grid": [16384, 4096, 8192]}, 16384, "high"),  # by value, not by position
        ({"grid": [4096, 8192, 16384]}, 8192, None),
        ({"choice": [0.0, 0.05, 0.1, 0.2]}, 0.2, "high"),
        ({"grid": [4096, 8192]}, 4096, None),  # two values: every winner is an end
        ({"choice": ["adamw", "muon_adamw", "sgd"]}, "adamw", None),  # no order
        ({"choice": [1, "x", 3]}, 1, None),  # a mixed list has no order either
    ],
)
def test_range_edge_flags_a_best_value_at_either_end(spec, value, side):
    (param,) = parse_space({LR: spec}).params
    assert range_edge(param, value) == side


@pytest.mark.parametrize(
    ("spec", "side", "expected"),
    [
        # half the range's width past the end, on a log scale: a 25x range goes 5x further
        ({"log_uniform": [0.004, 0.1]}, "high", [0.1, 0.5]),
        ({"log_uniform": [0.004, 0.1]}, "low", [0.0008, 0.004]),
        ({"uniform": [-1, 1]}, "low", [-2.0, -1.0]),
        ({"uniform": [0.1, 0.3]}, "high", [0.3, 0.4]),
        # a range of values >= 0 stays >= 0: nothing lies below a weight decay of 0
        ({"uniform": [0.05, 0.25]}, "low", [0.0, 0.05]),
        ({"uniform": [0.0, 0.2]}, "low", None),
        # integers start one step past the end and hold two values at least
        ({"int": [2, 6]}, "high", [7, 8]),
        ({"int": [3, 4]}, "high", [5, 6]),
        ({"int": [2, 6]}, "low", [0, 1]),
        ({"int": [0, 6]}, "low", None),
        ({"int": [-4, 0]}, "low", [-6, -5]),
        ({"log_int": [16, 64]}, "high", [65, 128]),
        ({"log_int": [3, 64]}, "low", [1, 2]),
        ({"log_int": [2, 64]}, "low", None),  # only 1 lies below 2
        ({"grid": [1, 2, 3]}, "high", None),  # a list has no range: the note says add values
        ({"choice": [1, 2, 3]}, "low", None),
    ],
)
def test_extended_range_lies_just_past_the_end(spec, side, expected):
    (param,) = parse_space({LR: spec}).params
    wider = extended_range(param, side)
    if expected is None:
        assert wider is None
    else:
        assert [wider.low, wider.high] == pytest.approx(expected)
        assert (wider.name, wider.kind) == (param.name, param.kind)
        # the new range is one the DSL accepts, and shares only the end with the old one
        assert parse_space({LR: {wider.kind: [wider.low, wider.high]}}).params == (wider,)
        assert (wider.low >= param.high) if side == "high" else (wider.high <= param.low)


@pytest.mark.parametrize(
    ("spec", "side", "count", "expected"),
    [
        # batch sizes double: the next values halve or double on, nearest first
        ({"grid": [4096, 8192, 16384]}, "low", 2, [2048, 1024]),
        ({"grid": [16384, 4096, 8192]}, "high", 1, [32768]),  # the order written is no matter
        ({"choice": [0.01, 0.02, 0.04]}, "high", 2, [0.08, 0.16]),
        # equal steps go on by that step; values that were all >= 0 stay >= 0
        ({"grid": [1, 2, 3]}, "high", 2, [4, 5]),
        ({"grid": [1, 2, 3]}, "low", 3, [0]),
        ({"grid": [0.0, 0.1, 0.2]}, "high", 2, [0.3, 0.4]),  # not 0.30000000000000004
        ({"grid": [0.0, 0.1, 0.2]}, "low", 1, None),
        ({"grid": [-1, 0, 1]}, "low", 2, [-2, -3]),
        # uneven positive values: the ratio of the two nearest the end
        ({"grid": [0.001, 0.01, 0.03]}, "low", 2, [0.0001, 0.00001]),
        ({"grid": [0.001, 0.01, 0.03]}, "high", 1, [0.09]),
        # a ratio's values are rounded to 3 significant digits (0.16 * 0.16 / 0.003 is
        # 8.5333...), or to as many more as keep them within a twentieth of a step of the
        # exact value (a ratio near 1, where 3 or 4 digits give 1.0 or 1.001)
        ({"grid": [0.16, 0.002, 0.003]}, "high", 2, [8.53, 455.0]),
        ({"grid": [0.002, 0.003, 0.16]}, "low", 1, [0.00133]),
        ({"grid": [1.0, 1.0001, 1.0003]}, "high", 2, [1.0005, 1.0007]),
        # integers stay integers, >= 1 by a ratio, and never repeat
        ({"grid": [2, 4, 8]}, "low", 3, [1]),
        ({"grid": [1, 2, 4]}, "low", 2, None),
        ({"grid": [100, 300, 900]}, "low", 2, [33, 11]),
        # nothing numeric to continue
        ({"choice": ["a", "b", "c"]}, "high", 2, None),
        ({"grid": [1, 2, 3]}, "high", 0, None),
    ],
)
def test_extended_values_continue_a_lists_spacing_past_its_end(spec, side, count, expected):
    (param,) = parse_space({LR: spec}).params
    more = extended_values(param, side, count)
    if expected is None:
        assert more is None
        return
    assert list(more.values) == pytest.approx(expected, rel=1e-12)
    assert [type(v) for v in more.values] == [type(v) for v in expected]
    assert (more.name, more.kind) == (param.name, param.kind)
    assert not set(more.values) & set(param.values)
    # a list the DSL accepts
    assert parse_space({LR: {more.kind: list(more.values)}}).params == (more,)


def test_narrow_log_band_round_trips_through_parse():
    spec = narrow_log_band(0.02, 2.0)
    assert spec == {"log_uniform": [0.01, 0.04]}
    (param,) = parse_space({LR: spec}).params
    assert math.isclose(math.sqrt(param.low * param.high), 0.02)


@pytest.mark.parametrize(("value", "factor"), [(0.0, 2.0), (-1e-3, 2.0), (1e-3, 1.0), (1e-3, 0.5)])
def test_narrow_log_band_refuses(value, factor):
    with pytest.raises(ValueError, match="narrow_log_band needs"):
        narrow_log_band(value, factor)


def test_to_builtin_converts_numpy_scalars():
    config = {
        "a": np.int64(3),
        "b": np.str_("x"),
        "c": [np.bool_(True), np.float64(0.5)],
        "d": None,
    }
    plain = to_builtin(config)
    assert plain == {"a": 3, "b": "x", "c": [True, 0.5], "d": None}
    assert [type(v) for v in (plain["a"], plain["b"], *plain["c"])] == [int, str, bool, float]


def test_space_is_frozen():
    space = parse_space({LR: {"uniform": [0, 1]}})
    assert isinstance(space, Space)
    with pytest.raises(AttributeError):
        space.params[0].low = 2.0  # type: ignore[misc]


# --- points: configurations a stage tries first -----------------------------------------
POINT_SPACE = {
    "optimizer.lr": {"log_uniform": [1e-3, 1e-1]},
    "model.n_layer": {"int": [2, 6]},
    "optimizer.name": {"choice": ["adamw", "muon", None]},
}


def test_points_come_back_flat_complete_and_typed():
    space = parse_space(POINT_SPACE)
    given = [
        {"optimizer.lr": 1e-1, "model.n_layer": 4.0, "optimizer.name": None},  # bounds inclusive
        {"model.n_layer": 2, "optimizer.name": "muon"},  # the LR from fill
    ]
    points = parse_points(space, given, fill={"optimizer.lr": 0.01})
    assert points == [
        {"optimizer.lr": 0.1, "model.n_layer": 4, "optimizer.name": None},
        {"optimizer.lr": 0.01, "model.n_layer": 2, "optimizer.name": "muon"},
    ]
    assert type(points[0]["model.n_layer"]) is int and type(points[1]["optimizer.lr"]) is float
    assert given[0]["model.n_layer"] == 4.0  # the caller's points are not changed


@pytest.mark.parametrize(
    ("points", "fragment"),
    [
        ({"optimizer.lr": 0.01}, "sweep points must be a list"),
        (["lr=0.01"], "sweep point 1: expected {param: value} or base, got 'lr=0.01'"),
        (
            [{"optimizer.lr": 0.01}],
            "sweep point 1: no value for ['model.n_layer', 'optimizer.name']",
        ),
        ([{"optimizer.mom": 0.9}], "['optimizer.mom'] not searched in this stage"),
        ([{"optimizer.lr": 0.5, "model.n_layer": 2, "optimizer.name": "muon"}], "outside"),
        ([{"optimizer.lr": "fast", "model.n_layer": 2, "optimizer.name": "muon"}], "not a number"),
        ([{"optimizer.lr": True, "model.n_layer": 2, "optimizer.name": "muon"}], "not a number"),
        ([{"optimizer.lr": 0.01, "model.n_layer": 2.5, "optimizer.name": "muon"}], "integer"),
        ([{"optimizer.lr": 0.01, "model.n_layer": 9, "optimizer.name": "muon"}], "int [2, 6]"),
        ([{"optimizer.lr": 0.01, "model.n_layer": 2, "optimizer.name": "sgd"}], "not one of"),
    ],
)
def test_points_refuse_what_the_space_cannot_hold(points, fragment):
    with pytest.raises(SpaceError) as info:
        parse_points(parse_space(POINT_SPACE), points)
    assert fragment in str(info.value)


def test_a_bad_point_is_named_by_its_number():
    good = {"optimizer.lr": 0.01, "model.n_layer": 2, "optimizer.name": "muon"}
    with pytest.raises(SpaceError, match=r"^sweep point 2: model.n_layer=7 is outside int"):
        parse_points(parse_space(POINT_SPACE), [good, {**good, "model.n_layer": 7}])
