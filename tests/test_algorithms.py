"""Searcher/scheduler builders: refused combinations, and tiny real Ray Tune runs."""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sweeper.sweep.algorithms import (
    MODEL_BASED,
    SCHEDULERS,
    SEARCHES,
    bohb_model_points,
    build_scheduler,
    build_searcher,
    check_compatible,
    metric_reader,
    random_start,
    startup_trials,
)
from sweeper.sweep.rungs import budget_key, hyperband_units, rungs
from sweeper.sweep.space import parse_points, parse_space, to_builtin, to_configspace

METRIC, MODE, TIME_ATTR = "val_bpb", "min", "tokens"
TOKENS_PER_STEP, STEPS = 1000, 9
SAMPLED = {
    "optimizer.lr": {"log_uniform": [1e-3, 1.0]},
    "model.n_layer": {"int": [1, 3]},
    "optimizer.name": {"choice": ["adamw", "muon"]},
    "train.fixed": 0.5,
}
GRID = {
    "optimizer.lr": {"grid": [0.01, 0.3]},
    "model.n_layer": {"grid": [1, 3]},
    "train.fixed": 0.5,
}
MIXED = {"optimizer.lr": {"log_uniform": [1e-3, 1.0]}, "model.n_layer": {"grid": [1, 3]}}
SPACE_FOR_SEARCH = {"random": MIXED, "grid": GRID, "tpe": SAMPLED, "gp": SAMPLED, "bohb": SAMPLED}


@pytest.mark.parametrize(
    ("search", "scheduler", "params", "fragment"),
    [
        ("hyperopt", "fifo", SAMPLED, "unknown search 'hyperopt'"),
        ("tpe", "pbt", SAMPLED, "unknown scheduler 'pbt'"),
        ("bohb", "asha", SAMPLED, "search 'bohb' needs scheduler 'bohb', got scheduler 'asha'"),
        ("bohb", "fifo", SAMPLED, "search 'bohb' needs scheduler 'bohb'"),
        ("tpe", "bohb", SAMPLED, "scheduler 'bohb' needs search 'bohb', got search 'tpe'"),
        ("random", "bohb", SAMPLED, "scheduler 'bohb' needs search 'bohb'"),
        ("tpe", "asha", MIXED, "search 'tpe' samples from distributions and cannot enumerate"),
        ("gp", "fifo", GRID, "search 'gp' samples from distributions"),
        ("bohb", "bohb", MIXED, "cannot enumerate grid params (model.n_layer)"),
        ("grid", "fifo", MIXED, "cannot sample optimizer.lr (log_uniform);"),
        ("grid", "asha", SAMPLED, "search 'grid' runs every grid value once"),
    ],
)
def test_check_compatible_refuses(search, scheduler, params, fragment):
    with pytest.raises(ValueError) as info:
        check_compatible(search, scheduler, parse_space(params))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def allowed_pairs():
    for search in SEARCHES:
        for scheduler in SCHEDULERS:
            if (search == "bohb") == (scheduler == "bohb"):
                yield search, scheduler


ALLOWED = list(allowed_pairs())


def test_allowed_pairs_pass_the_check():
    assert len(ALLOWED) == 13
    for search, scheduler in ALLOWED:
        check_compatible(search, scheduler, parse_space(SPACE_FOR_SEARCH[search]))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # hpbandster calls old ConfigSpace APIs
@pytest.mark.parametrize(("search", "scheduler"), ALLOWED)
def test_metric_reader_names_what_ray_checks_every_report_for(search, scheduler):
    """Ray refuses a report without the metric where the scheduler or the searcher holds
    one (TuneController._validate_result_metrics): metric_reader must say so for the same
    pairs, or a user's function's trials fail where Ray would not (or the other way)."""
    built = [
        build_scheduler(scheduler, metric=METRIC, mode=MODE, time_attr=TIME_ATTR, max_t=9e9,
                        grace_period=1e9),
        build_searcher(search, parse_space(SPACE_FOR_SEARCH[search]), metric=METRIC, mode=MODE,
                       seed=0, num_samples=8)[0],
    ]  # fmt: skip
    ray_checks = any(getattr(alg, "metric", None) == METRIC for alg in built)
    assert (metric_reader(search, scheduler) is not None) == ray_checks
    assert metric_reader(search, scheduler) in (
        None, f"the {scheduler} scheduler", f"the {search} search"
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # hpbandster calls old ConfigSpace APIs
def test_the_sweeps_bohb_settings_reach_hpbandsters_model():
    from dataclasses import asdict

    from sweeper.config.sweep import BohbSpec

    def model_of(spec: BohbSpec):
        alg, _ = build_searcher(
            "bohb", parse_space(SPACE_FOR_SEARCH["bohb"]), metric=METRIC, mode=MODE,
            seed=0, num_samples=8, bohb=asdict(spec),
        )  # fmt: skip
        return alg.bohber

    model = model_of(BohbSpec(random_fraction=0.1, bandwidth_factor=1.0, top_n_percent=30))
    assert (model.random_fraction, model.bw_factor, model.top_n_percent) == (0.1, 1.0, 30)
    assert (model.num_samples, model.min_bandwidth) == (64, 1e-3)  # hpbandster's defaults
    assert model_of(BohbSpec()).random_fraction == pytest.approx(1 / 3)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # hpbandster calls old ConfigSpace APIs
@pytest.mark.parametrize("search", SEARCHES)
def test_build_searcher_splits_the_space(search):
    space = parse_space(SPACE_FOR_SEARCH[search])
    alg, param_space = build_searcher(
        search, space, metric=METRIC, mode=MODE, seed=0, num_samples=8, max_concurrent=2
    )
    if search in MODEL_BASED:
        # The searcher owns the space; the Tuner only sees constants.
        assert param_space == space.fixed
        assert type(alg).__name__ == "RunningLimiter"  # a limit that skips paused trials
        assert alg.max_concurrent == 2
    else:
        assert set(param_space) == set(space.names) | set(space.fixed)
        assert type(alg).__name__ == "RunningVariantGenerator"
        assert alg.max_concurrent == 2
    if search in ("tpe", "gp"):  # Optuna's INFO line per stage stays out of the output
        import optuna

        assert optuna.logging.get_verbosity() == optuna.logging.WARNING


@pytest.mark.parametrize("search", ["tpe", "gp"])
@pytest.mark.parametrize(("mode", "worst"), [("min", math.inf), ("max", -math.inf)])
def test_optuna_is_told_a_diverged_trial_as_the_worst_value(search, mode, worst):
    # the trial's own report keeps its finite penalty (Ray's schedulers rank it); Optuna is
    # told +-inf, which its GP clips to the worst finite value instead of standardising a 1e9
    import warnings

    space = parse_space({"x": {"uniform": [0.0, 1.0]}})
    alg, _ = build_searcher(search, space, metric=METRIC, mode=mode, seed=0, num_samples=4)
    penalty = 1e9 if mode == "min" else -1e9
    results = [{METRIC: 1.5}, {METRIC: penalty, "status": "diverged"}, {METRIC: 1.2}, {}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the GP's clipping warning is not printed either
        for i, result in enumerate(results * 2):
            trial_id = f"t{i}"
            assert set(alg.suggest(trial_id)) == {"x"}
            alg.on_trial_complete(trial_id, result=dict(result) or None, error=not result)
    trials = alg._ot_study.trials
    assert [t.value for t in trials] == [1.5, worst, 1.2, None] * 2
    assert [t.state.name for t in trials][:4] == ["COMPLETE", "COMPLETE", "COMPLETE", "FAIL"]
    assert results[1][METRIC] == penalty  # the caller's result is not changed in place


def test_a_penalty_the_user_chose_is_told_to_optuna_as_it_is():
    space = parse_space({"x": {"uniform": [0.0, 1.0]}})
    alg, _ = build_searcher(
        "gp", space, metric=METRIC, mode=MODE, seed=0, num_samples=4, worst_on_divergence=False
    )
    alg.suggest("t0")
    alg.on_trial_complete("t0", result={METRIC: 9.0, "status": "diverged"})
    assert [t.value for t in alg._ot_study.trials] == [9.0]


@pytest.mark.parametrize("scheduler", ["asha", "hyperband", "bohb"])
@pytest.mark.parametrize(("grace_fraction", "eta"), [(0.25, 3), (1 / 9, 3), (0.1, 2), (0.5, 4)])
def test_rungs_are_where_rays_schedulers_stop_trials(scheduler, grace_fraction, eta):
    max_t = 65536
    built = build_scheduler(
        scheduler,
        metric=METRIC,
        mode=MODE,
        time_attr=TIME_ATTR,
        max_t=max_t,
        grace_period=max_t * grace_fraction,
        reduction_factor=eta,
    )
    if scheduler == "asha":
        expected = {t for t, _ in built._brackets[0]._rungs if t < max_t}
    else:  # every bracket's rungs below the full budget, back in tokens
        expected = {
            built._get_r0(s) * eta**j * built._unit for s in range(built._s_max_1) for j in range(s)
        }
    found = rungs(scheduler, max_t, max_t * grace_fraction, eta)
    assert found == sorted(found) and len(found) == len(expected)
    assert found == pytest.approx(sorted(expected))
    assert not found or found[0] >= max_t * grace_fraction * (1 - 1e-9)


def test_fifo_has_no_rungs():
    assert rungs("fifo", 65536, 16384, 3) == []


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"mode": "minimize"}, "mode must be one of ['min', 'max'], got 'minimize'"),
        ({"max_concurrent": 0}, "max_concurrent must be >= 1"),
        ({"search": "tpe", "params": GRID}, "cannot enumerate grid"),
        ({"search": "grid", "params": GRID, "points": [{"optimizer.lr": 0.01}]}, "no points"),
    ],
)
def test_build_searcher_refuses(kwargs, fragment):
    args = {"search": "random", "params": SAMPLED, "mode": MODE} | kwargs
    with pytest.raises(ValueError) as info:
        build_searcher(
            args["search"],
            parse_space(args["params"]),
            metric=METRIC,
            mode=args["mode"],
            seed=0,
            num_samples=4,
            max_concurrent=args.get("max_concurrent"),
            points=args.get("points"),
        )
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("scheduler", "cls"),
    [
        ("fifo", "FIFOScheduler"),
        ("asha", "AsyncHyperBandScheduler"),
        ("hyperband", "HyperBandScheduler"),
        ("bohb", "HyperBandForBOHB"),
    ],
)
def test_build_scheduler_classes(scheduler, cls):
    from ray.tune import schedulers

    built = build_scheduler(
        scheduler, metric=METRIC, mode=MODE, time_attr=TIME_ATTR, max_t=9e9, grace_period=1e9
    )
    assert isinstance(built, getattr(schedulers, cls))


def test_hyperband_counts_time_in_grace_periods():
    # 9e9 tokens with a 1e9 grace period is 3 brackets at eta=3, not log3(9e9) ~ 21.
    built = build_scheduler(
        "hyperband", metric=METRIC, mode=MODE, time_attr=TIME_ATTR, max_t=9e9, grace_period=1e9
    )
    assert built._s_max_1 == 3
    assert built._time_attr == budget_key(TIME_ATTR)


@pytest.mark.parametrize(
    ("grace_fraction", "eta", "unit_fraction", "units"),
    [
        (0.25, 3, 1 / 3, 3),  # a quarter is not a rung that leads to the full budget
        (1 / 3, 3, 1 / 3, 3),
        (0.111, 3, 1 / 9, 9),  # 1/9 = 0.1111 is no shorter than the grace
        (0.112, 3, 1 / 3, 3),  # a ninth would stop trials before the grace
        (1 / 9, 3, 1 / 9, 9),
        (0.1, 2, 1 / 8, 8),
        (1.0, 3, 1.0, 1),
        (1 / 729, 3, 1 / 729, 729),
    ],
)
def test_hyperband_units_are_a_whole_power_of_eta_no_shorter_than_the_grace(
    grace_fraction, eta, unit_fraction, units
):
    max_t = 65536.0
    unit, n = hyperband_units(max_t, max_t * grace_fraction, eta)
    assert n == units and unit == pytest.approx(max_t * unit_fraction)
    assert unit >= max_t * grace_fraction * (1 - 1e-9)


@pytest.mark.parametrize("scheduler", ["hyperband", "bohb"])
@pytest.mark.parametrize(("grace_fraction", "eta"), [(0.25, 3), (0.111, 3), (0.1, 2), (1 / 729, 3)])
def test_every_hyperband_bracket_ends_on_the_full_budget(scheduler, grace_fraction, eta):
    # Ray builds bracket s with first rung r0(s), then multiplies by eta s times, capped at
    # max_t. With max_t = 4 grace units the s=1 bracket was rungs 1 and 3: its best trial
    # stopped at three quarters of the budget and never completed.
    built = build_scheduler(
        scheduler,
        metric=METRIC,
        mode=MODE,
        time_attr=TIME_ATTR,
        max_t=65536,
        grace_period=65536 * grace_fraction,
        reduction_factor=eta,
    )
    max_units = built._max_t_attr
    for s in range(built._s_max_1):
        first = built._get_r0(s)
        assert first >= 1
        assert first * eta**s == max_units, (s, first)
        assert first * built._unit >= 65536 * grace_fraction * (1 - 1e-9)


@pytest.mark.parametrize("clock", ["tokens", "training_iteration"])
def test_an_extension_rounds_asha_ranks_its_trials_against_the_first_rounds(clock):
    from types import SimpleNamespace

    from ray.tune.schedulers import TrialScheduler

    from sweeper.sweep.ray_patches import record_earlier_trials

    unit = 100 if clock == "tokens" else 1  # rungs at 1, 3 and 9 units
    # the first round: three trials at the first rung (2.0, 2.2, 2.4 val_bpb), one of
    # which went on to the second; a diverged report (NaN) is no rung value
    earlier = [
        {"trial_id": "a", "val_bpb": 2.0},
        {"trial_id": "a", "val_bpb": 1.8},
        {"trial_id": "b", "val_bpb": 2.2},
        {"trial_id": "c", "val_bpb": 2.4},
        {"trial_id": "d", "val_bpb": float("nan")},
    ]
    for row in earlier:
        # each trial's n-th report at n x 2 units (2 then 4: past the rungs at 1 and 3)
        n = sum(r["trial_id"] == row["trial_id"] for r in earlier[: earlier.index(row) + 1])
        if clock == "tokens":
            row["tokens"] = 2 * n * unit

    def first_rung(scheduler, value: float) -> str:
        trial = SimpleNamespace(trial_id=f"new {value}")
        scheduler.on_trial_add(None, trial)
        return scheduler.on_trial_result(None, trial, {clock: 2 * unit, "val_bpb": value})

    def asha():
        return build_scheduler(
            "asha", metric="val_bpb", mode="min", time_attr=clock, max_t=9 * unit,
            grace_period=unit, reduction_factor=3,
        )  # fmt: skip

    alone = asha()
    assert first_rung(alone, 2.3) == TrialScheduler.CONTINUE  # nothing yet to cut against
    assert first_rung(alone, 2.5) == TrialScheduler.STOP  # behind the round's own first
    seeded = asha()
    assert record_earlier_trials(seeded, earlier, clock, "val_bpb") == 3
    # the first rung's cutoff is now the best third of 2.0, 2.2, 2.4 (2.133): 2.3 stops
    assert first_rung(seeded, 2.3) == TrialScheduler.STOP
    assert first_rung(seeded, 2.1) == TrialScheduler.CONTINUE


def test_a_resumed_extension_round_keeps_the_first_rounds_trials_at_its_rungs(tmp_path):
    # a resumed round is Tuner.restore'd from the tuner.pkl Tune writes when the Tuner is
    # made, after the records were replayed into its scheduler
    import ray.cloudpickle as pickle
    from ray import tune

    from sweeper.sweep.ray_patches import record_earlier_trials

    scheduler = build_scheduler(
        "asha", metric="val_bpb", mode="min", time_attr="tokens", max_t=900, grace_period=100,
        reduction_factor=3,
    )  # fmt: skip
    assert record_earlier_trials(scheduler, [{"trial_id": "a", "tokens": 200, "val_bpb": 2.0}],
                                 "tokens", "val_bpb") == 1  # fmt: skip
    tune.Tuner(
        lambda config: None,
        tune_config=tune.TuneConfig(scheduler=scheduler),
        run_config=tune.RunConfig(name="round", storage_path=str(tmp_path)),
    )
    state = pickle.loads((tmp_path / "round" / "tuner.pkl").read_bytes())
    rungs = state["_tune_config"].scheduler._brackets[0]._rungs
    assert [(milestone, dict(recorded)) for milestone, recorded in rungs] == [
        (900, {}), (300, {}), (100, {"earlier round: a": -2.0})
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"scheduler": "median"}, "unknown scheduler 'median'"),
        ({"mode": "up"}, "mode must be one of"),
        ({"grace_period": 0}, "need 0 < grace_period <= max_t, got 0 and 9"),
        ({"grace_period": 10}, "need 0 < grace_period <= max_t"),
        ({"reduction_factor": 1}, "reduction_factor must be > 1, got 1"),
        (
            {"scheduler": "bohb", "reduction_factor": 2.5},
            "scheduler 'bohb' needs a whole reduction_factor, got 2.5",
        ),
        ({"scheduler": "hyperband", "brackets": 0}, "brackets must be >= 1 or None, got 0"),
    ],
)
def test_build_scheduler_refuses(kwargs, fragment):
    args = {"scheduler": "asha", "mode": MODE, "grace_period": 1, "reduction_factor": 3} | kwargs
    with pytest.raises(ValueError) as info:
        build_scheduler(
            args["scheduler"],
            metric=METRIC,
            mode=args["mode"],
            time_attr=TIME_ATTR,
            max_t=9,
            grace_period=args["grace_period"],
            reduction_factor=args["reduction_factor"],
            brackets=args.get("brackets"),
        )
    assert fragment in str(info.value)


# hpbandster calls old ConfigSpace, statsmodels and pandas APIs
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("params", [SAMPLED, {"optimizer.lr": {"log_uniform": [1e-3, 1.0]}}])
def test_bohb_models_after_the_points_it_is_said_to_need(params):
    # against hpbandster itself: one result short of bohb_model_points there is no model
    import numpy as np
    from hpbandster.optimizers.config_generators.bohb import BOHB

    space = parse_space(params)
    generator = BOHB(to_configspace(space, seed=0))

    class Job:  # what hpbandster's new_result reads of a finished run
        def __init__(self, config, loss):
            self.kwargs = {"budget": 1.0, "config": config}
            self.result = {"loss": loss}
            self.exception, self.timestamps = None, {}

    rng = np.random.default_rng(0)
    needed = bohb_model_points(space)
    for i in range(needed):
        assert not generator.kde_models, f"a model after {i} results"
        config, _ = generator.get_config(None)
        generator.new_result(Job(config, float(rng.random())))
    assert 1.0 in generator.kde_models
    assert f"random until {needed} trials" in random_start("bohb", space, 48)
    assert random_start("tpe", space, 48) == "the first 10 trials are random"
    assert random_start("gp", space, 4) == "the first trial is random"
    # given points count among Optuna's startup trials
    assert random_start("tpe", space, 48, given=2) == "its model proposes from trial 11"
    assert random_start("tpe", space, 12, given=5) == "its model proposes from trial 6"
    assert random_start("random", space, 48) is None


@pytest.mark.parametrize(("num_samples", "expected"), [(1, 1), (4, 1), (8, 2), (30, 10), (300, 10)])
def test_startup_trials(num_samples, expected):
    assert startup_trials(num_samples) == expected


# --- end-to-end runs on a real local Ray -------------------------------------------------


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    # Ray workers cannot import this test module (pytest put tests/ on the driver's path
    # only), so ship the trainable by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    yield ray
    ray.shutdown()
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def quadratic_trainable(config):
    """Reports a loss that improves with tokens; checkpoints so HyperBand can pause it."""
    from ray import tune

    config = to_builtin(config)
    assert isinstance(config["optimizer.lr"], float)
    assert config.get("train.fixed", 0.5) == 0.5
    distance = math.log10(config["optimizer.lr"]) + 1.5
    offset = {"muon": 0.0, "adamw": 0.1}[config.get("optimizer.name", "muon")]
    step = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            step = json.loads((Path(folder) / "state.json").read_text())["step"]
    while step < STEPS:
        step += 1
        began = time.time()
        time.sleep(0.02)  # a step takes time, so trials that train at once overlap
        loss = distance**2 + offset + 0.1 * config["model.n_layer"] + 1.0 / step
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "state.json").write_text(json.dumps({"step": step}))
            tune.report(
                {
                    TIME_ATTR: step * TOKENS_PER_STEP,
                    METRIC: loss,
                    "began": began,
                    "ended": time.time(),
                },
                checkpoint=tune.Checkpoint.from_directory(folder),
            )


def _fit(
    search,
    scheduler,
    params,
    grace_steps,
    num_samples,
    tmp_path,
    points=None,
    max_concurrent=None,
    brackets=None,
    **tune_config,
):
    """A real Tune run of quadratic_trainable: (searcher, Tune's results). Its actors run
    trial after trial, as the engine's do: a paused trial goes on in a warm actor."""
    from ray import tune
    from ray.tune.logger import JsonLoggerCallback

    alg, param_space = build_searcher(
        search,
        parse_space(params),
        metric=METRIC,
        mode=MODE,
        seed=0,
        num_samples=num_samples,
        points=points,
        max_concurrent=max_concurrent,
    )
    sched = build_scheduler(
        scheduler,
        metric=METRIC,
        mode=MODE,
        time_attr=TIME_ATTR,
        max_t=STEPS * TOKENS_PER_STEP,
        grace_period=grace_steps * TOKENS_PER_STEP,
        max_concurrent=max_concurrent,
        brackets=brackets,
    )
    tuner = tune.Tuner(
        quadratic_trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            search_alg=alg,
            scheduler=sched,
            num_samples=num_samples,
            reuse_actors=True,
            **tune_config,
        ),
        run_config=tune.RunConfig(
            storage_path=str(tmp_path),
            name=scheduler,
            verbose=0,
            # as the engine does: importing sweeper's Ray module turns Tune's default loggers
            # off, and metrics_dataframe reads each trial's result.json
            callbacks=[JsonLoggerCallback()],
        ),
    )
    return alg, tuner.fit()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(("search", "scheduler"), ALLOWED)
def test_tuner_end_to_end(ray_session, tmp_path, search, scheduler):
    params = SPACE_FOR_SEARCH[search]
    check_compatible(search, scheduler, parse_space(params))
    num_samples = 1 if search == "grid" else (2 if search == "random" else 4)
    _, results = _fit(search, scheduler, params, 1, num_samples, tmp_path)

    assert results.num_errors == 0
    assert len(results) == 4  # random: 2 samples x 2 grid values; grid: 2 x 2 points
    assert all(r.metrics and r.metrics[TIME_ATTR] >= TOKENS_PER_STEP for r in results)
    best = results.get_best_result(metric=METRIC, mode=MODE)
    assert math.isfinite(best.metrics[METRIC])
    assert {"optimizer.lr", "model.n_layer"} <= set(best.config)
    if scheduler == "bohb":
        # BOHB fills its largest bracket first (9 slots, first rung 1 grace period), which
        # keeps ceil(9 / 3) = 3 of the 4 trials: the 4th stops after one grace period.
        assert min(r.metrics[TIME_ATTR] for r in results) == TOKENS_PER_STEP


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    ("search", "scheduler"), [("random", "fifo"), ("tpe", "asha"), ("gp", "fifo"), ("bohb", "bohb")]
)
def test_given_points_are_every_searchers_first_trials(ray_session, tmp_path, search, scheduler):
    # dotted names, an int given as 2.0 and a float as 1: the searchers get them typed
    given = [
        {"optimizer.lr": 0.0316, "model.n_layer": 2.0, "optimizer.name": "adamw"},
        {"optimizer.lr": 1, "model.n_layer": 3, "optimizer.name": "muon"},
    ]
    points = parse_points(parse_space(SAMPLED), given)
    _, results = _fit(search, scheduler, SAMPLED, 1, 3, tmp_path, points=points)
    assert results.num_errors == 0 and len(results) == 3
    tried = [to_builtin({key: r.config[key] for key in points[0]}) for r in results]
    assert tried[:2] == points, tried  # quadratic_trainable asserts the LR is a float
    assert tried[2] not in points


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_hyperband_trials_end_at_a_rung_or_at_the_full_budget(ray_session, tmp_path):
    # A grace of 2 of 9 steps: 4.5 grace periods, which Ray's int() rungs made 2 and 6
    # steps, so the s=1 bracket's best trial stopped at 6 of 9 steps. Rounded to units of
    # 3 steps, one band is 3 trials at 3 steps (the best goes on to 9) and 2 trials of 9.
    _, results = _fit("random", "hyperband", MIXED, 2, 3, tmp_path)
    ends = sorted(r.metrics[TIME_ATTR] // TOKENS_PER_STEP for r in results)
    assert len(ends) == 6  # 3 samples x 2 grid values
    assert set(ends) <= {3, STEPS}, ends
    assert ends.count(STEPS) >= 3, ends


def _most_at_once(results) -> int:
    """The most trials whose reported steps overlap in time."""
    events = []
    for result in results:
        for began, ended in result.metrics_dataframe[["began", "ended"]].itertuples(index=False):
            events += [(began, 1), (ended, -1)]
    running = most = 0
    for _, change in sorted(events):  # at a tie the step that ended goes first
        running += change
        most = max(most, running)
    return most


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
@pytest.mark.parametrize(
    ("search", "scheduler", "limit"),
    [("bohb", "bohb", 1), ("random", "hyperband", 1), ("tpe", "hyperband", 2)],
)
def test_hyperband_brackets_keep_their_shape_under_a_concurrency_limit(
    ray_session, tmp_path, search, scheduler, limit
):
    # One band of 9 units at eta 3 is 17 trials: a bracket of 9 (6 stop at 1 step, 2 at 3,
    # 1 runs all 9), one of 5 (3 stop at 3, 2 run 9) and one of 3 (all run 9). Ray counted
    # paused trials against the limit and let trials join a bracket whose last trial had
    # ended: at a limit of one, BOHB ran every trial after its first bracket to the end, and
    # hyperband ran every trial to the end at either limit.
    params = {"optimizer.lr": {"log_uniform": [1e-3, 1.0]}, "model.n_layer": 1}
    _, results = _fit(search, scheduler, params, 1, 17, tmp_path, max_concurrent=limit)
    assert results.num_errors == 0
    ends = sorted(r.metrics[TIME_ATTR] // TOKENS_PER_STEP for r in results)
    assert ends == [1] * 6 + [3] * 5 + [9] * 6, ends
    assert _most_at_once(results) <= limit


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_bohb_with_one_bracket_halves_every_bracket_from_the_first_rung(ray_session, tmp_path):
    # sweep.brackets=1: each bracket of 9 stops 6 trials at 1 step and 2 at 3; 1 runs all 9
    params = {"optimizer.lr": {"log_uniform": [1e-3, 1.0]}, "model.n_layer": 1}
    _, results = _fit("bohb", "bohb", params, 1, 18, tmp_path, max_concurrent=2, brackets=1)
    assert results.num_errors == 0
    ends = sorted(r.metrics[TIME_ATTR] // TOKENS_PER_STEP for r in results)
    assert ends == [1] * 12 + [3] * 4 + [9] * 2, ends


def _nine_units(scheduler: str, **kwargs):
    """A scheduler over 9 time units from a first rung of 1: HyperBand's 3 brackets at eta 3."""
    return build_scheduler(
        scheduler,
        metric=METRIC,
        mode=MODE,
        time_attr=TIME_ATTR,
        max_t=9.0,
        grace_period=1.0,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("scheduler", "brackets", "opened"),
    [
        # (trials, first rung in units) of the brackets 21 trials open, in order: a band of
        # all three, or the most aggressive ones only
        ("bohb", None, [(9, 1), (5, 3), (3, 9), (4, 1)]),
        ("bohb", 1, [(9, 1), (9, 1), (3, 1)]),
        ("bohb", 2, [(9, 1), (5, 3), (7, 1)]),
        ("hyperband", None, [(3, 9), (5, 3), (9, 1), (3, 9), (1, 3)]),
        ("hyperband", 1, [(9, 1), (9, 1), (3, 1)]),
        ("hyperband", 2, [(5, 3), (9, 1), (5, 3), (2, 1)]),
        ("hyperband", 7, [(3, 9), (5, 3), (9, 1), (3, 9), (1, 3)]),  # more than exist: all
    ],
)
def test_brackets_keeps_the_most_aggressive_brackets(scheduler, brackets, opened):
    from ray.tune.experiment import Trial

    built = _nine_units(scheduler, brackets=brackets)
    seen: dict = {}  # bracket -> trials it took, in the order brackets opened
    for _ in range(21):
        trial = Trial("stand_in", stub=True)
        built.on_trial_add(None, trial)
        bracket = built._trial_info[trial][0]
        seen[bracket] = seen.get(bracket, 0) + 1
    assert [(taken, bracket._r0) for bracket, taken in seen.items()] == opened


def test_asha_takes_brackets_from_the_sweep():
    built = _nine_units("asha", brackets=2)
    assert len(built._brackets) == 2


def test_a_bracket_stays_filled_after_its_trials_end():
    from sweeper.sweep.ray_patches import ClosingBracket

    bracket = ClosingBracket(
        time_attr=TIME_ATTR, max_trials=3, init_t_attr=1, max_t_attr=9, eta=3, s=2
    )
    for trial in ("a", "b"):
        bracket.add_trial(trial)
    assert not bracket.filled()
    bracket.add_trial("c")
    for trial in ("a", "b", "c"):
        bracket.cleanup_trial(trial)  # a trial that completed, or was stopped
    assert bracket.filled()  # Ray's _Bracket counts live trials: it took new ones again


@pytest.mark.parametrize(("scheduler", "first"), [("bohb", "promoted"), ("hyperband", "new")])
def test_bohb_resumes_the_oldest_bracket_first(scheduler, first):
    # Ray's HyperBandForBOHB goes on with the oldest bracket (its model wants results at the
    # larger budgets soonest); plain HyperBand with the least complete one. Measured on
    # bench_search's bohb_exploit, seeds 0-4: least complete first reached random search's
    # best on 1 seed, oldest first on 3.
    from types import SimpleNamespace

    from ray.tune.experiment import Trial

    built = _nine_units(scheduler)
    trials = [Trial("stand_in", stub=True)]
    built.on_trial_add(None, trials[0])
    oldest = built._trial_info[trials[0]][0]
    while built._trial_info[trials[-1]][0] is oldest:  # fill it, and one into the next bracket
        trials.append(Trial("stand_in", stub=True))
        built.on_trial_add(None, trials[-1])
    for trial in trials[:-1]:  # the oldest bracket's rung reached: one promoted, the rest wait
        oldest.update_trial_stats(trial, {budget_key(TIME_ATTR): 1.0})
        trial.set_status(Trial.PAUSED)
    oldest.trials_to_unpause.add(trials[0])
    controller = SimpleNamespace(get_trials=lambda: trials, search_alg=None)
    chosen = built.choose_trial_to_run(controller)
    assert chosen is {"promoted": trials[0], "new": trials[-1]}[first]


@pytest.mark.parametrize("scheduler", ["hyperband", "bohb"])
def test_a_restored_scheduler_has_its_brackets_back_with_each_trial_where_it_was(scheduler):
    # Tune restores each trial from its saved state (most recent first, the unfinished ones
    # pending) to a scheduler as it was made; BracketState hands that scheduler the brackets
    # it saved. Here the first bracket has halved at its rung (3 of 9 kept: one promoted,
    # two paused waiting for a slot; 6 pruned) and the next has a trial running and one
    # not yet started.
    import pickle

    from ray.tune.experiment import Trial

    from sweeper.sweep.ray_patches import BracketState

    built = _nine_units(scheduler, brackets=1)  # brackets of 9 trials from the first rung
    trials = [Trial("stand_in", stub=True) for _ in range(11)]
    for trial in trials:
        built.on_trial_add(None, trial)
    first = built._trial_info[trials[0]][0]
    ranked = [t for t in trials if built._trial_info[t][0] is first]
    assert len(ranked) == 9
    for i, trial in enumerate(ranked):
        first.update_trial_stats(trial, {budget_key(TIME_ATTR): 1.0, METRIC: 3.0 + i})
        trial.set_status(Trial.PAUSED)
    good, bad = first.successive_halving(METRIC, built._metric_op)
    for trial in bad:
        first.cleanup_trial(trial)
        trial.set_status(Trial.TERMINATED)
    first.trials_to_unpause.add(good[-1])
    running, waiting = [t for t in trials if t not in ranked]
    built._trial_info[running][0].update_trial_stats(running, {budget_key(TIME_ATTR): 2.0})
    running.set_status(Trial.RUNNING)

    saved = pickle.loads(pickle.dumps(BracketState(built).get_state()))  # as Tune stores it
    restored = _nine_units(scheduler, brackets=1)
    BracketState(restored).set_state(saved)
    # Tune's saved statuses lag behind: a trial stopped while paused still reads PAUSED,
    # so it comes back pending like every unfinished one
    copies = {}
    for trial in reversed(trials):
        copy = Trial("stand_in", stub=True, trial_id=trial.trial_id)
        copy.set_status(Trial.TERMINATED if trial in bad[:2] else Trial.PENDING)
        restored.on_trial_add(None, copy)
        copies[trial.trial_id] = copy

    assert BracketState(restored).get_state() == saved
    status = {t.trial_id: copies[t.trial_id].status for t in trials}
    assert {status[t.trial_id] for t in bad} == {Trial.TERMINATED}  # pruned: not trained again
    assert [status[t.trial_id] for t in good] == [Trial.PAUSED] * 3  # still at their rung
    assert status[running.trial_id] == status[waiting.trial_id] == Trial.PENDING
    # both go on with the same trial, and the next trial to come joins the same bracket
    copy_of = lambda t: copies[t.trial_id]
    stand_in = SimpleNamespace(get_trials=lambda: [copy_of(t) for t in trials], search_alg=None)
    original = SimpleNamespace(get_trials=lambda: trials, search_alg=None)
    choice = built.choose_trial_to_run(original)
    assert copy_of(choice) is restored.choose_trial_to_run(stand_in)
    newcomer = [Trial("stand_in", stub=True) for _ in range(2)]
    built.on_trial_add(None, newcomer[0])
    restored.on_trial_add(None, newcomer[1])
    before = [t.trial_id for t in built._trial_info[newcomer[0]][0]._all_trials[:-1]]
    after = [t.trial_id for t in restored._trial_info[newcomer[1]][0]._all_trials[:-1]]
    assert before == after


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_bohb_learns_from_every_result_that_reaches_the_full_budget(ray_session, tmp_path):
    # Tune withholds a result from the searcher when the scheduler stops its trial, and
    # HyperBandForBOHB stops the trial whose result completes a rung: unforwarded, TuneBOHB
    # saw 4 of 12 full-budget results. Units of 3 steps: brackets of 3 trials at 3 steps
    # (one goes on to 9) and 2 trials of 9 steps.
    params = {"optimizer.lr": {"log_uniform": [1e-3, 1.0]}, "model.n_layer": 1}
    alg, results = _fit("bohb", "bohb", params, 3, 10, tmp_path)
    full = sum(r.metrics[TIME_ATTR] == STEPS * TOKENS_PER_STEP for r in results)
    learnt = alg.bohber.configs[3]  # hpbandster's record of results at the full budget
    assert full >= 4 and len(learnt) == full
    assert len({tuple(c) for c in learnt}) == full  # each once


def _tuner(param_space, alg, sched, tmp_path, **tune_config):
    from ray import tune

    return tune.Tuner(
        quadratic_trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(search_alg=alg, scheduler=sched, num_samples=1, **tune_config),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="quirk", verbose=0),
    )


@pytest.mark.slow
def test_ray_refuses_domains_beside_a_searcher_that_owns_the_space(ray_session, tmp_path):
    from ray import tune

    space = parse_space(SAMPLED)
    alg, _ = build_searcher("tpe", space, metric=METRIC, mode=MODE, seed=0, num_samples=1)
    with pytest.raises(Exception, match="unresolved parameters"):
        _tuner({"optimizer.lr": tune.uniform(0, 1)}, alg, None, tmp_path).fit()


@pytest.mark.slow
def test_ray_refuses_metric_in_both_scheduler_and_tune_config(ray_session, tmp_path):
    space = parse_space(MIXED)
    alg, param_space = build_searcher(
        "random", space, metric=METRIC, mode=MODE, seed=0, num_samples=1
    )
    sched = build_scheduler(
        "asha", metric=METRIC, mode=MODE, time_attr=TIME_ATTR, max_t=9, grace_period=1
    )
    with pytest.raises(Exception, match="scheduler you are using was already instantiated"):
        _tuner(param_space, alg, sched, tmp_path, metric=METRIC, mode=MODE).fit()


def test_the_ray_internals_the_bracket_fixes_rely_on_are_there():
    """sweep/ray_patches.py subclasses Ray's HyperBand bracket and schedulers and reads their
    private state (ray-project/ray#12536, #30838). A Ray release that renames any of it
    fails here, by name, before a sweep misbehaves; pyproject.toml pins the tested minor."""
    import inspect

    import ray
    from ray.tune.schedulers import AsyncHyperBandScheduler, HyperBandScheduler
    from ray.tune.schedulers.async_hyperband import _Bracket as AshaBracket
    from ray.tune.schedulers.hyperband import _Bracket
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    assert ray.__version__.startswith("2.60."), ray.__version__
    bracket = _Bracket(
        time_attr="t", max_trials=3, init_t_attr=1, max_t_attr=9, eta=3, s=2,
        stop_last_trials=True,
    )  # fmt: skip
    for name in ("_n0", "_live_trials", "_all_trials", "_n", "_r", "_cumul_r", "_halves"):
        assert hasattr(bracket, name), f"_Bracket.{name}"
    for name in ("_completed_progress", "is_being_processed", "trials_to_unpause"):
        assert hasattr(bracket, name), f"_Bracket.{name}"
    assert callable(bracket.filled) and callable(bracket.current_trials)
    scheduler = HyperBandScheduler(time_attr="t", max_t=9, metric="m", mode="min")
    for name in ("_hyperbands", "_state", "_trial_info", "_num_stopped", "_s_max_1", "_eta"):
        assert hasattr(scheduler, name), f"HyperBandScheduler.{name}"
    for name in ("_max_t_attr", "_stop_last_trials", "_time_attr", "_metric"):
        assert hasattr(scheduler, name), f"HyperBandScheduler.{name}"
    for method in ("_get_n0", "_get_r0", "_process_bracket", "_unpause_trial"):
        assert callable(getattr(scheduler, method)), f"HyperBandScheduler.{method}"
    for method in ("_cur_band_filled", "_create_bracket", "choose_trial_to_run"):
        assert callable(getattr(scheduler, method)), f"HyperBandScheduler.{method}"
    assert "_live_trials" in inspect.getsource(BasicVariantGenerator.__init__)
    assert "live_trials" in inspect.getsource(ConcurrencyLimiter.__init__)
    asha = AsyncHyperBandScheduler(time_attr="t", max_t=9, metric="m", mode="min")
    assert isinstance(asha._brackets[0], AshaBracket) and hasattr(asha._brackets[0], "_rungs")
    assert callable(asha._brackets[0].on_result)
