"""The GPT: initial loss, accounting against a hand count, learning at all."""

import math

import pytest
import torch

from sweeper.train.model import GPT, GPTShape, residual_dtype_for

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


def test_soft_cap_by_sigmoid_matches_tanh_in_value_and_gradient(monkeypatch):
    from sweeper.train.model import soft_cap

    logits = torch.cat([torch.randn(4096) * 20, torch.tensor([0.0, 1e-3, 1e4, -1e4])])
    by_tanh = lambda t: 15.0 * torch.tanh(t / 15.0)  # noqa: E731
    ours, ours_grads = _grads(lambda t: soft_cap(t, 15.0), logits)
    ref, ref_grads = _grads(by_tanh, logits)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_grads, ref_grads, rtol=0, atol=1e-5)
    assert ours.abs().max() <= 15.0 and ours[-2] == 15.0 and ours[-1] == -15.0
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the compiled form
    torch.testing.assert_close(soft_cap(logits, 15.0), ref, rtol=0, atol=0)
    assert soft_cap(logits, 0.0) is logits


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_hand_written_rms_norm_matches_torch_forward_and_backward(dtype, tol):
    from sweeper.train.model import rms_norm

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


def _grads(fn, *inputs, seed=0):
    """fn's value and the gradients of its inputs for a fixed random upstream gradient."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    return out.detach(), [t.grad for t in inputs]


def test_hand_written_relu_squared_and_scaled_sum_match_plain_ops():
    from sweeper.train.model import relu_squared, scaled_sum

    x = torch.randn(4, 8, 32, dtype=torch.float64)
    ours, ours_grads = _grads(relu_squared, x)
    ref, ref_grads = _grads(lambda t: torch.relu(t) ** 2, x)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours_grads, ref_grads)

    a, b = torch.tensor(0.7, dtype=torch.float64), torch.tensor(-0.3, dtype=torch.float64)
    y = torch.randn_like(x)
    ours, ours_grads = _grads(scaled_sum, a, x, b, y)
    ref, ref_grads = _grads(lambda a, x, b, y: a * x + b * y, a, x, b, y)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours_grads, ref_grads)
    assert ours_grads[0].shape == () and ours_grads[2].shape == ()  # scalar params stay scalar
    assert torch.autograd.gradcheck(relu_squared, x[:1, :2].clone().requires_grad_())
    assert torch.autograd.gradcheck(
        scaled_sum, [t.clone().requires_grad_() for t in (a, x[:1, :2], b, y[:1, :2])]
    )
    # the first layer's case, x and y one tensor: its gradient is both terms'
    ours, ours_grads = _grads(lambda a, x, b: scaled_sum(a, x, b, x), a, x, b)
    ref, ref_grads = _grads(lambda a, x, b: a * x + b * x, a, x, b)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours_grads, ref_grads)
    assert torch.autograd.gradcheck(
        lambda a, x, b: scaled_sum(a, x, b, x),
        [t.clone().requires_grad_() for t in (a, x[:1, :2], b)],
    )


def rotate_pairs_by_hand(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """The textbook form: each (even, odd) pair rotated by its position's angle."""
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = rotary[..., 0], rotary[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def heads_by_hand(qkv: torch.Tensor, rotary: torch.Tensor):
    """q, k, v (B, nh, T, hs) from qkv (B, T, 3, nh, hs) in textbook ops: RoPE pair by
    pair, then RMSNorm of each head."""
    q, k, v = qkv.unbind(2)
    norm = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    q, k = (norm(rotate_pairs_by_hand(t, rotary[:, 0])) for t in (q, k))
    return tuple(t.transpose(1, 2) for t in (q, k, v))


def test_attention_heads_eagerly_and_in_compile_form_match_the_textbook_and_rope_is_relative(
    monkeypatch,
):
    from sweeper.train.model import attention_heads, rotary_table, rotate_real

    T, hs = 16, 8
    rotary = rotary_table(T, hs).double()
    qkv = torch.randn(2, T, 3, 3, hs, dtype=torch.float64)  # (B, T, q/k/v, heads, head size)
    stacked = lambda fn: lambda x: torch.stack(fn(x, rotary))  # noqa: E731
    ref, ref_grads = _grads(stacked(heads_by_hand), qkv)
    ours, ours_grads = _grads(stacked(attention_heads), qkv)  # the autograd.Function
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours_grads, ref_grads)
    assert all(t.is_contiguous() for t in attention_heads(qkv, rotary))  # as attention reads
    assert torch.autograd.gradcheck(
        stacked(attention_heads), qkv[:1, :, :, :1].clone().requires_grad_()
    )
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    compiled, compiled_grads = _grads(stacked(attention_heads), qkv)  # the plain ops
    torch.testing.assert_close(compiled, ref)
    torch.testing.assert_close(compiled_grads, ref_grads)
    x = qkv[:, :, :2]
    torch.testing.assert_close(rotate_real(x, rotary), rotate_pairs_by_hand(x, rotary))
    torch.testing.assert_close(rotate_real(x, rotary).norm(dim=-1), x.norm(dim=-1))  # a rotation
    monkeypatch.undo()

    # the same q and k placed at positions (m, n) and (m + s, n + s): the same score
    q, k = torch.randn(hs, dtype=torch.float64), torch.randn(hs, dtype=torch.float64)
    at = lambda v, pos: attention_heads(v.expand(1, T, 3, 1, hs), rotary)[0][0, 0, pos]  # noqa: E731
    score = lambda m, n: (at(q, m) * at(k, n)).sum()  # noqa: E731
    torch.testing.assert_close(score(3, 1), score(12, 10))
    assert not torch.isclose(score(3, 1), score(3, 2))


def test_model_gives_the_same_loss_and_gradients_eagerly_and_with_the_compile_forms(
    monkeypatch,
):
    """The hand-written autograd.Functions (eager) and the plain ops torch.compile sees are
    one model: same loss, same gradients."""
    torch.manual_seed(0)
    model = GPT(SHAPE).double()
    with torch.no_grad():  # non-trivial output projections and scalars
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    idx = torch.randint(0, 256, (2, 16))

    def loss_and_grads():
        model.zero_grad()
        loss = model(idx, idx)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager_loss, eager_grads = loss_and_grads()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    plain_loss, plain_grads = loss_and_grads()
    torch.testing.assert_close(eager_loss, plain_loss)
    torch.testing.assert_close(eager_grads, plain_grads)


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


@pytest.mark.parametrize("compile_forms", [False, True])
def test_a_bf16_residual_stream_reaches_every_block_in_bf16_and_keeps_the_loss(
    compile_forms, monkeypatch
):
    """GPT(shape, bf16) under autocast: each block reads and writes bf16 (the point: half
    the bytes between the matmuls), the loss is still fp32 and equals the fp32 stream's
    within bf16 rounding, and every parameter gets a gradient of its own dtype."""
    if compile_forms:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.manual_seed(0)
    fp32_stream = GPT(SHAPE)
    with torch.no_grad():  # non-trivial output projections and scalars
        for p in fp32_stream.parameters():
            p.add_(0.05 * torch.randn_like(p))
    bf16_stream = GPT(SHAPE, torch.bfloat16)
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
