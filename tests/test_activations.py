"""activations.py: dead MLP units and the residual stream's size, read at each evaluation."""

from __future__ import annotations

import copy

import pytest
import torch

from sweeper.config.schema import load_run_config
from sweeper.train.activations import ACTIVATION_COLUMNS, TOKENS, ActivationWatch
from sweeper.train.data import load_data, val_windows
from sweeper.train.evaluation import evaluate
from sweeper.train.loop import train
from sweeper.train.model import GPT, GPTShape, rms_norm, scaled_sum

from .conftest import tiny


def model_and_batch(dead_per_layer: int = 0):
    """The tiny GPT with `dead_per_layer` MLP units of each layer silenced (their input
    weights zeroed: a pre-activation of 0 for every token), and one validation batch."""
    cfg = load_run_config(tiny())
    torch.manual_seed(0)
    model = GPT(GPTShape.from_config(cfg.model))
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.c_fc.weight[:dead_per_layer] = 0
            # live output projections, so later layers see what the MLPs compute
            torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.02)
            torch.nn.init.normal_(block.attn.c_proj.weight, std=0.02)
    data = load_data(cfg.data, cfg.model.seq_len)
    x, y = next(iter(val_windows(data.val, cfg.model.seq_len, 4096, 32)))
    return cfg, data, model, x, y


def residual_by_hand(model: GPT, x: torch.Tensor) -> torch.Tensor:
    """What the last block hands to the final norm, computed without hooks."""
    rotary = model.rotary[: x.size(1)]
    h = x0 = rms_norm(model.wte(x))
    for i, block in enumerate(model.blocks):
        h = block(scaled_sum(model.resid_lambdas[i], h, model.x0_lambdas[i], x0), rotary)
    return h


@torch.no_grad()
def test_dead_units_zeros_and_the_residual_rms_of_one_forward_pass():
    cfg, _, model, x, _ = model_and_batch(dead_per_layer=64)
    watch = ActivationWatch(model)
    with watch.recording():
        model(x)
    stats = watch.stats
    assert tuple(stats) == ACTIVATION_COLUMNS
    width = 4 * cfg.model.depth * cfg.model.aspect_ratio  # the MLP's hidden units a layer
    # the 64 silenced units of every layer, and none of the live ones over the tokens read
    assert stats["dead_units"] == pytest.approx(64 / width)
    # the live units are off for about half the tokens (random init), the dead ones always
    expected_zeros = 64 / width + (1 - 64 / width) * 0.5
    assert stats["mlp_zero_fraction"] == pytest.approx(expected_zeros, abs=0.05)
    residual = residual_by_hand(model, x).flatten(0, -2)[:TOKENS]  # the tokens read
    assert stats["residual_rms"] == pytest.approx(residual.square().mean().sqrt().item(), rel=1e-5)
    # the hooks are gone: the next pass records nothing
    assert all(not block.mlp.c_fc._forward_hooks for block in model.blocks)
    assert not model.blocks[-1]._forward_hooks
    watch.stats = {}
    model(x)
    assert watch.stats == {}


@torch.no_grad()
def test_the_share_of_logits_the_soft_cap_saturates():
    import math

    from sweeper.train.activations import SATURATED, activations_text

    cfg, _, model, x, _ = model_and_batch()
    torch.nn.init.normal_(model.lm_head.weight, std=2.0)  # logits ~ N(0, 16): some past 31
    watch = ActivationWatch(model)
    with watch.recording():
        model(x)
    raw = model.lm_head(rms_norm(residual_by_hand(model, x))).flatten(0, -2)[:TOKENS]
    capped = cfg.model.softcap * torch.tanh(raw / cfg.model.softcap)
    by_hand = (capped.abs() > SATURATED * cfg.model.softcap).float().mean().item()
    assert 0.01 < by_hand < 0.2 and watch.stats["softcap_saturation"] == pytest.approx(by_hand)
    assert "softcap saturated" in activations_text(watch.stats)
    # without a cap there is no tanh to saturate: no figure, rather than a 0 that says "fine"
    model.shape = GPTShape.from_config(load_run_config(tiny(model={"softcap": 0.0})).model)
    with watch.recording():
        model(x)
    assert watch.stats["softcap_saturation"] is None and math.isfinite(watch.stats["residual_rms"])
    assert "softcap" not in activations_text(watch.stats)


def test_a_pass_the_hooks_do_not_reach_is_recorded_by_an_eager_pass_of_its_batch():
    """A compiled model's graph does not call the eager modules' hooks: evaluate() then runs
    the eager model on the same first batch. Stood in for here by a watch on a copy."""
    cfg, data, model, _, _ = model_and_batch(dead_per_layer=8)
    direct, aside = ActivationWatch(model), ActivationWatch(copy.deepcopy(model))
    cpu = torch.device("cpu")
    bpb = evaluate(model, data, cfg, cpu, torch.float32, 0, 1, watch=direct)
    assert evaluate(model, data, cfg, cpu, torch.float32, 0, 1, watch=aside) == bpb
    assert aside.stats and aside.stats == pytest.approx(direct.stats, rel=1e-6)
    assert direct.stats["dead_units"] >= 8 / 256


def test_every_report_says_how_the_activations_look_and_a_diverged_one_says_nothing():
    seen = []
    train(tiny(trainer={"max_steps": 6, "eval_every": 3}), seen.append, verbose=False)
    assert [m["step"] for m in seen] == [3, 6]
    for metrics in seen:
        assert set(ACTIVATION_COLUMNS) <= metrics.keys()
        assert 0 < metrics["mlp_zero_fraction"] < 1 and 0 <= metrics["dead_units"] < 1
        assert 0 < metrics["residual_rms"] < 100 and 0 <= metrics["softcap_saturation"] < 1
    # a run that diverged is not evaluated at its end: no figures from an earlier evaluation
    seen = []
    trainer = {"max_steps": 6, "eval_every": 2, "nan_at_step": 5}
    result = train(tiny(trainer=trainer), seen.append, verbose=False)
    assert result["status"] == "diverged" and [m["step"] for m in seen] == [2, 4, 5]
    assert set(ACTIVATION_COLUMNS) <= seen[1].keys()
    assert not set(ACTIVATION_COLUMNS) & seen[-1].keys()


def test_a_learning_rate_far_too_high_shows_as_a_residual_stream_that_grows():
    def last_rms(matrix_lr: float) -> float:
        seen = []
        trainer = {"max_steps": 20, "eval_every": 20, "dtype": "float32", "max_loss": 100.0}
        optimizer = {"matrix_lr": matrix_lr, "embedding_lr": 3.0 if matrix_lr > 0.1 else 0.2}
        train(tiny(trainer=trainer, optimizer=optimizer), seen.append, verbose=False)
        return seen[-1]["residual_rms"]

    # measured on the `small` model at 30 steps: ~2 at the default LRs, 1.7e5 at 50x
    assert last_rms(1.0) > 20 * last_rms(0.02)


def test_an_output_head_lr_far_too_high_shows_as_logits_held_at_the_cap():
    def saturation(unembedding_lr: float) -> float:
        seen = []
        trainer = {"max_steps": 20, "eval_every": 20, "dtype": "float32", "max_loss": 100.0}
        optimizer = {"unembedding_lr": unembedding_lr}
        train(tiny(trainer=trainer, optimizer=optimizer), seen.append, verbose=False)
        return seen[-1]["softcap_saturation"]

    # measured on the `small` model at 30 steps: 0% at the default 0.004, 26% at 0.1
    assert saturation(0.004) < 0.01 < 0.05 < saturation(0.2)
