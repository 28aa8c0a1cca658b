"""Ray Tune searchers and trial schedulers built from a parsed :class:`Space`, and the check
(``check_compatible``) that refuses a bad (search, scheduler, space) before Ray starts.

Metric and mode go to the searcher and the scheduler here, so leave them out of
``tune.TuneConfig``: Ray refuses an ASHA/HyperBand scheduler that already has a metric when
TuneConfig names one too. Ray, Optuna and hpbandster are imported lazily inside the builders.
"""

from __future__ import annotations

from typing import Any

from sweeper.config.sweep import SCHEDULERS, SEARCHES
from sweeper.sweep.rungs import _check_time_axis
from sweeper.sweep.space import Space, to_configspace, to_optuna, to_tune

# Searchers that own the space and learn a model of it: they cannot enumerate grid values.
MODEL_BASED = frozenset({"tpe", "gp", "bohb"})
MODES = ("min", "max")


def _check_name(what: str, name: object, allowed: tuple[str, ...]) -> None:
    if name not in allowed:
        raise ValueError(f"unknown {what} {name!r}; expected one of {list(allowed)}")


def _check_search_space(search: str, space: Space) -> None:
    if search in MODEL_BASED:
        grid = [p.name for p in space.params if p.kind == "grid"]
        if grid:
            raise ValueError(
                f"search {search!r} samples from distributions and cannot enumerate grid "
                f"params ({', '.join(grid)}); use choice: for them, or search: grid/random"
            )
    if search == "grid":
        sampled = [f"{p.name} ({p.kind})" for p in space.params if p.kind != "grid"]
        if sampled:
            raise ValueError(
                f"search 'grid' runs every grid value once and cannot sample "
                f"{', '.join(sampled)}; give them grid: values, or use search: random"
            )


def check_compatible(search: str, scheduler: str, space: Space) -> None:
    """Raise a one-line ``ValueError`` for a combination Ray would reject or mishandle."""
    _check_name("search", search, SEARCHES)
    _check_name("scheduler", scheduler, SCHEDULERS)
    # TuneBOHB learns only from the budgets HyperBandForBOHB attaches to results, and
    # HyperBandForBOHB calls on_pause/on_unpause, which only TuneBOHB implements.
    if search == "bohb" and scheduler != "bohb":
        raise ValueError(f"search 'bohb' needs scheduler 'bohb', got scheduler {scheduler!r}")
    if scheduler == "bohb" and search != "bohb":
        raise ValueError(f"scheduler 'bohb' needs search 'bohb', got search {search!r}")
    _check_search_space(search, space)


def _check_mode(mode: object) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")


def metric_reader(search: str, scheduler: str) -> str | None:
    """What ranks every report of a trial by the metric ("the asha scheduler", "the tpe
    search"), so that Ray refuses a report without it; None for fifo with random or grid,
    which look only at a trial's last report (their Ray objects hold no metric)."""
    if scheduler != "fifo":
        return f"the {scheduler} scheduler"
    return f"the {search} search" if search in MODEL_BASED else None


def startup_trials(num_samples: int) -> int:
    """Random trials before TPE/GP start modelling: a third of the budget, capped at Optuna's
    default of 10, which alone would leave a small sweep entirely random."""
    return max(1, min(10, num_samples // 3))


def bohb_model_points(space: Space) -> int:
    """Results at one budget before BOHB's model replaces random draws: hpbandster splits
    them into good and bad sets of at least dims + 1 each (``min_points_in_model``) and
    fits a KDE to each only when it has more points than dimensions."""
    return 2 * (len(space.names) + 1)


def random_start(search: str, space: Space, num_samples: int, given: int = 0) -> str | None:
    """What a model-based search does before its model guides it (the stage's header).
    Optuna counts `given` points among its startup trials."""
    if search in ("tpe", "gp"):
        startup = startup_trials(num_samples)
        if given:
            return f"its model proposes from trial {max(startup, given) + 1}"
        if startup == 1:
            return "the first trial is random"
        return f"the first {startup} trials are random"
    if search == "bohb":
        return f"random until {bohb_model_points(space)} trials reach one budget"
    return None


def _optuna_sampler(search: str, seed: int | None, num_samples: int) -> Any:
    import optuna

    # its INFO line per stage ("A new study created in memory") is not the user's business
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # GPSampler handles float, int and categorical params; it needs torch and scipy.
    sampler = optuna.samplers.TPESampler if search == "tpe" else optuna.samplers.GPSampler
    return sampler(seed=seed, n_startup_trials=startup_trials(num_samples))


def build_searcher(
    search: str,
    space: Space,
    *,
    metric: str,
    mode: str,
    seed: int | None,
    num_samples: int,
    max_concurrent: int | None = None,
    bohb: dict[str, Any] | None = None,
    points: list[dict[str, Any]] | None = None,
    worst_on_divergence: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Return ``(search_alg, param_space)`` for ``TuneConfig`` and ``Tuner``.

    random/grid: a seeded ``BasicVariantGenerator``; the Tune domains go in ``param_space``.
    tpe/gp/bohb: the searcher owns the space, so ``param_space`` holds only the fixed values
    (Ray raises if a searcher built with a space also meets unresolved domains there).
    ``num_samples`` sizes the random start-up phase of TPE/GP; for search 'grid' pass
    ``num_samples=1`` to ``TuneConfig`` (Tune repeats the whole grid ``num_samples`` times).
    ``bohb``: keyword arguments of hpbandster's BOHB model (search 'bohb' only).
    ``points``: complete ``{dotted name: value}`` configurations every searcher runs first
    (``space.parse_points`` checks them); they count towards ``num_samples``. The model-based
    searchers learn from their results like any other trial's.
    ``max_concurrent`` counts trials that run, not those HyperBand/BOHB paused at a rung.
    ``worst_on_divergence``: tpe/gp are told a diverged trial (status=diverged) as the worst
    value, not its penalty (``optuna_search``); False where the user chose the penalty.
    """
    _check_name("search", search, SEARCHES)
    _check_mode(mode)
    _check_search_space(search, space)
    if max_concurrent is not None and max_concurrent < 1:
        raise ValueError(f"max_concurrent must be >= 1 or None, got {max_concurrent!r}")
    if points and search == "grid":
        raise ValueError("search 'grid' runs every grid value; it takes no points")
    points = [dict(point) for point in points or []]  # the searchers pop them
    if search in ("random", "grid"):
        from sweeper.sweep.ray_patches import RunningVariantGenerator

        generator = RunningVariantGenerator(
            max_concurrent=max_concurrent or 0, random_state=seed, points_to_evaluate=points
        )
        return generator, {**space.fixed, **to_tune(space)}
    shared = {"metric": metric, "mode": mode, "points_to_evaluate": points}
    if search == "bohb":
        from ray.tune.search.bohb import TuneBOHB

        searcher = TuneBOHB(space=to_configspace(space), seed=seed, bohb_config=bohb, **shared)
    else:
        from ray.tune.search.optuna import OptunaSearch

        from sweeper.sweep.optuna_search import WorstOnDivergenceOptunaSearch

        sampler = _optuna_sampler(search, seed, num_samples)
        optuna_search = WorstOnDivergenceOptunaSearch if worst_on_divergence else OptunaSearch
        searcher = optuna_search(space=to_optuna(space), sampler=sampler, **shared)
    if max_concurrent is not None:
        from sweeper.sweep.ray_patches import RunningLimiter

        searcher = RunningLimiter(searcher, max_concurrent=max_concurrent)
    return searcher, dict(space.fixed)


def build_scheduler(
    scheduler: str,
    *,
    metric: str | None,
    mode: str | None,
    time_attr: str,
    max_t: float,
    grace_period: float,
    reduction_factor: float = 3,
    max_concurrent: int | None = None,
    brackets: int | None = None,
) -> Any:
    """Return the Tune trial scheduler; ``max_t`` and ``grace_period`` are in ``time_attr``.

    fifo runs every trial to completion (the trainable stops itself at its budget).
    asha stops trials at rungs ``grace_period * reduction_factor**k``. hyperband/bohb stop
    them synchronously and pause trials between rungs, so the trainable must checkpoint;
    their rungs are ``max_t / reduction_factor**j``, the smallest no shorter than
    ``grace_period`` (see ``hyperband_units``). ``max_concurrent``: hyperband/bohb resume a
    paused trial only while fewer trials run (pass the searcher's limit: see ``hyperband``).
    ``brackets``: how many brackets hyperband/bohb cycle through, the most aggressive kept
    (None: all of them, as HyperBand is published; 1: successive halving from
    ``grace_period``), and ASHA's own ``brackets`` (None: Ray's 1).
    Pass ``metric=None, mode=None`` to take them from ``TuneConfig`` instead.
    """
    _check_name("scheduler", scheduler, SCHEDULERS)
    if mode is not None:
        _check_mode(mode)
    _check_time_axis(scheduler, max_t, grace_period, reduction_factor)
    if brackets is not None and brackets < 1:
        raise ValueError(f"brackets must be >= 1 or None, got {brackets!r}")
    from ray.tune import schedulers

    if scheduler == "fifo":
        return schedulers.FIFOScheduler()
    if scheduler == "asha":
        return schedulers.ASHAScheduler(
            time_attr=time_attr,
            metric=metric,
            mode=mode,
            max_t=max_t,
            grace_period=grace_period,
            reduction_factor=reduction_factor,
            brackets=brackets or 1,
            # a user's function's budget is its own: counted in reports (no compute budget),
            # max_t only places the rungs, and the trial is not cut at its max_t-th report
            stop_last_trials=time_attr != "training_iteration",
        )
    from sweeper.sweep.ray_patches import grace_unit_scheduler

    base = schedulers.HyperBandForBOHB if scheduler == "bohb" else schedulers.HyperBandScheduler
    return grace_unit_scheduler(base)(
        time_attr=time_attr,
        grace_period=grace_period,
        metric=metric,
        mode=mode,
        max_t=max_t,
        reduction_factor=int(reduction_factor),
        max_concurrent=max_concurrent,
        brackets=brackets,
    )
