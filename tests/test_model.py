"""The GPT: initial loss, accounting against a hand count, learning at all."""

import math

import pytest
import torch

from sweeper.model import GPT, GPTShape

SHAPE = GPTShape(depth=2, d_model=64, head_dim=32, seq_len=32, vocab_size=256)


def test_loss_at_init_is_uniform_guess():
    torch.manual_seed(0)
    model = GPT(SHAPE)
    idx = torch.randint(0, 256, (4, 32))
    loss = model(idx, torch.randint(0, 256, (4, 32)))
    assert loss.item() == pytest.approx(math.log(256), abs=0.05)


def test_param_and_flop_accounting_by_hand():
    L, d, V, T = SHAPE.depth, SHAPE.d_model, SHAPE.vocab_size, SHAPE.seq_len
    per_block = 4 * d * d + 2 * (4 * d * d)  # q, k, v, proj + MLP up and down
    counts = GPT(SHAPE).param_counts()
    assert counts["embedding"] == V * d
    assert counts["matmul"] == L * per_block + V * d  # hidden matrices + lm_head
    assert counts["total"] == L * per_block + 2 * V * d + 2 * L  # + wte + 2 scalars/layer
    assert counts["non_embedding"] == counts["total"] - V * d
    assert GPT(SHAPE).flops_per_token() == 6 * (L * per_block + V * d) + 12 * L * d * T


def test_output_projections_start_at_zero_so_blocks_are_identity():
    model = GPT(SHAPE)
    for block in model.blocks:
        assert block.attn.c_proj.weight.abs().sum() == 0
        assert block.mlp.c_proj.weight.abs().sum() == 0


def test_width_follows_depth():
    from sweeper.config import ModelConfig

    assert ModelConfig(depth=6).width == 6 * 64
    assert ModelConfig(depth=6, d_model=128).width == 128


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(SHAPE)
    x = torch.randint(0, 256, (2, 32))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(150):
        loss = model(x, y)
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 5.0 and loss.item() < 0.1


def test_softcap_bounds_logits():
    model = GPT(SHAPE)
    with torch.no_grad():
        model.lm_head.weight.fill_(10.0)
    logits = model(torch.randint(0, 256, (1, 8)))
    assert logits.abs().max() <= SHAPE.softcap + 1e-4


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_hand_written_rms_norm_matches_torch_forward_and_backward(dtype, tol):
    from sweeper.model import rms_norm

    x = torch.randn(4, 8, 64, dtype=dtype) * 3
    grad = torch.randn_like(x)
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = rms_norm(ours)
    y_ref = torch.nn.functional.rms_norm(ref.float(), (64,), eps=1e-6).to(dtype)
    y.backward(grad)
    y_ref.backward(grad)
    assert y.dtype == dtype and torch.allclose(y.float(), y_ref.float(), atol=tol, rtol=tol)
    assert torch.allclose(ours.grad.float(), ref.grad.float(), atol=tol, rtol=tol)
    assert torch.autograd.gradcheck(
        rms_norm, torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    )
