"""The GPT: initial loss, accounting against a hand count, learning at all."""

import math

import pytest
import torch

from sweeper.train.cpu_fast import CPU_OPS
from sweeper.train.model import GPT, PLAIN_OPS, GPTShape, residual_dtype_for

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
    # the count from the shape alone, which the memory check uses before building anything
    assert SHAPE.n_params == counts["total"]
    wide = GPTShape(depth=3, d_model=64, head_dim=16, seq_len=8, vocab_size=300)
    assert wide.n_params == GPT(wide).param_counts()["total"]
    assert GPT(SHAPE).flops_per_token() == 6 * (L * per_block + V * d) + 12 * L * d * T
    # and from the shape alone, which budgets and a sweep's progress weigh runs by
    for shape in (SHAPE, wide):
        model = GPT(shape)
        assert shape.n_matmul_params == model.param_counts()["matmul"]
        assert shape.flops_per_token == model.flops_per_token()


def test_output_projections_start_at_zero_so_blocks_are_identity():
    model = GPT(SHAPE)
    for block in model.blocks:
        assert block.attn.c_proj.weight.abs().sum() == 0
        assert block.mlp.c_proj.weight.abs().sum() == 0


def test_width_follows_depth():
    from sweeper.config.schema import ModelConfig

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


@pytest.mark.parametrize("residual_dtype", [None, torch.bfloat16])
def test_the_whole_model_compiles_as_one_graph(residual_dtype):
    """torch.compile must see the forward and the loss in one graph: each graph break is a
    fusion boundary and an eager fallback (a class attribute read inside the RMSNorm path
    once broke the graph at every norm, halving the d12 MFU on an H100)."""
    import torch._dynamo

    torch._dynamo.reset()
    model = GPT(SHAPE, residual_dtype)
    idx = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)(idx, idx)
    reasons = [b.reason.splitlines()[0] for b in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons


@pytest.mark.parametrize(
    "device, dtype, expected",
    [
        ("cuda", torch.bfloat16, torch.bfloat16),
        ("cuda", torch.float16, None),
        ("cuda", torch.float32, None),
        ("cpu", torch.bfloat16, None),
        ("cpu", torch.float32, None),
    ],
)
def test_the_residual_stream_is_carried_in_the_autocast_dtype_on_gpus_only(device, dtype, expected):
    assert residual_dtype_for(torch.device(device), dtype) == expected


@pytest.mark.parametrize("ops", [PLAIN_OPS, CPU_OPS], ids=["plain", "cpu_fast"])
def test_a_bf16_residual_stream_reaches_every_block_in_bf16_and_keeps_the_loss(ops):
    """GPT(shape, bf16) under autocast: each block reads and writes bf16 (the point: half
    the bytes between the matmuls), the loss is still fp32 and equals the fp32 stream's
    within bf16 rounding, and every parameter gets a gradient of its own dtype."""
    torch.manual_seed(0)
    fp32_stream = GPT(SHAPE, ops=ops)
    with torch.no_grad():  # non-trivial output projections and scalars
        for p in fp32_stream.parameters():
            p.add_(0.05 * torch.randn_like(p))
    bf16_stream = GPT(SHAPE, torch.bfloat16, ops)
    bf16_stream.load_state_dict(fp32_stream.state_dict())
    seen = []
    for block in bf16_stream.blocks:
        block.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    idx = torch.randint(0, 256, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = bf16_stream(idx, idx)
        reference = fp32_stream(idx, idx)
    loss.backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)] * SHAPE.depth
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=0, atol=2e-2)
    for name, p in bf16_stream.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        assert torch.isfinite(p.grad).all(), name
