"""Optimizer groups and LR schedules."""

import math

import pytest
import torch

from sweeper.config.schema import OptimizerConfig
from sweeper.train.model import GPT, GPTShape
from sweeper.train.optim import (
    ChainedOptimizer,
    build_optimizer,
    update_ratios,
    weights_before_step,
)
from sweeper.train.schedule import lr_multiplier, muon_momentum, weight_decay_multiplier

SHAPE = GPTShape(depth=2, d_model=64, head_dim=32, seq_len=32, vocab_size=256)


@pytest.mark.parametrize("name", ["muon_adamw", "adamw"])
def test_every_parameter_in_exactly_one_group(name):
    model = GPT(SHAPE)
    opt = build_optimizer(model, OptimizerConfig(name=name))
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(seen) == len(set(seen))
    assert set(seen) == {id(p) for p in model.parameters()}


def test_muon_takes_hidden_matrices_adamw_the_rest():
    model = GPT(SHAPE)
    opt = build_optimizer(model, OptimizerConfig(matrix_lr=0.03, embedding_lr=0.2))
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    muon_params = [p for g in muon.param_groups for p in g["params"]]
    assert all(p.ndim == 2 for p in muon_params)
    assert {id(p) for p in muon_params} == {id(p) for b in model.blocks for p in b.parameters()}
    groups = {g["name"]: g for g in adamw.param_groups}
    assert groups["embedding"]["params"][0] is model.wte.weight
    assert groups["unembedding"]["params"][0] is model.lm_head.weight
    scale = (64 / 768) ** -0.5
    assert groups["embedding"]["lr"] == pytest.approx(0.2 * scale)
    assert muon.param_groups[0]["lr"] == pytest.approx(0.03)  # Muon LR is not width-scaled
    assert all(g["weight_decay"] == 0 for g in adamw.param_groups)
    assert adamw.defaults["eps"] == 1e-10 and adamw.defaults["betas"] == (0.8, 0.95)


def test_plain_adamw_decays_matrices_only():
    model = GPT(SHAPE)
    opt = build_optimizer(model, OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1))
    decay = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"matrix": 0.1, "embedding": 0.0, "scalar": 0.0}


def _shape(name, total=100, **kw):
    args = dict(warmup_ratio=0.0, warmdown_ratio=0.4, final_lr_frac=0.0) | kw
    return [lr_multiplier(s, total, name, **args) for s in range(total)]


@pytest.mark.parametrize(
    "name, kw, checks",
    [
        # (step, expected multiplier)
        ("wsd", {}, [(0, 1.0), (59, 1.0), (80, 0.5), (99, 0.025)]),
        ("wsd", {"warmup_ratio": 0.1}, [(0, 0.1), (4, 0.5), (9, 1.0), (50, 1.0)]),
        ("wsd", {"final_lr_frac": 0.1}, [(80, 0.55), (59, 1.0)]),
        ("cosine", {"final_lr_frac": 0.1}, [(0, 1.0), (50, 0.55), (99, 0.1)]),
        ("constant", {"warmup_ratio": 0.1}, [(0, 0.1), (10, 1.0), (99, 1.0)]),
    ],
)
def test_schedule_shapes(name, kw, checks):
    values = _shape(name, **kw)
    for step, expected in checks:
        assert values[step] == pytest.approx(expected, abs=0.011), (step, values[step])
    assert all(0 < v <= 1.0 + 1e-9 for v in values)


@pytest.mark.parametrize("name", ["wsd", "cosine", "constant"])
@pytest.mark.parametrize("total", [15, 37, 74, 100])
@pytest.mark.parametrize("warmup", [0.02, 0.05, 0.15])
def test_warmup_rises_to_the_peak_and_never_past_it(name, total, warmup):
    """Where warmup_ratio x total is no whole number of steps (0.02 of the default run's 74,
    full.yaml's 0.05 and 0.15 of 37), the warm-up still ends at the peak, not above it."""
    values = _shape(name, total=total, warmup_ratio=warmup, warmdown_ratio=0.2)
    steps = math.ceil(warmup * total)
    assert values[:steps] == sorted(values[:steps]) and values[steps - 1] == pytest.approx(1.0)
    assert max(values) <= 1.0 + 1e-12, max(values)


def test_decays_are_monotone():
    for name in ("wsd", "cosine"):
        values = _shape(name, warmup_ratio=0.05)
        tail = values[10:]
        assert all(b <= a + 1e-12 for a, b in zip(tail, tail[1:]))


def test_muon_momentum_warmup():
    assert muon_momentum(0, 0.85, 0.95, 300) == pytest.approx(0.85)
    assert muon_momentum(150, 0.85, 0.95, 300) == pytest.approx(0.90)
    assert muon_momentum(1000, 0.85, 0.95, 300) == pytest.approx(0.95)


def test_weight_decay_schedules():
    assert [weight_decay_multiplier(s, 4, "constant") for s in range(5)] == [1.0] * 5
    # linear: from the full decay at step 0 to none at the run's end, never below
    assert [weight_decay_multiplier(s, 4, "linear") for s in range(6)] == [
        1.0,
        0.75,
        0.5,
        0.25,
        0.0,
        0.0,
    ]


def test_every_group_keeps_its_weight_decay_for_the_schedule():
    opt = build_optimizer(GPT(SHAPE), OptimizerConfig(name="adamw", weight_decay=0.1))
    assert {g["name"]: g["initial_weight_decay"] for g in opt.param_groups} == {
        "matrix": 0.1,
        "embedding": 0.0,
        "scalar": 0.0,
    }


def _muon_params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    # two of one shape (batched together), a tall one and a wide one
    shapes = [(32, 32), (32, 32), (96, 32), (32, 96)]
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_our_muon_steps_like_torchs(ns_dtype):
    from sweeper.train.muon import Muon

    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="original")
    ours_params, torch_params = _muon_params(0), _muon_params(0)
    ours = Muon(ours_params, ns_dtype=ns_dtype, **hyper)
    reference = torch.optim.Muon(torch_params, **hyper)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # momentum and Nesterov come into play from the second step
        for a, b in zip(ours_params, torch_params, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        ours.step()
        reference.step()
    start = _muon_params(0)
    for a, b, p0 in zip(ours_params, torch_params, start, strict=True):
        moved = (b - p0).norm()
        assert moved > 0.01
        # bf16: the same maths as torch's (rounding differs with the batched matmul);
        # fp32: torch's bf16 result to within bf16's precision, i.e. the same update
        tolerance = 0.01 if ns_dtype == torch.bfloat16 else 0.03
        assert (a - b).norm() / moved < tolerance
    assert ours.state_dict()["state"].keys() == reference.state_dict()["state"].keys()


def _textbook_newton_schulz(grads, coefficients, steps):
    """Muon's quintic iteration as torch.optim.Muon writes it, one matrix at a time."""
    a, b, c = coefficients
    tall = grads.size(-2) > grads.size(-1)
    x = grads.mT if tall else grads
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


@pytest.mark.parametrize("shape", [(3, 16, 64), (3, 64, 16)])
def test_gram_form_computes_the_textbook_iteration(shape):
    from sweeper.train.muon import newton_schulz

    coefficients = (3.4445, -4.7750, 2.0315)
    grads = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz(grads, coefficients, 5, 1e-7)  # wide in fp64: the Gram form
    torch.testing.assert_close(ours, _textbook_newton_schulz(grads, coefficients, 5))


def test_gram_form_in_fp32_stays_far_inside_bf16_precision_on_ill_conditioned_grads():
    from sweeper.train.muon import newton_schulz

    g = torch.Generator().manual_seed(0)
    # singular values spread over six decades, as momentum buffers of hidden layers can be
    spread = torch.randn(4, 64, 64, generator=g) * torch.logspace(0, -6, 64)
    grads = spread @ torch.randn(4, 64, 256, generator=g)
    coefficients = (3.4445, -4.7750, 2.0315)
    exact = _textbook_newton_schulz(grads.double(), coefficients, 5)
    ours = newton_schulz(grads, coefficients, 5, 1e-7).double()
    # measured ~1e-4; torch's Muon runs the whole iteration in bf16 (~4e-3 per rounding)
    assert (ours - exact).norm() / exact.norm() < 1e-3


def test_newton_schulz_orthogonalises_each_matrix_of_a_batch():
    from sweeper.train.muon import newton_schulz

    grads = torch.randn(3, 64, 16, dtype=torch.float64)
    ortho = newton_schulz(grads, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    singular = torch.linalg.svdvals(ortho)
    # Muon's quintic drives every singular value into roughly [0.7, 1.2], not exactly 1
    assert singular.min() > 0.6 and singular.max() < 1.25
    # and each matrix keeps its own singular vectors: the same as orthogonalising alone
    alone = newton_schulz(grads[1], (3.4445, -4.7750, 2.0315), 5, 1e-7)
    torch.testing.assert_close(ortho[1], alone)


def test_update_ratios_are_each_groups_step_over_its_weights_norm():
    a, b = torch.nn.Parameter(torch.full((4,), 1.0)), torch.nn.Parameter(torch.zeros(3))
    c = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    sgd = torch.optim.SGD(
        [dict(name="matrix", params=[a, b], lr=0.1), dict(name="scalar", params=[c], lr=0.5)]
    )
    optimizer = ChainedOptimizer([sgd])
    a.grad, b.grad, c.grad = torch.ones(4), torch.full((3,), 2.0), torch.tensor([0.0, 2.0])
    before = weights_before_step(optimizer)
    optimizer.step()
    ratios = update_ratios(optimizer, before)
    # matrix: the step 0.1 x (1,1,1,1, 2,2,2) has norm 0.1 x 4, the weights (1,1,1,1, 0,0,0) 2
    # scalar: 0.5 x (0, 2) over (3, 4): 1 / 5
    assert ratios == pytest.approx({"matrix": 0.2, "scalar": 0.2})
    # the copies are the weights before the step, not views of the stepped ones
    assert before["matrix"][0].tolist() == [1.0] * 4
    assert a.tolist() == pytest.approx([0.9] * 4)
