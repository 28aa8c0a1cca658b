"""Pure helpers of the staged sweep: freezing, the LR rule, picking the best trial."""

import dataclasses
import math
import shlex
from pathlib import Path

import numpy as np
import pytest

from sweeper.config.compose import compose
from sweeper.config.errors import ConfigError
from sweeper.config.sweep import flatten, load_sweep_spec
from sweeper.sweep.preflight import build_plan
from sweeper.sweep.results import error_summary
from sweeper.sweep.runner import SweepFailed, idle_gpus_hint
from sweeper.sweep.stages import (
    apply_params,
    follow_batch_size,
    get_dotted,
    lr_scale,
    pick_best,
    reproduce_overrides,
)
from sweeper.sweep.trainable import TrialContext, placed, trial_config
from sweeper.text import hydra_value
from tests.conftest import plan_for

BASE = {
    "optimizer": {"matrix_lr": 0.02, "embedding_lr": 0.2},
    "trainer": {"total_batch_size": 8192},
}
KEYS = ["optimizer.matrix_lr", "optimizer.embedding_lr"]


@pytest.mark.parametrize(
    "rule, batch, expected",
    [("sqrt", 32768, 2.0), ("linear", 16384, 2.0), ("none", 32768, 1.0), ("sqrt", 2048, 0.5)],
)
def test_lr_scale(rule, batch, expected):
    assert lr_scale(rule, batch, 8192) == pytest.approx(expected)


def test_frozen_lrs_follow_the_batch_size_but_sampled_ones_do_not():
    config = apply_params(BASE, {"trainer.total_batch_size": 32768})
    scaled = follow_batch_size(config, "sqrt", 8192, KEYS, sampled={"optimizer.embedding_lr"})
    assert scaled["optimizer"]["matrix_lr"] == pytest.approx(0.04)
    assert scaled["optimizer"]["embedding_lr"] == 0.2
    assert BASE["optimizer"]["matrix_lr"] == 0.02  # the base is never mutated


def test_trial_config_applies_params_then_the_rule():
    ctx = TrialContext(
        metric="val_bpb", penalty=8.0, lr_rule="linear", base_batch=8192, lr_keys=tuple(KEYS)
    )
    config = trial_config({"trainer.total_batch_size": 4096}, BASE, ctx)
    assert config["optimizer"] == {"matrix_lr": 0.01, "embedding_lr": 0.1}


ADAMW_LR_STAGE = [
    "~sweep.stages.0.params.optimizer",
    "+sweep.stages.0.params.optimizer.lr.log_uniform=[0.0003,0.01]",
]


@pytest.mark.parametrize(
    "overrides, rescaled, left",
    [
        ([], "matrix_lr", "lr"),  # muon_adamw does not read optimizer.lr
        # adamw reads nothing else; its LR stage searches the one LR it reads
        (["optimizer=adamw", *ADAMW_LR_STAGE], "lr", "matrix_lr"),
    ],
)
def test_only_the_lrs_the_optimizer_reads_follow_the_batch_size(overrides, rescaled, left):
    cfg = compose(["+sweep=lr_bs", *overrides])
    plan = build_plan(cfg)
    spec, base = plan.spec, plan.base
    batch_stage = spec.stages[1]
    ctx = plan.trial_context(batch_stage, base)
    config = trial_config({"trainer.total_batch_size": 32768}, base, ctx)
    factor = (32768 / base["trainer"]["total_batch_size"]) ** 0.5  # lr_bs: lr_rule=sqrt
    assert config["optimizer"][rescaled] == pytest.approx(base["optimizer"][rescaled] * factor)
    assert config["optimizer"][left] == base["optimizer"][left]
    # so the reproduce line names the batch and the LRs that moved, nothing that does nothing
    overrides_out = reproduce_overrides(config)
    assert f"optimizer.{rescaled}=" in " ".join(overrides_out)
    assert not [o for o in overrides_out if o.startswith(f"optimizer.{left}=")]


def test_an_lr_the_optimizer_does_not_read_gets_no_retune_band():
    retune = ["sweep.stages.1.lr_rule=retune", "sweep.stages.1.search=random"]
    cfg = compose(["+sweep=lr_bs", *retune])
    plan = build_plan(cfg)
    spec, base = plan.spec, plan.base
    space = plan_for(spec).space(spec.stages[1], flatten(base))
    assert set(space.names) == {
        "trainer.total_batch_size",
        "optimizer.matrix_lr",
        "optimizer.embedding_lr",
        "optimizer.unembedding_lr",
        "optimizer.scalar_lr",
    }
    # a stage that chooses the optimizer keeps every LR: which one is read depends on the trial
    choose = "+sweep.stages.1.params.optimizer.name={grid:[adamw,muon_adamw]}"
    assert "optimizer.lr" in build_plan(compose(["+sweep=lr_bs", choose])).spec.lr_keys


def test_a_random_search_over_a_grid_and_sampled_params_counts_each_draw_at_every_grid_point():
    # Tune runs the grid once per sample: 3 draws of the LR bands x 3 batch sizes
    retune = ["sweep.stages.1.lr_rule=retune", "sweep.stages.1.search=random"]
    cfg = compose(["+sweep=lr_bs", *retune, "sweep.stages.1.num_samples=3"])
    plan = build_plan(cfg)
    spec, base = plan.spec, plan.base
    assert plan.planned_trials(spec.stages[1], base) == 9
    # the grid alone: every point once, whatever num_samples says; sampled alone: the draws
    assert plan.planned_trials(dataclasses.replace(spec.stages[1], lr_rule="sqrt"), base) == 3
    assert plan.planned_trials(spec.stages[0], base) == spec.stages[0].num_samples


@pytest.mark.parametrize(
    "device, workers, gpus, expected",
    [
        ("auto", 1, 0.0, "cpu"),  # Ray 2.60 shows a GPU-less trial the GPUs: not for it
        ("auto", 1, 0.5, "cuda"),
        ("auto", 2, 0.0, "auto"),  # a DDP trial's ranks ask Ray Train for GPUs themselves
        ("cpu", 1, 1.0, "cpu"),
        ("cuda", 1, 1.0, "cuda"),
    ],
)
def test_a_trial_is_placed_as_ray_places_it(device, workers, gpus, expected):
    base = {"trainer": {"device": device, "workers": workers, "threads": None}}
    ctx = TrialContext(metric="val_bpb", penalty=8.0, threads=3, gpus=gpus)
    config = trial_config({}, base, ctx)
    assert config["trainer"] == {"device": expected, "workers": workers, "threads": 3}
    assert config == placed(base, 3, gpus) and base["trainer"]["threads"] is None
    # a user's function gets the config as composed: sweeper does not run it
    mine = TrialContext(metric="val_bpb", penalty=8.0, target="pkg.fn", threads=3, gpus=gpus)
    assert trial_config({}, base, mine) == base


def test_gpus_beside_trials_given_none_get_one_line_that_says_how_to_use_them():
    spec = load_sweep_spec({"name": "s", "stages": []})
    base = {"trainer": {"device": "auto", "workers": 1}}
    hint = idle_gpus_hint(plan_for(spec, base), gpus=8)
    assert hint and "beside 8 GPUs" in hint and "sweep.gpus_per_trial=1" in hint
    assert idle_gpus_hint(plan_for(spec, base), gpus=0) is None
    assert idle_gpus_hint(plan_for(spec, base, "pkg.fn"), gpus=8) is None  # a user's function
    cpu = {"trainer": {"device": "cpu", "workers": 1}}
    assert idle_gpus_hint(plan_for(spec, cpu), gpus=8) is None  # asked for the CPU
    spec.gpus_per_trial = 1.0
    assert idle_gpus_hint(plan_for(spec, base), gpus=8) is None


def test_cuda_trials_given_no_gpu_are_refused_before_ray_starts():
    with pytest.raises(ConfigError, match="trainer.device=cuda but sweep.gpus_per_trial=0"):
        build_plan(compose(["+sweep=smoke", "trainer.device=cuda"]))


def test_pick_best_prefers_trials_that_ran_their_whole_budget():
    trials = [
        {"trial_id": "a", "status": "pruned", "metric": 1.0},
        {"trial_id": "b", "status": "completed", "metric": 2.0},
        {"trial_id": "c", "status": "completed", "metric": 1.5},
        {"trial_id": "d", "status": "diverged", "metric": None},
        {"trial_id": "e", "status": "completed", "metric": math.nan},
    ]
    assert pick_best(trials, "val_bpb", "min")["trial_id"] == "c"
    assert pick_best(trials, "val_bpb", "max")["trial_id"] == "b"
    assert pick_best(trials[:1], "val_bpb", "min")["trial_id"] == "a"
    assert pick_best([trials[3]], "val_bpb", "min") is None
    # a diverged trial's value is the searcher's penalty: never anyone's best
    penalised = {"trial_id": "p", "status": "diverged", "metric": 8.0}
    assert pick_best([penalised], "val_bpb", "min") is None
    assert pick_best([penalised, trials[0]], "val_bpb", "max")["trial_id"] == "a"


def test_a_stage_keeps_its_start_only_where_the_two_values_compare():
    from sweeper.sweep.stages import keeps_its_start

    def trial(params, metric, status="completed", **extra):
        return {"params": params, "metric": metric, "status": status, **extra}

    start = trial({"optimizer.matrix_lr": 0.02}, 3.0)
    worse = trial({"trainer.total_batch_size": 2048}, 3.1)
    assert keeps_its_start(start, worse, "min")
    assert not keeps_its_start(start, worse, "max")
    assert not keeps_its_start(start, trial({"trainer.total_batch_size": 2048}, 2.9), "min")
    assert not keeps_its_start(None, worse, "min") and not keeps_its_start(start, None, "min")
    # a pruned start, a stage over budgets or seeds: other budgets, other noise
    assert not keeps_its_start(trial(start["params"], 3.0, "pruned"), worse, "min")
    assert not keeps_its_start(start, trial({"trainer.budget_tokens": 1e6}, 3.1), "min")
    assert not keeps_its_start(start, trial({}, 3.1, seeds=[0, 1]), "min")


def test_a_configuration_run_on_several_seeds_ranks_by_its_mean():
    def trial(tid, lr, seed, metric, status="completed"):
        params = {"optimizer.matrix_lr": lr, "trainer.seed": seed}
        return {"trial_id": tid, "status": status, "metric": metric, "params": params}

    trials = [
        trial("a0", 0.02, 0, 3.00),  # the single best run: a lucky seed
        trial("a1", 0.02, 1, 3.40),
        trial("b0", 0.04, 0, 3.10),
        trial("b1", 0.04, 1, 3.12),
        trial("c0", 0.08, 0, 2.90),  # lowest of all, but diverged on its other seed
        trial("c1", 0.08, 1, None, "diverged"),
    ]
    best = pick_best(trials, "val_bpb", "min")
    assert best["params"] == {"optimizer.matrix_lr": 0.04}  # the seed is not frozen
    assert best["metric"] == pytest.approx(3.11)
    assert best["seeds"] == [0, 1] and best["trial_ids"] == ["b0", "b1"]
    assert best["trial_id"] == "b0"
    # one seed per configuration: the best run, as ever
    alone = pick_best([t for t in trials if t["params"]["trainer.seed"] == 0], "val_bpb", "min")
    assert alone["trial_id"] == "c0" and "seeds" not in alone
    # a seed axis with the other params differing everywhere groups nothing
    assert "seeds" not in pick_best([trials[0], trials[3]], "val_bpb", "min")


def test_the_configurations_a_seeded_best_does_not_clearly_beat_are_named(capsys):
    from sweeper.config.sweep import SweepSpec
    from sweeper.report.summary import print_stage_table
    from sweeper.sweep.stages import unresolved_rivals

    def trial(lr, seed, metric, status="completed"):
        params = {"optimizer.matrix_lr": lr, "trainer.seed": seed}
        return {"trial_id": f"{lr}-{seed}", "status": status, "metric": metric, "params": params}

    luck = [0.0, 0.3, -0.2]  # each seed's own luck, shared by its runs
    near = [0.05, -0.01, 0.02]  # 0.04 trails 0.02 by these: mean 0.02, scattered
    trials = (
        [trial(0.02, s, 3.0 + luck[s]) for s in range(3)]
        + [trial(0.04, s, 3.0 + luck[s] + near[s]) for s in range(3)]
        + [trial(0.01, s, 3.1 + luck[s]) for s in range(3)]  # 0.1 behind on every seed
        # diverged on seed 2: compared on seeds 0 and 1, where it wins one
        + [trial(0.08, 0, 2.99), trial(0.08, 1, 3.4), trial(0.08, 2, None, "diverged")]
    )
    best = pick_best(trials, "val_bpb", "min")
    assert best["params"] == {"optimizer.matrix_lr": 0.02}
    m = np.array(near)
    lower = m.mean() - 2.919986 * m.std(ddof=1) / math.sqrt(3)  # t(0.95, 2)
    assert unresolved_rivals(trials, best, "min") == [
        {
            "params": {"optimizer.matrix_lr": 0.04},
            "mean": pytest.approx(3.0 + np.mean(luck) + m.mean()),
            "note": f"paired lower bound {lower:.3g}",
        },
        {
            "params": {"optimizer.matrix_lr": 0.08},
            "mean": pytest.approx((2.99 + 3.4) / 2),
            "note": "the best won on 1 of 2 seeds",
        },
    ]
    # maximising: the same runs with the metric's sign turned, the same verdicts
    flipped = [{**t, "metric": None if t["metric"] is None else -t["metric"]} for t in trials]
    best_max = pick_best(flipped, "val_bpb", "max")
    notes = [r["note"] for r in unresolved_rivals(flipped, best_max, "max")]
    assert notes == [f"paired lower bound {lower:.3g}", "the best won on 1 of 2 seeds"]
    # a best from one seed, or none, has no rivals to name
    assert unresolved_rivals(trials, pick_best(trials[:1], "val_bpb", "min"), "min") == []
    assert unresolved_rivals(trials, None, "min") == []

    spec = SweepSpec(name="t", metric="val_bpb", mode="min", stages=[])
    print_stage_table("lr", trials, best, spec)
    out = capsys.readouterr().out
    assert (
        "  not resolved: the seeds cannot tell it from optimizer.matrix_lr=0.04 (paired lower "
        f"bound {lower:.3g}); optimizer.matrix_lr=0.08 (the best won on 1 of 2 seeds)\n"
    ) in out


def test_reproduce_overrides_are_the_changes_from_the_default_run():
    from sweeper.config.schema import RunConfig

    final = RunConfig().to_dict()
    final["optimizer"]["matrix_lr"] = 0.05
    final["trainer"]["budget_tokens"] = 1000.0
    assert reproduce_overrides(final) == [
        "optimizer.matrix_lr=0.05",
        "trainer.budget_tokens=1000.0",
    ]
    assert hydra_value(None) == "null" and hydra_value(True) == "true"


def test_a_users_function_s_reproduce_line_composes_back_to_the_config_of_its_best():
    """Keys of the user's own in sweeper's sections (`+model.dropout`) make no valid run;
    the line then dropped the base's own overrides (model.depth=6), the user's sections
    (+mine.layers=3), and wrote the new key without the + that Hydra asks for."""
    from omegaconf import OmegaConf

    from sweeper.report.summary import _overrides
    from sweeper.user_function import user_function_config

    target = "tests.user_functions.noisy_bowl"
    given = [f"trainable._target_={target}", "+model.dropout=0.1", "model.depth=6"]
    base = user_function_config(compose([*given, "+mine.layers=3"]))
    best = apply_params(base, {"model.dropout": 0.2})
    line = _overrides(best, reproduce_overrides, target)
    assert line[0] == f"trainable._target_={target}"
    again = user_function_config(compose(line))
    assert again == best and OmegaConf.to_container(compose(line).trainable)["_target_"] == target


@pytest.mark.parametrize(
    "value, text",
    [(1e15, "1e15"), (3e12, "3e12"), (-1.5e7, "-1.5e7"), (1e6, "1e6"), (524288.0, "524288.0"),
     (12345678.0, "12345678.0"), (0.008631, "0.008631"), (2.5e-05, "2.5e-5"), (1e16, "1e16"), (-1.5e-300, "-1.5e-300")],
)  # fmt: skip
def test_a_float_override_is_short_and_reads_back_as_the_same_float(value, text):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert hydra_value(value) == text
    override = OverridesParser.create().parse_override(f"x={text}")
    assert override.value() == value and isinstance(override.value(), float)


def test_the_reproduce_command_is_one_shell_line_that_keeps_every_override_whole():
    import shlex

    from sweeper.sweep.stages import reproduce_command

    overrides = ["data.path=/data/run 1/train_*.bin", "optimizer.matrix_lr=0.05", "x=$HOME"]
    command = reproduce_command(overrides)
    assert shlex.split(command) == ["python", "-m", "sweeper", *overrides]
    assert "optimizer.matrix_lr=0.05 " in command  # plain ones stay unquoted, readable


def test_retune_rule_searches_a_narrow_band_around_each_frozen_lr():
    from sweeper.config.sweep import StageSpec, SweepSpec

    spec = SweepSpec(lr_keys=["optimizer.matrix_lr", "optimizer.lr"])
    stage = StageSpec(
        name="bs",
        lr_rule="retune",
        retune_factor=2.0,
        params={"trainer": {"total_batch_size": {"choice": [512, 1024]}}},
    )
    space = plan_for(spec).space(stage, {"optimizer.matrix_lr": 0.02, "optimizer.lr": 0.001})
    specs = {p.name: p for p in space.params}
    assert (specs["optimizer.matrix_lr"].low, specs["optimizer.matrix_lr"].high) == (0.01, 0.04)
    assert specs["optimizer.matrix_lr"].kind == "log_uniform"
    assert specs["trainer.total_batch_size"].kind == "choice"


def test_best_values_at_an_end_of_their_range_are_named_with_what_to_change():
    from sweeper.config.sweep import StageSpec, SweepSpec
    from sweeper.sweep.extend import range_edges

    lr = StageSpec(name="lr", params={"optimizer": {"matrix_lr": {"log_uniform": [0.004, 0.1]}}})
    batch = {"trainer": {"total_batch_size": {"grid": [4096, 8192, 16384]}}}
    bs = StageSpec(name="bs", lr_rule="retune", retune_factor=2.0, params=batch)
    spec = SweepSpec(stages=[lr, bs], lr_keys=["optimizer.matrix_lr"])
    lr_bs = compose(["+sweep=lr_bs"])
    start = build_plan(lr_bs).base  # matrix_lr 0.02, batch 8192

    def best(**params):
        return {"params": {key.replace("__", "."): v for key, v in params.items()}}

    (top,) = range_edges(plan_for(spec), "lr", start, best(optimizer__matrix_lr=0.09))
    assert (top["param"], top["value"], top["side"]) == ("optimizer.matrix_lr", 0.09, "high")
    assert top["note"] == (
        "best optimizer.matrix_lr=0.09 is at the high end of its range [0.004, 0.1]: "
        "the optimum may lie above it; widen the range: "
        "'sweep.stages.0.params.optimizer.matrix_lr.log_uniform=[0.004,0.5]' "
        "(or ++sweep.stages.0.extend_trials=4: the sweep looks there itself)"
    )
    assert top["widen"] == "sweep.stages.0.params.optimizer.matrix_lr.log_uniform=[0.004,0.5]"
    # params under a dotted key: no Hydra override reaches them, so none is named
    dotted = StageSpec(name="lr", params={"optimizer.matrix_lr": {"log_uniform": [0.004, 0.1]}})
    dotted_spec = SweepSpec(stages=[dotted], lr_keys=["optimizer.matrix_lr"])
    (top,) = range_edges(plan_for(dotted_spec), "lr", start, best(optimizer__matrix_lr=0.09))
    assert top["widen"] is None and top["note"].endswith("; widen the range")
    assert range_edges(plan_for(spec), "lr", start, best(optimizer__matrix_lr=0.02)) == []
    assert range_edges(plan_for(spec), "lr", start, None) == []  # every trial diverged or failed
    # the retune stage: its LR band [0.01, 0.04] is centred on the frozen 0.02, not the user's
    edges = range_edges(
        plan_for(spec),
        "bs",
        start,
        best(optimizer__matrix_lr=0.0105, trainer__total_batch_size=4096),
    )
    notes = {edge["param"]: edge["note"] for edge in edges}
    # the next value by the grid's spacing (2048 trains in micro-batches of 8 sequences)
    assert notes["trainer.total_batch_size"].endswith(
        "of its values [4096, 8192, 16384]: the optimum may lie below it; add values beyond "
        "it: 'sweep.stages.1.params.trainer.total_batch_size.grid=[2048,4096,8192,16384]' "
        "(or ++sweep.stages.1.extend_trials=4: the sweep looks there itself)"
    )
    assert notes["optimizer.matrix_lr"].endswith(
        "range [0.01, 0.04]: the optimum may lie below it; raise sweep.stages.1.retune_factor (2)"
    )
    # a grid of compute budgets (scaling, lr_scaling): the most compute trains lowest, and
    # says nothing of an optimum beyond it; the LR beside it still does
    grid = {"trainer": {"budget_flops": {"grid": [1e12, 3e12, 1e13]}}}
    grid["optimizer"] = {"matrix_lr": {"grid": [0.01, 0.02, 0.04]}}
    spec = SweepSpec(stages=[StageSpec(name="g", params=grid)], lr_keys=["optimizer.matrix_lr"])
    at_ends = best(trainer__budget_flops=1e13, optimizer__matrix_lr=0.04)
    edges = range_edges(plan_for(spec), "g", start, at_ends)
    assert [e["param"] for e in edges] == ["optimizer.matrix_lr"]


BATCH, MATRIX_LR, EMBEDDING_LR = (
    "trainer.total_batch_size",
    "optimizer.matrix_lr",
    "optimizer.embedding_lr",
)


@pytest.mark.parametrize(
    ("overrides", "stage", "best", "edge_of", "past"),
    [
        # lr_bs's batch grid at its low end: 2048 trains in micro-batches of 8 sequences
        ([], "batch_size", {BATCH: 4096}, BATCH, 2048),
        ([], "batch_size", {BATCH: 16384}, BATCH, 32768),
        ([], "lr", {MATRIX_LR: 0.099, EMBEDDING_LR: 0.3}, MATRIX_LR, 0.1),
        ([], "lr", {MATRIX_LR: 0.02, EMBEDDING_LR: 0.031}, EMBEDDING_LR, 0.03),
        # a list of LRs at its high end: the next value by its last ratio, 0.16 * 0.16 /
        # 0.003, written as a person would (8.53, not 8.5333333333)
        (
            [
                "~sweep.stages.0.params.optimizer.matrix_lr",
                "+sweep.stages.0.params.optimizer.matrix_lr.choice=[0.002,0.003,0.16]",
            ],
            "lr",
            {MATRIX_LR: 0.16, EMBEDDING_LR: 0.3},
            MATRIX_LR,
            8.53,
        ),
        # a weight decay range from 0 has nothing below it: no edge, no note
        (
            ["+sweep.stages.0.params.optimizer.weight_decay.uniform=[0.0,0.2]"],
            "lr",
            {MATRIX_LR: 0.02, EMBEDDING_LR: 0.3, "optimizer.weight_decay": 0.0},
            None,
            None,
        ),
        # from 0.01, 0 lies below it: widened to 0
        (
            ["+sweep.stages.0.params.optimizer.weight_decay.uniform=[0.01,0.2]"],
            "lr",
            {MATRIX_LR: 0.02, EMBEDDING_LR: 0.3, "optimizer.weight_decay": 0.01},
            "optimizer.weight_decay",
            0.005,
        ),
        # a warm-up of 0.5 beside the warm-down's 0.4: the range just above would end at
        # 0.7, but the two must sum to at most 1, so it is cut at 0.6
        (
            ["+sweep.stages.0.params.scheduler.warmup_ratio.uniform=[0.1,0.5]"],
            "lr",
            {MATRIX_LR: 0.02, EMBEDDING_LR: 0.3, "scheduler.warmup_ratio": 0.5},
            "scheduler.warmup_ratio",
            0.55,
        ),
        # ... and from 0.6 nothing lies above: no edge
        (
            ["+sweep.stages.0.params.scheduler.warmup_ratio.uniform=[0.1,0.6]"],
            "lr",
            {MATRIX_LR: 0.02, EMBEDDING_LR: 0.3, "scheduler.warmup_ratio": 0.6},
            None,
            None,
        ),
    ],
)
def test_the_override_a_range_edge_names_makes_a_sweep_that_searches_past_it(
    overrides, stage, best, edge_of, past
):
    from sweeper.sweep.extend import range_edges, searched_params

    plan = build_plan(compose(["+sweep=lr_bs", *overrides]))
    edges = range_edges(plan, stage, plan.base, {"params": best})
    if edge_of is None:
        assert edges == []
        return
    (edge,) = edges
    assert edge["param"] == edge_of
    if past is None:
        assert edge["widen"] is None
        assert edge["note"].endswith("; widen the range")
        return
    listed = edge["widen"].split("=")[0].endswith((".grid", ".choice"))
    assert f"; {'add values beyond it' if listed else 'widen the range'}: " in edge["note"]
    assert shlex.quote(edge["widen"]) in edge["note"]
    # the sweep it makes passes the checks made before Ray starts (a value that is no valid
    # run is refused there), and its stage searches past the old end
    again = build_plan(compose(["+sweep=lr_bs", *overrides, edge["widen"]]))
    searched = searched_params(again, stage, again.base)
    (param,) = [p for p in searched if p.name == edge_of]
    if param.values:
        assert past in param.values
    elif edge["side"] == "low":
        assert param.low < past
    else:
        assert param.high > past
    # or the sweep searches past it itself, as the note offers
    extend = edge["note"].split("(or ")[1].split(":")[0]
    extended = build_plan(compose(["+sweep=lr_bs", *overrides, extend]))
    assert {s.name: s.extend_trials for s in extended.stages}[stage] == 4


@pytest.mark.parametrize(
    ("device_batch", "workers", "batch", "fitted"),
    [
        (16, 1, 8192, 16),  # divides: unchanged
        (16, 1, 2048, 8),
        (16, 1, 1024, 4),
        (16, 1, 3072, 12),  # 12 sequences: the largest divisor up to 16
        (16, 1, 256, 1),
        (16, 2, 2048, 4),  # DDP: each of 2 ranks takes 4 sequences of 256 tokens
        (16, 1, 1000, 16),  # no whole number of sequences: left for the run's check
    ],
)
def test_a_sweeps_micro_batch_is_the_largest_that_divides_the_batch(
    device_batch, workers, batch, fitted
):
    from sweeper.config.schema import load_run_config
    from sweeper.sweep.stages import fit_micro_batch

    cfg = compose(["+sweep=lr_bs", f"trainer.device_batch_size={device_batch}"])
    base = build_plan(cfg).base
    base["trainer"]["workers"] = workers
    run = fit_micro_batch(apply_params(base, {BATCH: batch}))
    assert run["trainer"]["device_batch_size"] == fitted
    assert run["trainer"]["total_batch_size"] == batch
    if batch % 256 == 0:
        load_run_config(run)  # a valid run
    else:
        with pytest.raises(ConfigError, match="got 1000"):
            load_run_config(run)
    # the base config itself is not touched
    assert base["trainer"]["device_batch_size"] == device_batch


def test_a_batch_below_the_micro_batch_is_a_sweeps_trial_but_a_plain_runs_error():
    from sweeper.sweep.extend import searched_params
    from sweeper.sweep.stages import fitted_micro_batches

    grid = "sweep.stages.1.params.trainer.total_batch_size.grid=[1024,2048,4096,8192]"
    cfg = compose(["+sweep=lr_bs", grid])
    plan = build_plan(cfg)  # the checks before Ray starts let 1024 and 2048 pass
    spec, base = plan.spec, plan.base
    assert base["trainer"]["device_batch_size"] == 16
    ctx = TrialContext(metric="val_bpb", penalty=8.0, lr_keys=tuple(spec.lr_keys))
    trial = trial_config({BATCH: 2048}, base, ctx)
    assert (trial["trainer"]["total_batch_size"], trial["trainer"]["device_batch_size"]) == (
        2048,
        8,
    )
    # the stage's first line says which batches train in smaller micro-batches
    assert fitted_micro_batches(searched_params(plan, "batch_size", base), base) == (
        "batch 1024 in micro-batches of 4, 2048 in micro-batches of 8 sequences "
        "(trainer.device_batch_size=16 does not divide them)"
    )
    # a sweep's own batch below the micro-batch: its runs (the baseline too) train in 8,
    # while 16 stays the ceiling for the batches its stages try
    cfg = compose(["+sweep=lr_bs", "trainer.total_batch_size=2048"])
    base = build_plan(cfg).base
    assert base["trainer"]["device_batch_size"] == 16
    assert placed(base, 1, 0)["trainer"]["device_batch_size"] == 8
    assert trial_config({BATCH: 16384}, base, ctx)["trainer"]["device_batch_size"] == 16
    # a plain run keeps its contract: such a batch is an error that names the fix
    from sweeper.config.schema import load_run_config

    with pytest.raises(ConfigError, match="trainer.device_batch_size=8 makes it one"):
        load_run_config(apply_params(base, {BATCH: 2048}))


def test_a_best_at_the_end_of_what_makes_a_run_is_an_edge_only_for_a_users_function():
    from sweeper.sweep.extend import range_edges

    grid = "sweep.stages.1.params.trainer.total_batch_size.grid=[256,512,1024]"
    cfg = compose(["+sweep=lr_bs", grid])
    plan = build_plan(cfg)
    spec, base = plan.spec, plan.base
    best = {"params": {BATCH: 256}}
    # 128 tokens are half a sequence: nothing below one sequence is a run of sweeper's, so
    # its best batch cannot lie below it and no note says it may ...
    assert range_edges(plan, "batch_size", base, best) == []
    # ... but sweeper cannot see what a user's function accepts: there, the next value
    users = plan_for(spec, base, target="pkg.fn")
    (edge,) = range_edges(users, "batch_size", base, best)
    assert edge["widen"] == "sweep.stages.1.params.trainer.total_batch_size.grid=[128,256,512,1024]"


def test_a_winner_of_the_round_past_the_ends_is_frozen_with_the_lrs_it_trained():
    """`full`'s batch stage (lr_rule sqrt) from 8192: its best 4096, then 2048 past the end.
    The round's trial trained from the first best's config, its LRs scaled twice (8192 ->
    4096 -> 2048); rebuilt from the stage's start in one scaling they differed in the last
    bits (0.010000000000000002 against 0.01), and the reproduce line trained another run."""
    from sweeper.sweep.extend import merge_round
    from sweeper.sweep.runner import frozen_config

    plan = build_plan(compose(["+sweep=full"]))
    spec, start = plan.spec, plan.base
    stage = next(s for s in spec.stages if s.lr_rule == "sqrt")
    first = {"params": {"trainer.total_batch_size": 4096}}
    after = trial_config(first["params"], start, plan.trial_context(stage, start))
    own = {"trainer.total_batch_size": 2048}
    trained = trial_config(own, after, plan.trial_context(stage, after))
    (second,) = merge_round([], first, [{"params": own}])
    frozen = frozen_config(plan, stage, second, start)
    assert frozen == trained
    lrs = [get_dotted(trained, key) for key in spec.lr_keys]
    assert lrs != [get_dotted(start, key) for key in spec.lr_keys]  # the rule did scale them
    # a first-round trial is rebuilt from the start as before
    assert frozen_config(plan, stage, first, start) == after


def test_a_round_past_the_ends_extends_only_declared_ranges_that_make_valid_runs():
    from sweeper.config.sweep import StageSpec, SweepSpec
    from sweeper.sweep.extend import (
        extension_ranges,
        extension_stage,
        merge_round,
        range_edges,
        searched_params,
    )

    cfg = compose(["+sweep=lr_bs"])
    base = build_plan(cfg).base
    params = {
        "optimizer": {
            "matrix_lr": {"log_uniform": [0.004, 0.1]},
            "weight_decay": {"uniform": [0.0, 0.2]},
        },
        "trainer": {"total_batch_size": {"int": [4096, 8192]}},
    }
    stage = StageSpec(name="s", params=params, lr_rule="retune", extend_trials=3)
    spec = SweepSpec(stages=[stage], lr_keys=["optimizer.embedding_lr"])
    best = {
        "params": {
            "optimizer.matrix_lr": 0.095,  # high end: searched past
            "optimizer.weight_decay": 0.0,  # low end of a range from 0: nothing below, no edge
            "trainer.total_batch_size": 4096,  # low end: 4095 is no whole number of sequences
            "optimizer.embedding_lr": base["optimizer"]["embedding_lr"] / 1.9,  # retune band
        }
    }
    edges = range_edges(plan_for(spec), "s", base, best)
    assert {e["param"] for e in edges} == set(best["params"]) - {"optimizer.weight_decay"}
    searched = searched_params(plan_for(spec), "s", base)
    ranges, skipped = extension_ranges(stage, searched, edges, base, own_trainable=True)
    assert list(ranges) == ["optimizer.matrix_lr"]
    assert [ranges["optimizer.matrix_lr"].low, ranges["optimizer.matrix_lr"].high] == (
        pytest.approx([0.1, 0.5])
    )
    # 2048 is a batch, 4095 (the range just below 4096 ends there) is not
    assert skipped == [
        "cannot search past the low end of trainer.total_batch_size: trainer.total_batch_size "
        "must be a multiple of trainer.device_batch_size * model.seq_len * trainer.workers = "
        "4096, got 4095",
    ]
    # a user's function has no run config to check: the batch range is searched past
    ranges, _ = extension_ranges(stage, searched, edges, base, own_trainable=False)
    assert sorted(ranges) == ["optimizer.matrix_lr", "trainer.total_batch_size"]
    # the round is a stage of its own over the extended params only, and ends there
    round_two = extension_stage(stage, ranges, 3)
    assert [p.name for p in plan_for(spec).space(round_two, {}).params] == sorted(ranges)
    assert (round_two.num_samples, round_two.extend_trials, round_two.points) == (3, 0, [])
    assert round_two.search == stage.search and round_two.lr_rule == stage.lr_rule
    # its records name a whole point: the other params at the first round's best
    merged = merge_round([{"params": best["params"]}], best, [{"params": {"x": 1}}])
    assert merged[1]["params"] == {**best["params"], "x": 1}
    # the note after the round speaks of the range both rounds searched
    extended = {"optimizer.matrix_lr": [0.1, 0.5]}

    def lr_edges(value):
        best["params"]["optimizer.matrix_lr"] = value
        edges = range_edges(plan_for(spec), "s", base, best, extended)
        return [e for e in edges if e["param"] == "optimizer.matrix_lr"]

    (lr_edge,) = lr_edges(0.45)
    assert lr_edge["side"] == "high" and "range [0.004, 0.5]" in lr_edge["note"]
    assert lr_edges(0.095) == []  # was the old range's end, is inside the new one


@pytest.mark.parametrize(
    ("name", "declared", "cut", "problem"),
    [
        ("scheduler.warmdown_ratio", [0.2, 0.8], 1.0, "must be in [0, 1], got 1.1"),
        # beside lr_bs's warm-down of 0.4
        ("scheduler.warmup_ratio", [0.1, 0.5], 0.6, "must be <= 1, got 0.7 + 0.4"),
    ],
)
def test_a_float_range_past_its_end_is_cut_where_runs_end(name, declared, cut, problem):
    from sweeper.config.sweep import StageSpec
    from sweeper.sweep.extend import extension_ranges, valid_part, widening_override
    from sweeper.sweep.space import extended_range, parse_space

    cfg = compose(["+sweep=lr_bs"])
    base = build_plan(cfg).base
    (param,) = parse_space({name: {"uniform": declared}}).params
    past = extended_range(param, "high")
    kept, why = valid_part(base, past)
    assert (kept.low, kept.high) == (declared[1], cut) and why.endswith(problem)
    # the value named is exact, and the override's range is one preflight accepts
    group, key = name.split(".")
    params = {group: {key: {"uniform": declared}}}
    widen = widening_override(0, params, param, "high", base, own_trainable=True)
    assert widen == f"sweep.stages.0.params.{name}.uniform=[{declared[0]},{cut}]"
    build_plan(compose(["+sweep=lr_bs", f"+{widen}"]))
    # a round searches the part that makes runs, and says where it stops
    stage = StageSpec(name="s", params=params, extend_trials=2)
    edge = {"param": name, "side": "high"}
    ranges, lines = extension_ranges(stage, [param], [edge], base, own_trainable=True)
    assert (ranges[name].low, ranges[name].high) == (declared[1], cut)
    assert lines == [f"past the high end of {name}, only [{declared[1]}, {cut:g}]: {why}"]


@pytest.mark.parametrize(
    ("grid", "values", "skipped"),
    [
        # below lr_bs's micro-batch of 16 x 256 tokens: 2048 and 1024 train in 8 and 4
        ([4096, 8192, 16384], [2048, 1024], None),
        ([1024, 2048, 4096], [512, 256], None),
        # 128 tokens are half a 256-token sequence: no run
        ([512, 1024, 2048], [256], "past the low end of trainer.total_batch_size, only [256]"),
        # one sequence: no batch below it, so no edge and no round
        ([256, 512, 1024], None, None),
    ],
)
def test_a_grid_whose_best_is_at_its_end_extends_by_the_values_that_make_runs(
    grid, values, skipped
):
    from sweeper.config.sweep import StageSpec, SweepSpec
    from sweeper.sweep.extend import (
        extended_ranges,
        extension_ranges,
        extension_stage,
        range_edges,
        searched_params,
    )

    cfg = compose(["+sweep=lr_bs"])
    base = build_plan(cfg).base
    params = {"trainer": {"total_batch_size": {"grid": grid}}}
    stage = StageSpec(name="bs", search="grid", params=params, lr_rule="sqrt", extend_trials=2)
    spec = SweepSpec(stages=[stage], lr_keys=["optimizer.matrix_lr"])
    best = {"params": {"trainer.total_batch_size": min(grid)}}
    edges = range_edges(plan_for(spec), "bs", base, best)
    searched = searched_params(plan_for(spec), "bs", base)
    ranges, lines = extension_ranges(stage, searched, edges, base, own_trainable=True, count=2)
    if skipped is None:
        assert lines == []
    else:
        # with the message of the value that is no run
        error = "trainer.total_batch_size must be a multiple of trainer.device_batch_size * "
        error += "model.seq_len * trainer.workers = 4096, got 128"
        assert lines == [f"{skipped}: {error}"]
    if values is None:
        assert ranges == {}
        return
    assert list(ranges["trainer.total_batch_size"].values) == values
    round_two = extension_stage(stage, ranges, 2)
    assert round_two.params == {"trainer.total_batch_size": {"grid": values}}
    extended = extended_ranges(round_two)
    assert extended == {"trainer.total_batch_size": values}
    # after the round, the note speaks of both rounds' values; at one sequence (256
    # tokens) there is no note: no batch lies below it
    best["params"]["trainer.total_batch_size"] = min(values)
    edges = range_edges(plan_for(spec), "bs", base, best, extended)
    if min(values) == 256:
        assert edges == []
        return
    (edge,) = edges
    assert f"of its values {sorted(values) + grid}" in edge["note"]


@pytest.mark.parametrize(
    ("baseline", "best", "line"),
    [
        (3.54, 3.29, "baseline val_bpb 3.5400 -> best 3.2900 (+0.2500 better)"),
        (3.5429, 3.556, "best 3.5560 (0.0131 worse: the unmodified config did better)"),
        (3.54, 3.54, "best 3.5400 (the same to 4 decimals: the sweep found nothing better)"),
    ],
)
def test_the_summary_says_whether_the_sweep_beat_the_baseline(capsys, baseline, best, line):
    from sweeper.config.sweep import SweepSpec
    from sweeper.report.summary import _print_summary

    summary = {
        "trials": 3,
        "elapsed_s": 10.0,
        "stages": [],
        "baseline": {"value": baseline},
        "best": {"value": best, "overrides": ["optimizer.matrix_lr=0.03"]},
        "improvement": baseline - best,
        "plots": [],
    }
    _print_summary(summary, SweepSpec(name="s"), Path("."))
    assert line in capsys.readouterr().out


def test_a_sweep_written_before_a_stage_key_existed_resumes_while_the_key_is_off(tmp_path):
    from sweeper.sweep.state import SweepState, check_resumable

    old = SweepState(tmp_path, "s", {}, definition={"stages": [{"name": "lr"}]})
    for off in (0, None, []):
        check_resumable(old, "s", {}, {"stages": [{"name": "lr", "extend_trials": off}]})
    # used, it changes what the stage runs: the old sweep's trials are not this one's
    with pytest.raises(ValueError, match=r"sweep.stages.0.extend_trials '\(absent\)' -> 2"):
        check_resumable(old, "s", {}, {"stages": [{"name": "lr", "extend_trials": 2}]})
    with pytest.raises(ValueError, match="sweep.stages.0.name 'lr' -> 'bs'"):
        check_resumable(old, "s", {}, {"stages": [{"name": "bs"}]})


def test_a_sweep_written_before_a_run_config_key_existed_resumes_at_its_default(tmp_path):
    from sweeper.sweep.state import SweepState, check_resumable

    base = {"optimizer": {"weight_decay": 0.1}}
    old = SweepState(tmp_path, "s", base, definition={})
    # the older code decayed constantly: the new key at that value changes nothing
    now = {"optimizer": {"weight_decay": 0.1, "weight_decay_schedule": "constant"}}
    check_resumable(old, "s", now, {})
    # so is a whole section, every key at its default
    section = {"optimizer": {"weight_decay": 0.0, "weight_decay_schedule": "constant"}}
    check_resumable(SweepState(tmp_path, "s", {}, definition={}), "s", section, {})
    now["optimizer"]["weight_decay_schedule"] = "linear"
    with pytest.raises(
        ValueError, match="optimizer.weight_decay_schedule '\\(absent\\)' -> 'linear'"
    ):
        check_resumable(old, "s", now, {})
    # a key the schema does not know (a user's trainable's) is a change whatever its value
    with pytest.raises(ValueError, match="mine '\\(absent\\)' -> {'knob': 'constant'}"):
        check_resumable(old, "s", {**base, "mine": {"knob": "constant"}}, {})


def test_the_stage_plot_marks_the_best_trial_and_each_search_range(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from sweeper.config.sweep import SweepSpec
    from sweeper.report.plots import plot_stage_lr

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    records = [
        {"stage": "lr", "trial_id": str(i), "status": status, "metric": metric, "params": p}
        for i, (status, metric, p) in enumerate(
            [
                ("completed", 3.1, {"optimizer.matrix_lr": 0.09, "trainer.total_batch_size": 512}),
                ("completed", 3.3, {"optimizer.matrix_lr": 0.02, "trainer.total_batch_size": 1024}),
                ("pruned", 3.6, {"optimizer.matrix_lr": 0.005, "trainer.total_batch_size": 512}),
            ]
        )
    ]
    spec = SweepSpec(lr_keys=["optimizer.matrix_lr"])
    ranges = {"optimizer.matrix_lr": (0.004, 0.1)}  # the batch size was a grid: no range
    plot_stage_lr(tmp_path / "s.png", records, spec, records[0], ranges)
    (fig,) = drawn
    lr_ax, batch_ax = fig.axes
    assert [line.get_xdata()[0] for line in lr_ax.get_lines()] == [0.004, 0.1]
    assert batch_ax.get_lines() == []
    stars = [c for c in lr_ax.collections if c.get_label() == "best"]
    assert [tuple(c.get_offsets()[0]) for c in stars] == [(0.09, 3.1)]
    assert lr_ax.get_xscale() == "log"
    assert {"best", "search range"} <= {t.get_text() for t in lr_ax.get_legend().get_texts()}
    assert len(lr_ax.patches) == 0  # no round past the end: nothing shaded
    plot_stage_lr(tmp_path / "s.png", records, spec)  # no best (all diverged), no ranges
    assert not [c for c in drawn[1].axes[0].collections if c.get_label() == "best"]
    # an extend_trials round: the part of the range it searched past the end is shaded
    extended = {"optimizer.matrix_lr": [0.1, 0.5]}
    plot_stage_lr(tmp_path / "s.png", records, spec, records[0], ranges, extended)
    (band,) = drawn[2].axes[0].patches
    assert band.get_label() == "searched past its end"
    assert [band.get_x(), band.get_x() + band.get_width()] == pytest.approx([0.1, 0.5])
    assert len(drawn[2].axes[1].patches) == 0  # the batch size was not extended
    # a grid's round past its end: its new values, shaded from the end they continue
    records.append({**records[0], "trial_id": "3", "params": {**records[0]["params"]}})
    records[-1]["params"]["trainer.total_batch_size"] = 256
    extended = {"trainer.total_batch_size": [256]}
    plot_stage_lr(tmp_path / "s.png", records, spec, records[0], ranges, extended)
    assert len(drawn[3].axes[0].patches) == 0
    (band,) = drawn[3].axes[1].patches
    assert [band.get_x(), band.get_x() + band.get_width()] == pytest.approx([256, 512])


def test_the_stage_plot_colours_each_trials_learning_curve_by_its_lr(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from sweeper.config.sweep import SweepSpec
    from sweeper.report.plots import plot_stage_lr

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    trials = [  # trial, status, matrix LR, its reports' (tokens, val_bpb)
        ("low", "completed", 0.002, [(1000, 4.0), (2000, 3.6)]),
        ("mid", "completed", 0.02, [(1000, 3.8), (2000, 3.2)]),
        ("cut", "pruned", 0.01, [(1000, 3.9)]),
        ("high", "diverged", 0.2, [(1000, 3.7), (2000, 8.0)]),  # 8.0: the penalty
    ]
    records = [
        {"stage": "lr", "trial_id": t, "status": st, "metric": rows[-1][1], "params": {"lr": lr}}
        for t, st, lr, rows in trials
    ]
    reports = [
        {"trial_id": t, "status": st, "tokens": tokens, "val_bpb": v}
        for t, st, _, rows in trials
        for tokens, v in rows
    ]
    spec = SweepSpec(lr_keys=["lr"])
    plot_stage_lr(tmp_path / "s.png", records, spec, records[1], {}, None, reports)
    (fig,) = drawn
    lr_ax, curves_ax, bar_ax = fig.axes
    lines = [line for line in curves_ax.get_lines() if line.get_linestyle() != "None"]
    # one curve per trial; the diverged one stops before its penalty, the best is thickest
    assert [list(line.get_ydata()) for line in lines] == [[4.0, 3.6], [3.8, 3.2], [3.9], [3.7]]
    assert max(lines, key=lambda line: line.get_linewidth()) is lines[1]
    assert lines[2].get_linestyle() == "--"  # pruned
    # coloured on a log scale of the LR: the lowest darkest, the highest brightest
    assert bar_ax.get_ylabel() == "lr" and bar_ax.get_yscale() == "log"
    brightness = [sum(line.get_color()[:3]) for line in lines]
    assert brightness[0] < brightness[2] < brightness[1] < brightness[3]
    # the diverged trial is an x along the top, not a point at its penalty (a user's
    # function's 1e9 flattened every other point to 0)
    (cross,) = [c for c in lr_ax.collections if c.get_label() == "diverged"]
    assert [tuple(p) for p in cross.get_offsets()] == [(0.2, 0.97)]
    assert lr_ax.get_ylim()[1] < 8.0
    # without reports: the parameter panels alone, as before
    plot_stage_lr(tmp_path / "s.png", records, spec, records[1], {})
    assert len(drawn[1].axes) == 1
    # a user's function that reports no tokens: its curves run over its reports
    clockless = [{k: v for k, v in r.items() if k != "tokens"} for r in reports]
    plot_stage_lr(tmp_path / "s.png", records, spec, records[1], {}, None, clockless)
    curves_ax = drawn[2].axes[1]
    lines = [line for line in curves_ax.get_lines() if line.get_linestyle() != "None"]
    assert [list(line.get_xdata()) for line in lines] == [[1, 2], [1, 2], [1], [1]]
    assert curves_ax.get_xlabel().startswith("report")


def test_the_learning_curves_plot_the_gradient_norm_update_ratio_and_residual_beside_the_metric(
    tmp_path, monkeypatch
):
    from matplotlib.figure import Figure

    from sweeper.report.plots import plot_learning_curves

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    nan = float("nan")
    reports = [
        {"trial_id": t, "status": status, "tokens": tokens, "val_bpb": v, "grad_norm_max": g}
        for t, status, rows in [
            ("a", "completed", [(1000, 3.9, 2.5), (2000, 3.5, 0.8)]),
            ("b", "diverged", [(1000, 4.1, 40.0), (2000, 8.0, nan)]),
        ]
        for tokens, v, g in rows
    ]
    # a later stage's trial that replayed a's run: the same curve, drawn once
    replay = [{**r, "trial_id": "c", "reused_from": "lr/a"} for r in reports[:2]]
    plot_learning_curves(tmp_path / "c.png", reports + replay, "val_bpb")
    curves, norms = drawn[0].axes
    # a diverged trial's curve stops at its last measurement: its last report is a penalty
    assert [list(line.get_ydata()) for line in curves.get_lines()] == [[3.9, 3.5], [4.1]]
    # a NaN norm (the diverged step) has no place on a log axis; the spike before it does
    assert [list(line.get_ydata()) for line in norms.get_lines()] == [[2.5, 0.8], [40.0]]
    assert norms.get_yscale() == "log" and "gradient norm" in norms.get_ylabel()
    assert [line.get_color() for line in norms.get_lines()] == ["tab:blue", "tab:red"]
    # a user's function reports no gradient norm: the metric alone
    plain = [{k: v for k, v in r.items() if k != "grad_norm_max"} for r in reports]
    plot_learning_curves(tmp_path / "c.png", plain, "val_bpb")
    assert len(drawn[1].axes) == 1
    # sweeper's training also reports how far each step moved the hidden matrices
    moved = [{**r, "update_ratio_matrix": u} for r, u in zip(reports, [3e-3, 1e-3, 0.2, nan])]
    plot_learning_curves(tmp_path / "c.png", moved, "val_bpb")
    ratios = drawn[2].axes[2]
    assert [list(line.get_ydata()) for line in ratios.get_lines()] == [[3e-3, 1e-3], [0.2]]
    assert ratios.get_yscale() == "log" and "weights" in ratios.get_ylabel()
    # and the residual stream's RMS: a fourth panel, the figure in two rows of two
    grown = [{**r, "residual_rms": v} for r, v in zip(moved, [1.5, 2.0, 300.0, nan])]
    plot_learning_curves(tmp_path / "c.png", grown, "val_bpb")
    assert len(drawn[3].axes) == 4 and drawn[3].get_size_inches()[1] == 9.0
    residual = drawn[3].axes[3]
    assert [list(line.get_ydata()) for line in residual.get_lines()] == [[1.5, 2.0], [300.0]]
    assert residual.get_yscale() == "log" and "residual" in residual.get_ylabel()


def test_points_of_a_retune_stage_start_each_lr_band_at_its_frozen_value():
    from sweeper.config.errors import ConfigError
    from sweeper.config.sweep import StageSpec, SweepSpec

    spec = SweepSpec(lr_keys=["optimizer.matrix_lr"])
    params = {"trainer": {"total_batch_size": {"choice": [512, 1024]}}}
    stage = StageSpec(
        name="bs", lr_rule="retune", params=params, points=[{"trainer.total_batch_size": 1024}]
    )
    frozen = {"optimizer.matrix_lr": 0.02}
    assert plan_for(spec).points(stage, frozen) == [
        {"trainer.total_batch_size": 1024, "optimizer.matrix_lr": 0.02}
    ]
    stage.points = [{"trainer": {"total_batch_size": 512}, "optimizer": {"matrix_lr": 0.03}}]
    with pytest.raises(ConfigError, match="^sweep stage 'bs': sweep point 1: .*retune"):
        plan_for(spec).points(stage, frozen)


def test_a_base_point_is_the_config_the_stage_starts_from():
    from sweeper.config.errors import ConfigError
    from sweeper.config.sweep import StageSpec, SweepSpec

    spec = SweepSpec(lr_keys=["optimizer.matrix_lr"])
    lr = {"optimizer": {"matrix_lr": {"log_uniform": [0.005, 0.05]}}}
    stage = StageSpec(name="lr", params=lr, points=["base", {"optimizer.matrix_lr": 0.03}])
    start = {"optimizer.matrix_lr": 0.02, "trainer.total_batch_size": 1024}
    assert plan_for(spec).points(stage, start) == [
        {"optimizer.matrix_lr": 0.02},
        {"optimizer.matrix_lr": 0.03},
    ]
    # validation checks against the composed config, apart from the stand-in frozen values
    assert plan_for(spec).points(stage, {}, base_values={"optimizer.matrix_lr": 0.04}) == [
        {"optimizer.matrix_lr": 0.04},
        {"optimizer.matrix_lr": 0.03},
    ]
    # a retune stage's base point: the batch the stage starts from, its LR band's centre
    params = {"trainer": {"total_batch_size": {"choice": [512, 1024]}}}
    retune = StageSpec(name="bs", lr_rule="retune", params=params, points=["base"])
    assert plan_for(spec).points(retune, start) == [
        {"trainer.total_batch_size": 1024, "optimizer.matrix_lr": 0.02}
    ]
    with pytest.raises(ConfigError, match=r"^sweep stage 'lr': sweep point 1: optimizer\.matrix"):
        plan_for(spec).points(stage, {**start, "optimizer.matrix_lr": 0.5})  # outside the range
    with pytest.raises(ConfigError, match=r"sweep point 1: base has no value for \['optimizer"):
        plan_for(spec).points(stage, {}, base_values={})
    stage.points = ["bse"]
    with pytest.raises(ConfigError, match=r"sweep point 1: expected \{param: value\} or base"):
        plan_for(spec).points(stage, start)


def test_nested_and_dotted_params_mean_the_same():
    from sweeper.config.sweep import flatten_params

    nested = {"optimizer": {"matrix_lr": {"log_uniform": [0.01, 0.1]}, "empty": {}}}
    dotted = {"optimizer.matrix_lr": {"log_uniform": [0.01, 0.1]}}
    assert flatten_params(nested) == flatten_params(dotted) == dotted
    # both at once: one spec would silently replace the other
    with pytest.raises(ConfigError, match="sweep param 'optimizer.matrix_lr' is given twice"):
        flatten_params({**dotted, "optimizer": {"matrix_lr": {"uniform": [0.01, 0.02]}}})


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "Failure # 1 (occurred at 2026-11-23_05-58-16)\nTraceback (most recent call last):\n"
            '  File "f.py", line 3, in run\nray.exceptions.RayTaskError(ValueError): ray::run()\n'
            "ValueError: a bug in user code",
            "ValueError: a bug in user code",
        ),
        (
            "Failure # 1 (occurred at 2026-11-23_05-58-16)\n2 worker(s) were killed due to the "
            "node running low on memory. Memory on the node (IP: 192.0.2.2, ID: 5d7e) was "
            "1.35GB used / 23.54GB limit (0.057300)\nOOM kill reason: Memory usage 1448316928B",
            "2 worker(s) were killed due to the node running low on memory. Memory on the node "
            "was 1.35GB used / 23.54GB limit (0.057300)",
        ),
        ("", "unknown error"),
    ],
)
def test_a_failed_trials_error_in_one_line(text, expected):
    assert error_summary(text) == expected


@pytest.mark.parametrize(
    "error, hinted",
    [
        ("2 worker(s) were killed due to the node running low on memory.", True),
        ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate", True),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", True),
        ("ValueError: a bug in user code", False),
    ],
)
def test_a_stage_that_ran_out_of_memory_says_how_to_give_trials_more(tmp_path, error, hinted):
    message = str(SweepFailed("lr", error, tmp_path))
    assert message.startswith(f"every trial of stage 'lr' failed: {error}")
    assert ("sweep.concurrency=1" in message) == hinted, message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["+sweep=lr_bs"], 0.25),  # null: sweeper's own training forks at the rungs
        (["+sweep=full"], 0.25),
        (["+sweep=lr", "sweep.rung_cooldown=0.5"], 0.5),  # a number is taken as it is
        (["+sweep=lr_bs", "sweep.rung_cooldown=0"], 0.0),
        (["+sweep=smoke"], 0.0),  # the quickest look: no forks
        # a user's function has no fork to make: null is 0, where a number is refused
        (["+sweep=lr", "trainable._target_=tests.user_functions.noisy_bowl"], 0.0),
        # another metric has no cooled value to rank
        (["+sweep=lr", "sweep.metric=train_loss"], 0.0),
    ],
)
def test_rung_cooldown_null_forks_only_where_a_fork_can_be_made_and_scored(overrides, expected):
    assert build_plan(compose(overrides)).spec.rung_cooldown == expected


def test_a_rung_cooldown_asked_of_a_users_function_is_refused():
    target = "trainable._target_=tests.user_functions.noisy_bowl"
    with pytest.raises(ConfigError, match="sweep.rung_cooldown forks sweeper's own training"):
        build_plan(compose(["+sweep=lr", target, "sweep.rung_cooldown=0.25"]))


def test_a_log_axis_names_the_values_tried():
    """A batch grid of 512 and 2048 spans no power of ten: matplotlib alone labels none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sweeper.report.plots import log_axis_labelled

    fig, (grid, wide) = plt.subplots(1, 2)
    grid.scatter([512, 2048], [3.0, 3.1])
    log_axis_labelled(grid.xaxis, [2048, 512, 512])
    lrs = [0.002 * 1.4**i for i in range(10)]
    wide.scatter(lrs, range(10))
    log_axis_labelled(wide.xaxis, lrs)
    fig.canvas.draw()
    assert grid.get_xscale() == "log"
    assert [t.get_text() for t in grid.get_xticklabels()] == ["512", "2048"]
    shown = [t.get_text() for t in wide.get_xticklabels() if t.get_text()]
    assert {"0.005", "0.01", "0.02"} <= set(shown), shown
    plt.close(fig)


@pytest.mark.parametrize(
    "metric, mode, bytes_per_token, penalty",
    [
        ("val_bpb", "min", None, 8.0),  # log2(256) bits: a uniform guess over the bytes
        ("val_bpb", "min", 4.0, 4.0),  # 16 bits per token over 4 bytes
        ("train_loss", "min", 4.0, math.log(65536)),  # the same guess in nats per token
        ("tokens_per_s", "max", None, 0.0),
    ],
)
def test_a_diverged_trials_penalty_is_a_uniform_guess_in_the_metrics_unit(
    metric, mode, bytes_per_token, penalty
):
    """A diverged trial must rank below every trial that learned anything: a val_bpb
    penalty (3.5 bits/byte on a 50k-token vocabulary) given as train_loss (nats per
    token, a uniform guess 10.8) would rank it above them all."""
    from sweeper.config.sweep import SweepSpec

    vocab = 256 if bytes_per_token is None else 65536
    base = {"data": {"vocab_size": vocab, "bytes_per_token": bytes_per_token}}
    spec = SweepSpec(metric=metric, mode=mode)
    assert plan_for(spec, base).penalty == pytest.approx(penalty)


@pytest.mark.parametrize(
    "tried, labels",
    [
        ([0.001, 0.01, 0.1], ["0.001", "0.01", "0.1"]),  # a grid: its own values
        ([512, 2048, 8192], ["512", "2048", "8192"]),  # whole numbers in full
        ([0.00930586, 0.0216736], ["0.00931", "0.0217"]),  # to 3 figures, not 6
        ([0.0156424, 0.0163599, 0.04], None),  # 5% apart: decade ticks, not one over another
    ],
)
def test_a_log_axis_labels_the_values_tried_only_where_they_read_apart(tried, labels):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sweeper.report.plots import log_axis_labelled

    fig, ax = plt.subplots()
    ax.plot(tried, [1.0] * len(tried))
    log_axis_labelled(ax.xaxis, tried)
    fig.canvas.draw()
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    shown = [t for t, v in zip(ticks, ax.get_xticks()) if tried[0] <= v <= tried[-1] and t]
    plt.close(fig)
    if labels is not None:
        assert shown == labels
    else:
        assert not set(shown) & {f"{v:.3g}" for v in tried[:2]} and shown, shown


@pytest.mark.parametrize(
    ("iterations", "kept"),
    [
        ([1, 2, 3], [1, 2, 3]),  # one attempt
        ([1, 2, 3, 1, 2, 3], [1, 2, 3]),  # restarted from nothing: the last attempt's
        ([1, 2, 3, 4, 3, 4, 5], [1, 2, 3, 4, 5]),  # from the checkpoint at 2: 3 and 4 again
    ],
)
def test_a_trials_reports_that_a_restart_trained_again_are_kept_once(iterations, kept):
    from sweeper.sweep.results import last_attempt

    rows = [{"training_iteration": n, "attempt": i} for i, n in enumerate(iterations)]
    got = last_attempt(rows)
    assert [r["training_iteration"] for r in got] == kept
    # the later attempt's rows replace the earlier ones
    assert [r["attempt"] for r in got][-1] == len(iterations) - 1
    assert sorted({r["attempt"] for r in got}) == [r["attempt"] for r in got]
