"""The CPU fast paths (cpu_fast.py) against the plain ops: values and gradients, and causal
attention's bf16 backward against SDPA and an fp64 reference."""

import pytest
import torch
import torch.nn.functional as F

import sweeper.train.cpu_fast as cpu_fast
from sweeper.train.cpu_fast import CPU_OPS, backward_blocks, causal_attention, use_cpu_backward
from sweeper.train.model import GPT, PLAIN_OPS, GPTShape, rotary_table, rotate_real

SHAPE = GPTShape(depth=2, d_model=64, head_dim=32, seq_len=32, vocab_size=256)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def qk_normed_inputs(B=2, H=3, T=64, D=32, seed=0):
    """fp64 queries and keys of RMS 1 (QK-norm's output), correlated so that some scores
    reach the bound sqrt(D), where a bf16 rounding of the scores hurts most; values and
    the output's gradient at random."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    normed = lambda t: t / t.pow(2).mean(-1, keepdim=True).sqrt()
    q = normed(base + 0.5 * torch.randn(base.shape, generator=g, dtype=torch.float64))
    k = normed(base + 0.5 * torch.randn(base.shape, generator=g, dtype=torch.float64))
    v = torch.randn(base.shape, generator=g, dtype=torch.float64)
    grad = torch.randn(base.shape, generator=g, dtype=torch.float64)
    return q, k, v, grad


def output_and_grads(fn, inputs, dtype):
    q, k, v, grad = inputs
    leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad.to(dtype))
    return [out.detach().double()] + [t.grad.double() for t in leaves]


def relative_errors(results, reference):
    return [((r - ref).norm() / ref.norm()).item() for r, ref in zip(results, reference)]


@pytest.mark.parametrize("T, D", [(64, 32), (63, 32), (64, 64)])  # odd T: one query block
def test_bf16_backward_is_as_accurate_as_sdpas_own(T, D):
    """Against fp64, the hand-written backward's gradients are within SDPA's bf16 error
    (x1.5 and a little; measured 1.34x for dq at D=32, 1.1x at D=64): the -lse and -delta
    columns keep the scores' rounding off P."""
    inputs = qk_normed_inputs(T=T, D=D)
    reference = output_and_grads(sdpa, inputs, torch.float64)
    theirs = relative_errors(output_and_grads(sdpa, inputs, torch.bfloat16), reference)
    ours = relative_errors(
        output_and_grads(cpu_fast._CausalAttentionCPU.apply, inputs, torch.bfloat16), reference
    )
    assert ours[0] == theirs[0]  # the forward is SDPA's own kernel
    for name, mine, sdpas in zip(["dq", "dk", "dv"], ours[1:], theirs[1:]):
        assert mine <= 1.5 * sdpas + 1e-4, f"{name}: {mine:.2e} against SDPA's {sdpas:.2e}"
        assert mine < 0.02, name


def test_the_scores_rounded_to_bf16_would_not_be_accurate_enough(monkeypatch):
    """What the augmented columns buy: with lse subtracted after a plain bf16 matmul, dv's
    error is well above SDPA's. (Guards the test above from passing on any backward.)"""
    inputs = qk_normed_inputs()
    reference = output_and_grads(sdpa, inputs, torch.float64)
    theirs = relative_errors(output_and_grads(sdpa, inputs, torch.bfloat16), reference)
    monkeypatch.setattr(cpu_fast, "_split_bf16", _hi_only)
    coarse = relative_errors(
        output_and_grads(cpu_fast._CausalAttentionCPU.apply, inputs, torch.bfloat16), reference
    )
    assert coarse[3] > 1.5 * theirs[3]


def _hi_only(x):
    """lse and delta to bf16 once, no low part: a subtraction at bf16 precision."""
    return x.to(torch.bfloat16), torch.zeros_like(x, dtype=torch.bfloat16)


def test_small_blocks_give_the_same_gradients(monkeypatch):
    """Many small blocks (one head at a time, eight query blocks) and one big one agree."""
    inputs = qk_normed_inputs(T=64)
    whole = output_and_grads(cpu_fast._CausalAttentionCPU.apply, inputs, torch.bfloat16)
    monkeypatch.setattr(cpu_fast, "BLOCK_BYTES", 8 * 64 * 2)
    assert backward_blocks(6, 64) == (1, 8)
    blocked = output_and_grads(cpu_fast._CausalAttentionCPU.apply, inputs, torch.bfloat16)
    for a, b in zip(whole, blocked):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "n_heads, seq_len, block_bytes, expected",
    [
        (64, 256, 2 << 20, (32, 2)),  # the small preset: 32 heads x 128 rows x 256 keys x 2 B
        (64, 255, 2 << 20, (16, 1)),  # odd T: no causal split
        (8, 4096, 2 << 20, (1, 16)),  # long sequences: more query blocks, one head
        (4, 64, 2 << 20, (4, 2)),  # fewer heads than fit
        (4, 6, 1, (1, 2)),  # T=6 splits once: 3 rows cannot halve again
    ],
)
def test_backward_blocks(monkeypatch, n_heads, seq_len, block_bytes, expected):
    monkeypatch.setattr(cpu_fast, "BLOCK_BYTES", block_bytes)
    assert backward_blocks(n_heads, seq_len) == expected


def test_only_cpu_bf16_training_takes_the_hand_written_backward():
    q = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16, requires_grad=True)
    assert use_cpu_backward(q, q, q)
    assert not use_cpu_backward(q.float(), q.float(), q.float())  # fp32: SDPA
    assert not use_cpu_backward(q.detach(), q.detach(), q.detach())  # no gradient wanted
    with torch.no_grad():  # evaluation
        assert not use_cpu_backward(q, q, q)
        torch.testing.assert_close(causal_attention(q, q, q), sdpa(q, q, q), rtol=0, atol=0)


def test_model_trains_through_it_under_autocast(monkeypatch):
    """The GPT's attention takes it in a CPU bf16 autocast step (once per layer), and the
    model's gradients match those it gets through SDPA to bf16's precision."""
    torch.manual_seed(0)
    model = GPT(SHAPE, ops=CPU_OPS)
    with torch.no_grad():  # non-zero output projections, so gradients reach q, k and v
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    idx = torch.randint(0, 256, (4, 32))

    def grads():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx, idx).backward()
        return [p.grad.clone() for p in model.parameters()]

    calls = []
    original = cpu_fast._CausalAttentionCPU.backward

    def counted(ctx, grad):
        calls.append(grad.dtype)
        return original(ctx, grad)

    monkeypatch.setattr(cpu_fast._CausalAttentionCPU, "backward", staticmethod(counted))
    ours = grads()
    assert calls == [torch.bfloat16, torch.bfloat16]
    monkeypatch.setattr(cpu_fast, "use_cpu_backward", lambda q, k, v: False)
    theirs = grads()
    assert len(calls) == 2
    assert model.blocks[0].attn.c_q.weight.grad.abs().sum() > 0
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=5e-2)


@pytest.mark.parametrize("shape", [(5, 7, 64), (2, 3, 4, 9, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_dot_is_the_last_dimensions_dot_product(shape, dtype):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(shape, generator=g, dtype=dtype)
    b = torch.randn(shape, generator=g, dtype=dtype)
    expected = (a.double() * b.double()).sum(-1, keepdim=True)
    got = cpu_fast.row_dot(a, b)
    assert got.shape == (*shape[:-1], 1) and got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # a transposed (non-contiguous) operand reads the same numbers
    at = a.transpose(0, 1).contiguous().transpose(0, 1)
    torch.testing.assert_close(cpu_fast.row_dot(at, b), got)


def test_soft_cap_by_sigmoid_matches_tanh_in_value_and_gradient():
    from sweeper.train.cpu_fast import soft_cap
    from sweeper.train.model import soft_cap as plain_soft_cap

    logits = torch.cat([torch.randn(4096) * 20, torch.tensor([0.0, 1e-3, 1e4, -1e4])])
    by_tanh = lambda t: 15.0 * torch.tanh(t / 15.0)  # noqa: E731
    ours, ours_grads = _grads(lambda t: soft_cap(t, 15.0), logits)
    ref, ref_grads = _grads(by_tanh, logits)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_grads, ref_grads, rtol=0, atol=1e-5)
    assert ours.abs().max() <= 15.0 and ours[-2] == 15.0 and ours[-1] == -15.0
    torch.testing.assert_close(plain_soft_cap(logits, 15.0), ref, rtol=0, atol=0)
    assert soft_cap(logits, 0.0) is logits and plain_soft_cap(logits, 0.0) is logits


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_hand_written_rms_norm_matches_torch_forward_and_backward(dtype, tol):
    rms_norm = CPU_OPS.rms_norm

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
    relu_squared, scaled_sum = CPU_OPS.relu_squared, CPU_OPS.scaled_sum

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


def test_attention_heads_fast_and_plain_match_the_textbook_and_rope_is_relative():
    attention_heads = CPU_OPS.attention_heads

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
    compiled, compiled_grads = _grads(stacked(PLAIN_OPS.attention_heads), qkv)
    torch.testing.assert_close(compiled, ref)
    torch.testing.assert_close(compiled_grads, ref_grads)
    x = qkv[:, :, :2]
    torch.testing.assert_close(rotate_real(x, rotary), rotate_pairs_by_hand(x, rotary))
    torch.testing.assert_close(rotate_real(x, rotary).norm(dim=-1), x.norm(dim=-1))  # a rotation

    # the same q and k placed at positions (m, n) and (m + s, n + s): the same score
    q, k = torch.randn(hs, dtype=torch.float64), torch.randn(hs, dtype=torch.float64)
    at = lambda v, pos: attention_heads(v.expand(1, T, 3, 1, hs), rotary)[0][0, 0, pos]  # noqa: E731
    score = lambda m, n: (at(q, m) * at(k, n)).sum()  # noqa: E731
    torch.testing.assert_close(score(3, 1), score(12, 10))
    assert not torch.isclose(score(3, 1), score(3, 2))


def test_the_model_gives_the_same_loss_and_gradients_on_the_fast_and_the_plain_ops():
    """CPU_OPS and PLAIN_OPS (what torch.compile and GPUs see) are one model: same loss,
    same gradients, and the same parameters (a checkpoint moves between them)."""
    torch.manual_seed(0)
    fast = GPT(SHAPE, ops=CPU_OPS).double()
    with torch.no_grad():  # non-trivial output projections and scalars
        for p in fast.parameters():
            p.add_(0.05 * torch.randn_like(p))
    plain = GPT(SHAPE, ops=PLAIN_OPS).double()
    plain.load_state_dict(fast.state_dict())
    idx = torch.randint(0, 256, (2, 16))

    def loss_and_grads(model):
        loss = model(idx, idx)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    fast_loss, fast_grads = loss_and_grads(fast)
    plain_loss, plain_grads = loss_and_grads(plain)
    torch.testing.assert_close(fast_loss, plain_loss)
    torch.testing.assert_close(fast_grads, plain_grads)


def test_training_on_a_cpu_takes_the_fast_ops_unless_compiled():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert cpu_fast.ops_for(cpu, compiled=False) is CPU_OPS
    assert cpu_fast.ops_for(cpu, compiled=True) is PLAIN_OPS
    assert cpu_fast.ops_for(cuda, compiled=False) is PLAIN_OPS
