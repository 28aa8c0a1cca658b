"""The training loop, end to end on the tiny preset (CPU, seconds each)."""

import copy
import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from sweeper.config.schema import load_run_config
from sweeper.config.sweep import BUILTIN_METRICS
from sweeper.train.budget import resolve_total_steps
from sweeper.train.cpu_fast import keep_freed_memory_for_reuse, release_freed_memory
from sweeper.train.data import BatchSampler, load_data
from sweeper.train.evaluation import (
    DivergenceWatch,
    evaluate,
    evaluation_count,
    evaluation_steps,
    is_eval_step,
    rung_steps,
)
from sweeper.train.loop import train
from sweeper.train.model import GPT, PLAIN_OPS, GPTShape

from .conftest import tiny


def test_same_seed_gives_identical_loss_trace():
    a = train(tiny(trainer={"max_steps": 6}), verbose=False)
    b = train(tiny(trainer={"max_steps": 6}), verbose=False)
    c = train(tiny(trainer={"max_steps": 6, "seed": 1}), verbose=False)
    assert a["loss_trace"] == b["loss_trace"]
    assert a["loss_trace"] != c["loss_trace"]


def test_batch_sampler_depends_on_step_only_and_splits_across_ranks():
    tokens = np.arange(10_000, dtype=np.uint16)
    one = [x for x, _ in BatchSampler(tokens, 2, 16, seed=3).step_batches(7, 4, "cpu")]
    again = [x for x, _ in BatchSampler(tokens, 2, 16, seed=3).step_batches(7, 4, "cpu")]
    assert all((a == b).all() for a, b in zip(one, again))
    # 2 ranks x 2 micro-batches cover exactly the windows of 1 rank x 4 micro-batches
    ranks = [
        [x for x, _ in BatchSampler(tokens, 2, 16, 3, r, 2).step_batches(7, 2, "cpu")]
        for r in (0, 1)
    ]
    assert all((ranks[i % 2][i // 2] == one[i]).all() for i in range(4))
    other = next(BatchSampler(tokens, 2, 16, seed=3).step_batches(8, 1, "cpu"))[0]
    assert not (other == one[0]).all()


def test_gradient_accumulation_matches_one_big_batch():
    # 1 x 4B (no accumulation) vs 4 x B (accumulation): same windows, same updates.
    # AdamW with eps >> sqrt(v) acts as SGD, so a mis-scaled accumulated gradient would
    # show (Adam's own scale invariance would hide it); fp32 and no Muon, whose bf16
    # Newton-Schulz would amplify summation-order noise
    common = {"max_steps": 4, "total_batch_size": 256, "dtype": "float32", "grad_clip": 0.0}
    opt = {"name": "adamw", "lr": 0.2, "adam_eps": 1.0}
    big = train(tiny(optimizer=opt, trainer=common | {"device_batch_size": 4}), verbose=False)
    small = train(tiny(optimizer=opt, trainer=common | {"device_batch_size": 1}), verbose=False)
    assert small["loss_trace"] == pytest.approx(big["loss_trace"], rel=1e-5)
    assert small["loss_trace"][-1] < small["loss_trace"][0] - 0.1  # and it did update


def test_learns_well_below_unigram_baseline():
    result = train(tiny(trainer={"max_steps": 60, "eval_every": 60}), verbose=False)
    assert result["status"] == "completed"
    assert result["loss_trace"][0] == pytest.approx(math.log(256), abs=0.1)
    assert result["val_bpb"] < result["unigram_bpb"] - 1.0, result


def test_report_called_at_every_eval_with_the_contract_metrics():
    seen = []
    result = train(tiny(trainer={"max_steps": 10, "eval_every": 4}), seen.append, verbose=False)
    assert [m["step"] for m in seen] == [4, 8, 10]
    keys = {"step", "tokens", "flops", "train_loss", "val_bpb", "lr", "grad_norm", "grad_norm_max"}
    keys |= {"tokens_per_s", "mfu", "peak_memory_gib"}
    assert keys <= seen[-1].keys()
    # the metrics a sweep may rank by (sweep.metric) are numbers in every report
    for metric in BUILTIN_METRICS:
        assert all(isinstance(m[metric], float) for m in seen), metric
    assert seen[-1]["tokens"] == 10 * 512 == result["tokens"]
    assert seen[-1]["flops"] == result["tokens"] * result["flops_per_token"]
    assert seen[-1]["status"] == "completed" and seen[0]["status"] == "running"
    # the scaling fits read N from a sweep's reports, never from result.json
    assert [m["params"] for m in seen] == [result["params"]] * 3
    for key in (
        "status",
        "val_bpb",
        "train_loss",
        "tokens",
        "flops",
        "params",
        "tokens_per_s",
        "mfu",
        "peak_memory_gib",
        "steps",
        "workers",
        "dtype",
        "device",
    ):
        assert key in result


def test_reports_how_far_the_step_before_each_report_moved_each_group():
    common = {"max_steps": 6, "eval_every": 3, "dtype": "float32"}

    def reported(**optimizer):
        seen = []
        train(tiny(trainer=common, optimizer=optimizer), seen.append, verbose=False)
        return seen

    base = reported(matrix_lr=0.01)
    ratios = [{k: v for k, v in m.items() if k.startswith("update_ratio_")} for m in base]
    groups = {f"update_ratio_{g}" for g in ("matrix", "embedding", "unembedding", "scalar")}
    assert [m["step"] for m in base] == [3, 6] and all(r.keys() == groups for r in ratios)
    assert all(0 < v < 1 for r in ratios for v in r.values()), ratios
    # a Muon step's size is its LR times an orthogonalised matrix: twice the matrix LR
    # moves the matrices about twice as far (the weights have drifted apart by step 3)
    doubled = reported(matrix_lr=0.02)[0]
    assert doubled["update_ratio_matrix"] / ratios[0]["update_ratio_matrix"] == pytest.approx(
        2, rel=0.05
    )
    # and the embedding, whose own LR did not change, about as far as before
    assert doubled["update_ratio_embedding"] == pytest.approx(
        ratios[0]["update_ratio_embedding"], rel=0.05
    )
    # plain AdamW has no unembedding group of its own (lm_head steps with the matrices)
    adamw = reported(name="adamw")[0]
    assert {k for k in adamw if k.startswith("update_ratio_")} == groups - {
        "update_ratio_unembedding"
    }


def test_reports_the_gradient_norm_before_clipping_and_its_largest_since_the_last_report():
    common = {"max_steps": 4, "eval_every": 1, "dtype": "float32"}

    def norms(grad_clip, **trainer):
        seen = []
        train(tiny(trainer=common | {"grad_clip": grad_clip} | trainer), seen.append, verbose=False)
        return [m["grad_norm"] for m in seen], [m["grad_norm_max"] for m in seen]

    # the first step's norm, by hand: the run's own model and batches, one backward pass
    cfg = load_run_config(tiny(trainer=common))
    torch.manual_seed(cfg.trainer.seed)
    data = load_data(cfg.data, cfg.model.seq_len)
    model = GPT(GPTShape.from_config(cfg.model))
    sampler = BatchSampler(data.train, cfg.trainer.device_batch_size, cfg.model.seq_len, 0)
    for x, y in sampler.step_batches(0, cfg.grad_accum_steps, "cpu"):
        (model(x, y) / cfg.grad_accum_steps).backward()
    by_hand = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()

    unclipped, unclipped_max = norms(0.0)
    assert unclipped[0] == pytest.approx(by_hand, rel=1e-5)
    assert unclipped_max == unclipped  # one step per report: the largest is the step's own
    # a clip that never bites computes the same norm through torch's clipping function
    assert norms(1e9)[0] == unclipped
    # a clip that always bites: the first step's norm is still the one before clipping,
    # and the clipped update changes the steps after it
    clipped, _ = norms(1e-3)
    assert clipped[0] == unclipped[0] > 1e-3
    assert clipped[1] != unclipped[1]
    # reporting every other step, the largest covers both steps since the last report
    _, every_other_max = norms(0.0, eval_every=2)
    assert every_other_max == [max(unclipped[0:2]), max(unclipped[2:4])]


def test_divergence_ends_the_run_with_status_not_exception():
    seen = []
    # AdamW at LR 200 throws the loss from ln(256) over the limit (8.3) at the first step and
    # to 20-30 nats for the next ten, on both fp32 matmul kernels (torch's and oneDNN's,
    # sweeper.train.linear). adam_eps 1e-6: at init the residual scalars' gradient is rounding
    # noise (~1e-11: with zero output projections the stream feeds only RMSNorms, which
    # are blind to its scale), and with the default 1e-10 AdamW's first step moved them by
    # up to the LR in a direction that noise set: the kernels' runs parted at step 1 (8.7
    # against 29.5 nats at LR 50), and one fell under the limit at step 4. fp32 on every
    # CPU: in bf16 the wandering starts sooner
    cfg = tiny(
        optimizer={"name": "adamw", "lr": 200.0, "adam_eps": 1e-6},
        trainer={"max_steps": 30, "dtype": "float32", "max_loss_patience": 3},
    )
    result = train(cfg, seen.append, verbose=False)
    assert result["status"] == "diverged", result["loss_trace"]
    assert result["steps"] < 30 and "over the limit" in result["reason"]
    assert seen[-1]["status"] == "diverged" and math.isnan(seen[-1]["val_bpb"])
    assert "at step" in result["reason"] and seen[-1]["reason"] == result["reason"]


def test_a_loss_over_the_limit_ends_the_run_only_once_it_stays_there():
    """A run whose loss is over max_loss for its first two steps and under it after, as a
    hard batch lifts a slowly learning run's loss for a step or two: it goes on under a
    patience of 3, and ends at step 2 under a patience of 2. A loss that stays over the
    limit ends the run at the step the patience runs out."""
    steps = 10
    trace = train(tiny(trainer={"max_steps": steps}), verbose=False)["loss_trace"]
    limit = (trace[1] + trace[2]) / 2
    assert min(trace[:2]) > limit > max(trace[2:]), trace  # the run this test needs

    def run(patience, max_loss):
        cfg = tiny(
            trainer={"max_steps": steps, "max_loss": max_loss, "max_loss_patience": patience}
        )
        return train(cfg, verbose=False)

    survived = run(3, limit)
    assert survived["status"] == "completed" and survived["steps"] == steps
    assert survived["loss_trace"] == trace
    stopped = run(2, limit)
    assert stopped["status"] == "diverged" and stopped["steps"] == 2
    assert "at step 2" in stopped["reason"] and "for 2 steps)" in stopped["reason"]
    always_over = run(4, trace[-1] / 10)
    assert always_over["status"] == "diverged" and always_over["steps"] == 4


LN_V = math.log(256)
LIMIT = 1.5 * LN_V


@pytest.mark.parametrize(
    "losses, patience, diverged_at, words",
    [
        # a low-LR run's spike (the search bench's grid): 4 steps over the limit, recovered
        ([3.2, 9.2, 10.3, 10.6, 10.5, 3.1, 3.0], 6, None, None),
        ([3.2, 9.2, 10.3, 10.6, 10.5, 3.1, 3.0], 4, 5, "over the limit 8.32 for 4 steps"),
        ([3.2, 9.2, 3.1], 1, 2, "over the limit 8.32)"),
        ([3.0, 9.0, 9.0, 4.0, 9.0, 9.0, 9.0, 3.0], 4, None, None),  # two spikes, not one
        # AdamW at LR 100 (batch 1024, then 512): over the limit, then a dead output, at
        # ln(V) to float precision
        ([LN_V - 2e-4, 8.77, 30.1, 27.7] + [LN_V + 1.5e-6] * 6, 6, 10, "uniform guess for 6"),
        ([LN_V - 4e-4, 30.0, 27.0, 9.0, LN_V + 0.06] + [LN_V + 1.5e-6] * 7, 6, 11, "uniform"),
        # a run that learned and then collapsed to a uniform guess without a spike
        ([5.0, 4.0, 3.0] + [LN_V - 1e-6] * 3, 3, 6, "train loss 5.545 at step 6 (a uniform"),
        ([5.0, 4.0, 3.0, LN_V, LN_V, 3.0, LN_V, LN_V, 3.0], 3, None, None),
        # a run at a tiny LR has never moved off ln(V): left alone however close it stays
        ([LN_V - 2e-4, LN_V - 1.5e-4] + [LN_V + 1.5e-6] * 10, 6, None, None),
        ([3.0, float("nan")], 6, 2, "nan at step 2"),
        ([3.0, float("inf")], 6, 2, "inf at step 2"),
    ],
)
def test_divergence_watch_waits_out_a_spike_but_not_a_dead_output(
    losses, patience, diverged_at, words
):
    watch = DivergenceWatch(LIMIT, patience, 256)
    reasons = [(step, watch.check(loss, step)) for step, loss in enumerate(losses, 1)]
    found = [(step, reason) for step, reason in reasons if reason]
    if diverged_at is None:
        assert not found
    else:
        step, reason = found[0]
        assert step == diverged_at and words in reason and f"at step {step}" in reason


def test_a_low_lr_spike_is_waited_out_and_a_collapse_to_a_uniform_guess_is_not():
    """Real runs of the search bench's trial (64 steps of 1024 tokens). A low-LR run spikes over the
    limit for a few steps and learns on: the default patience lets it, a patience of 1 does
    not. AdamW at LR 100 spikes for 3 steps and then sits at ln(256) (under the limit)
    until its weights go NaN at step 18: the watch ends it first, at its patience-th step
    there."""
    # fp32, as these runs were measured: in bf16 (a CPU with native bf16) the trajectories
    # differ, and the low-LR run, for one, no longer spikes
    patience = load_run_config(tiny()).trainer.max_loss_patience  # the default
    batch = {"total_batch_size": 1024, "max_steps": 64, "dtype": "float32"}
    low_lr = {"matrix_lr": 0.001, "embedding_lr": 0.01}
    # the spike's height and length are chaotic: its top at 8.2-9.1 nats over 1-6 steps as
    # the last bits of the norms' backward changed or the CPU did, 7.1 for one step where
    # fp32 matmuls run on oneDNN (sweeper.train.linear). So the limit is set from the run itself,
    # halfway between the uniform guess and the spike's top
    unlimited = train(tiny(optimizer=low_lr, trainer={**batch, "max_loss": 100.0}), verbose=False)
    top = max(unlimited["loss_trace"][1:])
    assert top > LN_V + 1, unlimited["loss_trace"]  # the run this test needs: a spike
    spike_limit = (LN_V + top) / 2
    patient = train(
        tiny(optimizer=low_lr, trainer={**batch, "max_loss": spike_limit}), verbose=False
    )
    assert patient["status"] == "completed" and patient["steps"] == 64, patient.get("reason")
    assert patient["loss_trace"] == unlimited["loss_trace"]
    spiked = [loss > spike_limit for loss in patient["loss_trace"]]
    # 1 step over the limit on a 2-core EPYC with oneDNN's fp32 matmuls, 4 with MKL's
    assert 0 < sum(spiked) < patience
    assert patient["loss_trace"][-1] < patient["loss_trace"][spiked.index(True) - 1]
    hasty = train(
        tiny(optimizer=low_lr, trainer={**batch, "max_loss": spike_limit, "max_loss_patience": 1}),
        verbose=False,
    )
    assert hasty["status"] == "diverged" and hasty["steps"] == spiked.index(True) + 1

    adamw = {"name": "adamw", "lr": 100.0, "weight_decay": 0.1, "adam_beta1": 0.9}  # conf's
    dead = train(tiny(optimizer=adamw, trainer=batch), verbose=False)
    # its first step at ln(256) (after the spike; one step between can be near, not at, it)
    at_uniform = DivergenceWatch.UNIFORM_TOLERANCE
    first_dead = next(
        i for i, loss in enumerate(dead["loss_trace"], 1) if abs(loss - LN_V) < at_uniform and i > 1
    )
    assert dead["status"] == "diverged" and dead["steps"] == first_dead + patience - 1
    assert dead["steps"] < 18 and "uniform guess" in dead["reason"]  # before its NaN
    assert dead["loss_trace"][-1] == pytest.approx(LN_V, abs=1e-5)  # under the limit

    # paused at step 8 (4 steps at ln(256)) and resumed: the streak goes on, not over
    states = []
    paused = {**batch, "eval_every": 4, "checkpoint_every_eval": True}

    def keep(metrics, state=None):
        if metrics["step"] == 8:
            states.append(copy.deepcopy(state()))

    train(tiny(optimizer=adamw, trainer=paused), keep, verbose=False)
    resumed = train(tiny(optimizer=adamw, trainer=paused), resume_state=states[0], verbose=False)
    assert resumed["status"] == "diverged" and resumed["steps"] == dead["steps"]


@pytest.mark.parametrize(
    "total_steps, eval_every, expected",
    [
        (10, 4, [4, 8, 10]),  # 8 is half an interval before the end: kept
        (9, 4, [4, 9]),  # 8 is one step before the end: the final evaluation replaces it
        (25, 4, [4, 8, 12, 16, 20, 25]),  # a sweep trial: 200k tokens at 8192 a step
        (12, 4, [4, 8, 12]),
        (3, 5, [3]),
    ],
)
def test_no_evaluation_just_before_the_final_one(total_steps, eval_every, expected):
    steps = range(1, total_steps + 1)
    points = [s for s in steps if s == total_steps or is_eval_step(s, total_steps, eval_every)]
    assert points == expected


@pytest.mark.parametrize(
    "total_steps, eval_every, rung_steps, expected",
    [
        # Hyperband's rung at a third of a 25-step trial (8.3): step 9, not 12, which it
        # replaces
        (25, 4, {9}, [4, 8, 9, 16, 20, 25]),
        # ASHA's rungs at a quarter and three quarters: 7 and 19 in place of 8 and 20
        (25, 4, {7, 19}, [4, 7, 12, 16, 19, 25]),
        (16, 4, {6}, [4, 6, 12, 16]),
        (16, 4, {4, 12}, [4, 8, 12, 16]),  # rungs on the grid change nothing
        # a ninth and a third of 64 steps (8 and 22) on a grid of 8: 24 gives way to 22
        (64, 8, {8, 22}, [8, 16, 22, 32, 40, 48, 56, 64]),
        (64, 8, set(), [8, 16, 24, 32, 40, 48, 56, 64]),
    ],
)
def test_a_sweep_trial_also_evaluates_at_its_rungs(total_steps, eval_every, rung_steps, expected):
    steps = range(1, total_steps + 1)
    points = [
        s for s in steps if s == total_steps or is_eval_step(s, total_steps, eval_every, rung_steps)
    ]
    assert points == expected


@pytest.mark.parametrize(
    "rungs, step_fraction, total_steps, expected",
    [
        ([1 / 9, 1 / 3], 1 / 64, 64, {8, 22}),  # 7.1 and 21.3 steps: the next whole ones
        ([0.25, 0.75], 1 / 64, 64, {16, 48}),  # on a step: that step, not the one after
        ([1 / 3], 1 / 25, 25, {9}),
        # a budget the steps overshoot (1000 tokens, 300 a step: 4 steps); a rung at the
        # last step is the final evaluation, not one of its own
        ([0.25, 0.5, 0.95], 0.3, 4, {1, 2}),
        ([0.5], 1 / 2, 2, {1}),
    ],
)
def test_a_rung_is_evaluated_at_the_first_step_at_or_past_it(
    rungs, step_fraction, total_steps, expected
):
    assert rung_steps(rungs, step_fraction, total_steps) == expected


def test_a_run_given_rungs_reports_there_and_trains_as_without_them():
    common = {"max_steps": None, "budget_tokens": 24 * 512, "total_batch_size": 512}
    common["num_evals"] = 4  # every 6 steps
    seen_plain, seen, ruled_trainer = [], [], {**common, "rungs": [1 / 9, 1 / 3]}
    plain = train(tiny(trainer=common), seen_plain.append, verbose=False)
    ruled = train(tiny(trainer=ruled_trainer), seen.append, verbose=False)
    # the rungs at 2.7 and 8 steps report at 3 and 8, in place of the grid's 6 and 12
    assert [m["step"] for m in seen] == [3, 8, 18, 24]
    assert [m["step"] for m in seen_plain] == [6, 12, 18, 24]
    # a rung past the grid's last step adds an evaluation: 5, not num_evals' 4
    late, seen_late = {**common, "rungs": [0.9]}, []
    train(tiny(trainer=late), seen_late.append, verbose=False)
    assert [m["step"] for m in seen_late] == [6, 12, 18, 22, 24]
    # and a sweep's plan prices as many evaluations as each run makes
    for trainer, reports in ((common, seen_plain), (ruled_trainer, seen), (late, seen_late)):
        run = load_run_config(tiny(trainer=trainer))
        steps, per_token = ruled["steps"], plain["flops_per_token"]
        assert evaluation_count(steps, *evaluation_steps(run, steps, per_token)) == len(reports)
    assert "rung_val_bpb" not in seen[0]  # no forks without a cooldown
    assert ruled["loss_trace"] == plain["loss_trace"]  # evaluating trains nothing
    assert ruled["val_bpb"] == plain["val_bpb"]


def test_a_run_reports_at_its_evaluation_steps_and_at_the_end():
    seen = []
    train(tiny(trainer={"max_steps": 9, "eval_every": 4}), seen.append, verbose=False)
    assert [m["step"] for m in seen] == [4, 9]


def test_a_nan_injected_at_step_k_ends_the_run_at_step_k():
    seen = []
    cfg = tiny(trainer={"max_steps": 10, "eval_every": 4, "nan_at_step": 6})
    result = train(cfg, seen.append, verbose=False)
    assert result["status"] == "diverged" and result["steps"] == 6
    assert [m["step"] for m in seen] == [4, 6]  # reported at once, not at the next eval
    assert math.isfinite(result["loss_trace"][4]) and math.isnan(result["loss_trace"][5])
    assert "nan at step 6" in result["reason"]


@pytest.mark.parametrize(
    "budget, expected_steps",
    [
        ({"max_steps": 7}, 7),
        ({"budget_tokens": 5000}, 10),  # ceil(5000 / 512)
        ({"tokens_per_param": 0.02}, None),  # checked against params below
        ({"budget_flops": 1e9}, None),
    ],
)
def test_budgets(budget, expected_steps):
    trainer = {"max_steps": None} | budget
    cfg = load_run_config(tiny(trainer=trainer))
    params, fpt = 130_000, 800_000
    steps = resolve_total_steps(cfg, params, fpt)
    if expected_steps is None:
        tokens = budget.get("tokens_per_param", 0) * params or budget.get("budget_flops", 0) / fpt
        expected_steps = math.ceil(tokens / 512)
    assert steps == expected_steps


def test_resume_from_state_continues_exactly():
    full = train(tiny(trainer={"max_steps": 8, "eval_every": 4, "dtype": "float32"}), verbose=False)
    states = []
    cfg = tiny(
        trainer={"max_steps": 8, "eval_every": 4, "dtype": "float32", "checkpoint_every_eval": True}
    )
    train(
        cfg,
        lambda m, state=None: states.append(copy.deepcopy(state())) if m["step"] == 4 else None,
        verbose=False,
    )
    resumed = train(cfg, resume_state=states[0], verbose=False)
    assert resumed["loss_trace"] == full["loss_trace"]  # to the last bit
    assert resumed["val_bpb"] == full["val_bpb"]


def test_a_checkpoint_from_before_the_weight_decay_schedule_resumes_exactly():
    # a paused trial of a sweep started before `initial_weight_decay` existed: its groups
    # lack the key, and held their decay constant, as the default schedule does
    trainer = {"max_steps": 8, "eval_every": 4, "dtype": "float32", "checkpoint_every_eval": True}
    cfg = tiny(optimizer={"weight_decay": 0.1}, trainer=trainer)
    full = train(cfg, verbose=False)
    states = []
    train(
        cfg,
        lambda m, state=None: states.append(copy.deepcopy(state())) if m["step"] == 4 else None,
        verbose=False,
    )
    for optimizer in states[0]["optimizer"]:
        for group in optimizer["param_groups"]:
            del group["initial_weight_decay"]
    resumed = train(cfg, resume_state=states[0], verbose=False)
    assert resumed["loss_trace"] == full["loss_trace"]


def test_how_often_a_run_evaluates_leaves_its_training_exactly_as_it_is():
    # what lets a fifo stage report fewer times (sweep.stages.N.reports_per_trial): its
    # ranking reads the last value, which must not depend on the evaluations before it
    common = {"max_steps": 8, "dtype": "float32", "checkpoint_every_eval": True}

    def keep(metrics, state=None):
        state()  # a sweep's report takes the training state at every evaluation

    often = train(tiny(trainer={**common, "eval_every": 1}), keep, verbose=False)
    once = train(tiny(trainer={**common, "eval_every": 8}), keep, verbose=False)
    assert [r["step"] for r in often["history"]] == list(range(1, 9))
    assert [r["step"] for r in once["history"]] == [8]
    assert once["loss_trace"] == often["loss_trace"]  # to the last bit
    assert once["val_bpb"] == often["val_bpb"]


def test_a_cooldown_fork_at_a_rung_scores_the_run_and_leaves_it_exactly_as_it_was():
    common = {"max_steps": 12, "eval_every": 3, "dtype": "float32"}
    plain = train(tiny(trainer=common), verbose=False)
    reports = []
    rungs = {"rungs": [0.25, 0.5], "rung_cooldown": 0.5}
    forked = train(tiny(trainer={**common, **rungs}), lambda m: reports.append(m), verbose=False)
    # the fork trains a copy, which is thrown away: the run goes on to the last bit as before
    assert forked["loss_trace"] == plain["loss_trace"]
    assert forked["val_bpb"] == plain["val_bpb"]
    assert [r["val_bpb"] for r in forked["history"]] == [r["val_bpb"] for r in plain["history"]]
    by_step = {r["step"]: r for r in reports}
    # at each rung (3 and 6 of 12 steps) the rank comes from the cooled copy, elsewhere it
    # is the run's own value; a fork of half the steps so far, with the LR decayed to 0,
    # scores better than the weights at the peak LR
    for step in (3, 6):
        assert by_step[step]["rung_val_bpb"] < by_step[step]["val_bpb"], by_step[step]
    for step in (9, 12):
        assert by_step[step]["rung_val_bpb"] == by_step[step]["val_bpb"]
    assert "rung_val_bpb" not in plain["history"][0]  # off unless a sweep asks for it
    # the forks' compute is counted apart from the run's: 2 steps at step 3 (half of 3,
    # rounded), 3 at step 6; `flops` stays the run's own, the same as without forks
    step_flops = forked["flops"] / forked["steps"]
    assert [by_step[s]["fork_flops"] for s in (3, 6, 9, 12)] == [
        2 * step_flops,
        5 * step_flops,
        5 * step_flops,
        5 * step_flops,
    ]
    assert [r["flops"] for r in forked["history"]] == [r["flops"] for r in plain["history"]]


@pytest.mark.parametrize("optimizer", ["muon_adamw", "adamw"])
@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_the_weight_decay_schedule_is_what_each_step_applies(monkeypatch, optimizer, schedule):
    from sweeper.train.muon import Muon

    # the decay the matrices' optimizer holds as it steps: Muon's (muon_adamw) or the
    # matrix group of AdamW (adamw; its other groups never decay)
    stepped = Muon if optimizer == "muon_adamw" else torch.optim.AdamW
    seen, step = [], stepped.step

    def spy(self, *args, **kwargs):
        seen.append({g["name"]: g["weight_decay"] for g in self.param_groups})
        return step(self, *args, **kwargs)

    monkeypatch.setattr(stepped, "step", spy)
    opt = {"name": optimizer, "weight_decay": 0.2, "weight_decay_schedule": schedule}
    train(tiny(optimizer=opt, trainer={"max_steps": 4}), verbose=False)
    expected = [0.2, 0.15, 0.1, 0.05] if schedule == "linear" else [0.2] * 4
    assert [s["matrix"] for s in seen] == pytest.approx(expected)
    if optimizer == "adamw":
        assert {v for s in seen for k, v in s.items() if k != "matrix"} == {0.0}


def _muon_steps_see(monkeypatch, key: str) -> list[float]:
    """The list that each Muon step appends its (matrix) group's `key` to, as it steps."""
    from sweeper.train.muon import Muon

    seen, step = [], Muon.step

    def spy(self, *args, **kwargs):
        seen.append(self.param_groups[0][key])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Muon, "step", spy)
    return seen


def test_a_cooldown_fork_takes_the_linear_weight_decay_to_zero_as_the_run_would(monkeypatch):
    seen = _muon_steps_see(monkeypatch, "weight_decay")
    opt = {"weight_decay": 0.2, "weight_decay_schedule": "linear"}
    trainer = {"max_steps": 8, "eval_every": 4, "rungs": [0.5], "rung_cooldown": 0.5}
    train(tiny(optimizer=opt, trainer=trainer), verbose=False)
    # steps 0-3 at 0.2 x (1 - step / 8); at the rung, after step 3, a fork of 2 steps goes
    # from step 3's decay (0.125) to the schedule's end (0), as its LR goes from step 3's to
    # the final one; then the run goes on from step 4 as before
    run = [0.2 * (1 - s / 8) for s in range(8)]
    # each fork step at the middle of its span of that decay: a quarter and three
    # quarters of the way down from step 3's, never at the end's 0, where a step moves nothing
    assert seen == pytest.approx([*run[:4], 0.125 * 0.75, 0.125 * 0.25, *run[4:]])


def test_a_one_step_cooldown_fork_still_cools_the_run_it_scores(monkeypatch):
    lrs = _muon_steps_see(monkeypatch, "lr")
    # rung at step 4 of 8 under a 0.25 cooldown: a fork of one step, at half the LR (the
    # middle of a decay to WSD's final 0); at the final LR it would leave the weights as
    # they were, its val_bpb the run's own
    trainer = {"max_steps": 8, "eval_every": 4, "rungs": [0.5], "rung_cooldown": 0.25}
    reports = []
    train(tiny(trainer=trainer), reports.append, verbose=False)
    peak = lrs[3]
    assert len(lrs) == 9 and lrs[4] == pytest.approx(peak / 2)
    assert reports[0]["step"] == 4 and reports[0]["rung_val_bpb"] < reports[0]["val_bpb"]


# A training step's shape, without the model: a burst of activation-sized blocks (0.5-3.5 MiB,
# ~128 MiB in all) freed together at the step's end. The real model's per-step faults were
# once the figure here, but Python's own 1 MiB object arenas (mmapped outside malloc) and a
# late thread arena put hundreds of one-off faults on some steps, and CI hit them.
PAGE_FAULTS_PER_STEP = """
import ctypes, resource, sys, torch
from sweeper.train.cpu_fast import keep_freed_memory_for_reuse
# glibc's own thresholds (128 KiB), fixed: left dynamic, glibc raises them after the first
# large free or not depending on the heap's layout, and trims the step's memory on some
# runs only (5 x 32,225 faults on some, 128 on others, on the same machine)
libc = ctypes.CDLL("libc.so.6")
assert libc.mallopt(-1, 128 << 10) and libc.mallopt(-3, 128 << 10)  # M_TRIM_, M_MMAP_THRESHOLD
if sys.argv[1] == "keep":
    assert keep_freed_memory_for_reuse()
torch.set_num_threads(1)  # one malloc arena: the blocks land where the step frees them


def step():
    activations = [torch.ones((1 + i % 7) << 17) for i in range(64)]
    del activations


for _ in range(2):  # warm up
    step()
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="mallopt is glibc's (Linux)")
def test_training_steps_reuse_freed_memory_instead_of_faulting_it_back_in():
    def faults(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", PAGE_FAULTS_PER_STEP, mode],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout.strip())

    default, kept = faults("default"), faults("keep")
    # measured on a 2-core AMD EPYC: 5 x 32,448 faults under glibc's thresholds (the freed
    # blocks go back to the kernel each step), 0-128 kept
    assert default > 5 * 10_000 and kept * 20 < default, (kept, default)


def _one_second_per_step(monkeypatch) -> list[float]:
    """A fake clock for the training loop, which each optimizer step moves on by 1 s;
    returns it (one float in a list) for a test to move on too."""
    import sweeper.train.loop

    clock = [0.0]
    monkeypatch.setattr(sweeper.train.loop.time, "perf_counter", lambda: clock[0])
    step_batches = BatchSampler.step_batches

    def one_second_per_step(self, *args, **kwargs):
        clock[0] += 1.0
        yield from step_batches(self, *args, **kwargs)

    monkeypatch.setattr(BatchSampler, "step_batches", one_second_per_step)
    return clock


def test_tokens_per_s_counts_training_time_only_whatever_the_eval_and_log_cadence(monkeypatch):
    """A fake clock: each optimizer step takes 1 s and each evaluation 100 s, so every
    throughput figure must be exactly total_batch_size tokens/s. (Evaluations between two
    log lines once dropped the steps before them from the window: 2x too high.)"""
    import sweeper.train.loop

    clock = _one_second_per_step(monkeypatch)

    def slow_evaluate(*args, **kwargs):
        clock[0] += 100.0
        return 3.0

    monkeypatch.setattr(sweeper.train.loop, "evaluate", slow_evaluate)
    cfg = tiny(trainer={"max_steps": 12, "log_every": 4, "eval_every": 3})
    result = train(cfg, verbose=False)
    rates = [m["tokens_per_s"] for m in result["history"] if m["step"] >= 4]
    assert rates and all(r == pytest.approx(512) for r in rates), rates
    assert result["tokens_per_s"] == pytest.approx(512)


def test_a_run_that_trains_no_timed_step_reports_no_speed(monkeypatch):
    """Resumed at its last step a run trains nothing, and one that diverges at its first
    step has no step after it to time: neither has a speed (it once read 5e11 tokens/s)."""
    states = []
    cfg = tiny(trainer={"max_steps": 4, "eval_every": 4, "checkpoint_every_eval": True})
    train(cfg, lambda m, state=None: states.append(copy.deepcopy(state())), verbose=False)
    resumed = train(cfg, resume_state=states[-1], verbose=False)
    assert resumed["steps"] == 4 and resumed["status"] == "completed"
    assert resumed["tokens_per_s"] is None and resumed["mfu"] is None

    _one_second_per_step(monkeypatch)  # so a step that diverges is timed as it is
    first = train(tiny(trainer={"max_steps": 6, "nan_at_step": 1}), verbose=False)
    assert first["status"] == "diverged" and first["steps"] == 1
    assert first["tokens_per_s"] == pytest.approx(512)


def test_a_process_outside_a_process_group_refuses_to_train_for_two_ranks():
    from sweeper.config.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.workers=2, but this process is one of 1 rank:"):
        train(tiny(trainer={"workers": 2, "device_batch_size": 4, "max_steps": 2}), verbose=False)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_memory_a_finished_thread_freed_goes_back_to_the_kernel():
    # the shape of a sweep worker: each trial trains in a new thread, whose malloc arena
    # keeps its peak under keep_freed_memory_for_reuse (small live objects between the freed
    # blocks stop glibc from trimming it) until release_freed_memory trims every arena
    assert keep_freed_memory_for_reuse()
    survivors = []

    def trial():
        activations = []
        for _ in range(200):  # 200 x 4 MiB
            activations.append(torch.ones(1 << 20))
            survivors.append(torch.ones(16))
        del activations

    thread = threading.Thread(target=trial)
    thread.start()
    thread.join()
    kept = _rss_bytes()
    release_freed_memory()
    assert kept - _rss_bytes() > 512 << 20  # most of the 800 MiB is returned


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_peak_memory_counts_from_its_reset_and_sees_a_block_already_freed():
    from sweeper.train.device import peak_memory_bytes, reset_peak_memory

    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    before = peak_memory_bytes(cpu)
    block = torch.ones(64 << 20)  # 256 MiB, touched (over malloc's mmap threshold: returned)
    del block
    assert peak_memory_bytes(cpu) - before > 250 << 20
    assert _rss_bytes() < peak_memory_bytes(cpu) - (250 << 20)  # freed, yet still the peak
    reset_peak_memory(cpu)
    assert abs(peak_memory_bytes(cpu) - _rss_bytes()) < 16 << 20  # from now on


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_reports_the_run_s_peak_memory_which_grows_with_the_batch():
    def peaks(device_batch_size):
        trainer = {"max_steps": 2, "eval_every": 1, "dtype": "float32"}
        trainer |= {"device_batch_size": device_batch_size}
        trainer |= {"total_batch_size": device_batch_size * 64}
        result = train(tiny(trainer=trainer), verbose=False)
        return [m["peak_memory_gib"] for m in result["history"]], result["peak_memory_gib"]

    # a 256 x 64-token micro-batch's logits alone are 16 MiB a copy, and a step holds several
    large, large_end = peaks(256)
    small, small_end = peaks(8)
    # a peak so far at each report; the result's, read after the last report, is the run's
    assert large == sorted(large) and large_end >= large[-1]
    # measured: 0.85 against 0.35 GiB; and the small run, after the large one in the same
    # process, counts its own peak only
    assert large_end - small_end > 0.2 and small_end > 0.1, (large, small)


def test_evaluation_records_no_autograd_graph():
    # a graph kept across the evaluation batches held ~2.6 GB for `small` at 32k tokens
    cfg = load_run_config(tiny())
    data = load_data(cfg.data, cfg.model.seq_len)
    model = GPT(GPTShape.from_config(cfg.model))
    grad_modes = []
    model.register_forward_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    bpb = evaluate(model, data, cfg, torch.device("cpu"), torch.float32, rank=0, world=1)
    assert math.isfinite(bpb) and grad_modes and not any(grad_modes)


def test_numpy_s_memory_error_counts_as_out_of_memory():
    """A batch of indices too big for the machine fails in numpy, not torch: it is the
    same out-of-memory, with its size, not a bug's traceback."""
    import numpy as np

    from sweeper.train.device import out_of_memory

    with pytest.raises(MemoryError) as caught:
        np.empty((4, 2**45), dtype=np.int64)  # 1 PiB: refused before any page is touched
    assert out_of_memory(caught.value) == "1.00 PiB"
    assert out_of_memory(ValueError("Unable to allocate 1 TiB")) is None


def test_the_loop_trains_the_model_with_the_residual_stream_its_device_calls_for(monkeypatch):
    """train() builds the GPT with residual_dtype_for(device, dtype): a GPU's bf16 stream.
    Here the rule is made to pick bf16 on this CPU, and the run must still learn."""
    import sweeper.train.loop

    asked, built = [], []

    def rule(device, dtype):
        asked.append((device.type, dtype))
        return torch.bfloat16

    class Recorded(GPT):
        def __init__(self, shape, residual_dtype=None, ops=PLAIN_OPS):
            super().__init__(shape, residual_dtype, ops)
            built.append(residual_dtype)

    monkeypatch.setattr(sweeper.train.loop, "residual_dtype_for", rule)
    monkeypatch.setattr(sweeper.train.loop, "GPT", Recorded)
    result = train(tiny(trainer={"max_steps": 12, "dtype": "bfloat16"}), verbose=False)
    assert (asked, built) == ([("cpu", torch.bfloat16)], [torch.bfloat16])
    assert result["status"] == "completed"
    assert result["loss_trace"][-1] < result["loss_trace"][0] - 0.5, result["loss_trace"]


def test_mfu_counts_every_device_that_trained_the_tokens():
    """A DDP step's tokens are all ranks' together: two GPUs training 2e5 tokens/s of a
    6 GFLOP/token model use 1.2e15 of their 2 x 1e15 FLOP/s, 60%, not 120%."""
    from sweeper.train.device import utilization

    assert utilization(6e9, 2e5, 1e15, devices=2) == pytest.approx(0.6)
    assert utilization(6e9, 1e5, 1e15, devices=1) == pytest.approx(0.6)
    assert utilization(6e9, 1e5, None, devices=1) is None  # CPU: no peak, no MFU


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L40", 181e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Tesla T4", None),
    ],
)
def test_a_gpu_variant_gets_its_own_peak_not_its_familys(name, peak):
    from sweeper.train.device import peak_bf16_flops

    assert peak_bf16_flops(name) == peak
