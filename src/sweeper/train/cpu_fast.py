"""CPU fast paths: faster forms of the model's ops for eager training on a CPU
(`ops_for(device, ...)`), and the allocator setting that keeps a step's memory for the next.

On a CPU every elementwise pass over the activations is a trip through memory, and
autograd's generic backward formulas take several. The autograd.Functions here compute the
same maths as `model.PLAIN_OPS` in fewer passes, and attention in bf16 gets a backward pass
faster than SDPA's for the short sequences CPU runs train on. Each is tested against the
plain op (values and gradients); together they are what makes the CPU step faster than a
plain PyTorch GPT's (bench/bench_train.py; BENCHMARKS.md). The model does not need this
module: on a GPU, and under torch.compile (Inductor fuses the plain ops with their
neighbours, which it cannot do across a custom autograd.Function), it runs PLAIN_OPS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math

import torch
import torch.nn.functional as F

from sweeper.train.model import PLAIN_OPS, RMS_NORM_EPS, Ops


def ops_for(device: torch.device, compiled: bool) -> Ops:
    """CPU_OPS for eager training on a CPU, else torch's own ops."""
    return CPU_OPS if device.type == "cpu" and not compiled else PLAIN_OPS


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b) over the last dimension, kept as a size-1 dimension: (..., D) -> (..., 1),
    as a batched (1 x D) @ (D x 1) matmul: it reads a and b once, where vecdot and
    (a * b).sum write the products to memory first."""
    return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).squeeze(-1)


# --- elementwise ops ------------------------------------------------------------------------


class _RMSNorm(torch.autograd.Function):
    """Parameter-free RMSNorm in (at least) fp32: 2 passes forward, 4 backward. torch has no
    fused CPU kernel for F.rms_norm; its composite takes about ten passes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
        norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)  # one pass, no x^2 temp
        r = torch.rsqrt(norm.square_().div_(x.size(-1)).add_(RMS_NORM_EPS))
        y = xf * r
        ctx.save_for_backward(y, r)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # y = x * r, r = mean(x^2)^-1/2  =>  dx = r * (g - y * mean(g * y))
        y, r = ctx.saved_tensors
        g = grad.to(y.dtype)
        mean_gy = row_dot(g, y).div_(y.size(-1))
        return torch.addcmul(g, y, mean_gy, value=-1).mul_(r).to(grad.dtype)


class _ReLUSquared(torch.autograd.Function):
    """relu(x)^2: 2 passes forward, 1 backward (autograd's relu then multiply take 4)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        r = torch.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (r,) = ctx.saved_tensors
        # d relu(x)^2 / dx = 2 relu(x); addcmul onto a broadcast 0 scales in the same pass
        return torch.addcmul(grad.new_zeros(()), grad, r, value=2)


class _ScaledSum(torch.autograd.Function):
    """a * x + b * y for scalar parameters a and b. Their gradients are dot products, one
    pass each with no temporary; autograd multiplies and then sums, two passes and a
    full-size temporary each. When x is y (the first layer, where the stream is still the
    embedding x0) it is (a + b) * x: one pass forward, one dot and one pass backward."""

    @staticmethod
    def forward(ctx, a, x, b, y):
        ctx.save_for_backward(a, x, b, y)
        ctx.same = x is y
        if ctx.same:
            return x * (a + b)
        return torch.addcmul(y * b, x, a)

    @staticmethod
    def backward(ctx, grad):
        a, x, b, y = ctx.saved_tensors
        g = grad.reshape(-1)
        grad_a = torch.dot(g, x.reshape(-1).to(g.dtype)).to(a.dtype)
        if ctx.same:  # x's gradient carries y's: autograd would add them, another pass
            return grad_a, (grad * (a + b)).to(x.dtype), grad_a.to(b.dtype), None
        grad_b = torch.dot(g, y.reshape(-1).to(g.dtype)).to(b.dtype)
        return grad_a, (grad * a).to(x.dtype), grad_b, (grad * b).to(y.dtype)


class _AttentionHeads(torch.autograd.Function):
    """`model.attention_heads` (RoPE, then QK-norm) in 4 passes over q and k forward and 5
    backward, where the plain ops through autograd take 5 and 9. Each head's dimension
    pairs are read as complex numbers, so the rotation is one complex multiply. The outputs
    come out contiguous in the (B, nh, T, hs) layout attention reads, and the backward
    writes the projections' gradient in one buffer (no `cat` of q/k's and v's)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, rotary: torch.Tensor):
        B, T, _, H, D = qkv.shape
        work = torch.promote_types(qkv.dtype, torch.float32)
        # rotated queries and keys, (2, B, nh, T, hs): the cast and the re-layout, one pass
        rotated = torch.empty(2, B, H, T, D, dtype=work, device=qkv.device)
        rotated.copy_(qkv[:, :, :2].permute(2, 0, 3, 1, 4))
        rotation = torch.view_as_complex(rotary.to(work))  # (T, hs/2)
        torch.view_as_complex(rotated.unflatten(-1, (-1, 2))).mul_(rotation)
        norm = torch.linalg.vector_norm(rotated, dim=-1, keepdim=True)
        r = torch.rsqrt(norm.square_().div_(D).add_(RMS_NORM_EPS))
        qk = torch.empty(2, B, H, T, D, dtype=qkv.dtype, device=qkv.device)
        torch.mul(rotated, r, out=qk)  # normalised and cast back, one pass
        ctx.save_for_backward(rotated, r, rotation)
        ctx.qkv_dtype = qkv.dtype
        return qk[0], qk[1], qkv[:, :, 2].transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        rotated, r, rotation = ctx.saved_tensors
        _, B, H, T, D = rotated.shape
        # RMSNorm's backward, y = x r with r = mean(x^2)^-1/2 (x: the rotated heads):
        # dx = r g - x r^2 mean(r g . x); r g is written first, cast in the same pass
        # (autograd hands an unused output's gradient over as zeros, never None)
        grad = torch.empty_like(rotated)
        torch.mul(grad_q, r[0], out=grad[0])
        torch.mul(grad_k, r[1], out=grad[1])
        coef = row_dot(grad, rotated).mul_(r.square()).div_(D)
        grad.addcmul_(rotated, coef, value=-1)
        # the rotation's backward: the opposite rotation
        torch.view_as_complex(grad.unflatten(-1, (-1, 2))).mul_(rotation.conj())
        grad_qkv = torch.empty(B, T, 3, H, D, dtype=ctx.qkv_dtype, device=rotated.device)
        grad_qkv[:, :, :2] = grad.permute(1, 3, 0, 2, 4)  # back to the projections' layout
        grad_qkv[:, :, 2] = grad_v.transpose(1, 2)
        return grad_qkv, None


def attention_heads(qkv: torch.Tensor, rotary: torch.Tensor):
    return _AttentionHeads.apply(qkv, rotary[:, 0, 0])  # rotary (T, hs/2, 2)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap) as 2 cap sigmoid(2 logits / cap) - cap: torch's CPU tanh is
    several times slower than its sigmoid. The two agree to ~1e-6 on logits of size 15, far
    inside the bf16 matmul's rounding before them."""
    if not cap:
        return logits
    return torch.sigmoid(logits * (2 / cap)) * (2 * cap) - cap


# --- attention: SDPA's forward, a faster backward in bf16 --------------------------------
# SDPA's flash-attention backward in bf16 on a CPU takes 2-3x its forward. For short
# sequences the same gradients come faster from the textbook formulas: recompute the
# probabilities P from the log-sum-exp the forward saved, then four more matmuls,
#     dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(dO * O)),
#     dQ = dS K * scale,   dK = dS^T Q * scale,
# a few heads and a block of keys at a time, so that each block of scores stays in cache,
# skipping the blocks above the diagonal that the causal mask zeroes. The forward is SDPA's
# own CPU flash kernel: outputs are bit-identical to F.scaled_dot_product_attention.

# bytes of one block of bf16 scores (heads x query rows x keys) in the backward: the gain
# flattens out around here as the block grows, while its memory keeps growing
BLOCK_BYTES = 2 << 20
SCORE_BYTES = 2  # bf16


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of (B, nh, T, hs) queries, keys and values."""
    if use_cpu_backward(q, k, v):
        return _CausalAttentionCPU.apply(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def use_cpu_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # bf16 only: in fp32 this way is not faster
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and q.shape == k.shape == v.shape
    )


def backward_blocks(n_heads: int, seq_len: int) -> tuple[int, int]:
    """(heads per block, blocks of T) for the backward: two blocks where T is even (the
    diagonal's upper half is skipped), more while the largest block of one head's scores
    (T x the block's size) exceeds BLOCK_BYTES; as many heads as then fit in BLOCK_BYTES."""
    n_blocks = 2 if seq_len % 2 == 0 else 1
    while (seq_len // n_blocks) * seq_len * SCORE_BYTES > BLOCK_BYTES and (
        seq_len % (2 * n_blocks) == 0
    ):
        n_blocks *= 2
    rows = seq_len // n_blocks
    heads = max(1, min(n_heads, BLOCK_BYTES // (rows * seq_len * SCORE_BYTES)))
    return heads, n_blocks


class _CausalAttentionCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True
        )  # out (B, nh, T, hs); lse (B, nh, T) fp32, the log of each row's softmax sum
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, T, D = q.shape
        scale = 1.0 / math.sqrt(D)
        # rowsum(dO * O), the softmax's correction term: (B, nh, T, 1), fp32
        delta = row_dot(grad_out.float(), out.float())
        # the matmuls' operands for every head at once, (B*H, T, hs + 2), each one pass
        # (grad_out arrives as a transposed view; this is also its one copy)
        flat = lambda t: t.view(B * H, T, D + 2)
        q_aug = flat(_with_columns(q, [*_split_bf16(-lse.unsqueeze(-1))], scale))
        k_aug = flat(_with_columns(k, [1.0, 1.0]))
        grad_aug = flat(_with_columns(grad_out, [*_split_bf16(-delta)]))
        v_aug = flat(_with_columns(v, [1.0, 1.0]))
        k = k.reshape(B * H, T, D)
        dq, dk, dv = (q.new_empty(B * H, T, D) for _ in range(3))
        heads, n_blocks = backward_blocks(B * H, T)
        for h in range(0, B * H, heads):
            s = slice(h, h + heads)
            _heads_backward(
                q_aug[s], k_aug[s], grad_aug[s], v_aug[s], k[s], n_blocks, dq[s], dk[s], dv[s]
            )
        shape = (B, H, T, D)
        return dq.view(shape), dk.view(shape), dv.view(shape)


def _with_columns(
    x: torch.Tensor, columns: list[torch.Tensor | float], scale: float | None = None
) -> torch.Tensor:
    """x (..., T, D) bf16 (any strides), times scale if given, with columns appended
    (tensors (..., T, 1) or constants), in a new contiguous (..., T, D + len(columns)):
    the operand of an augmented matmul."""
    D = x.size(-1)
    out = x.new_empty(*x.shape[:-1], D + len(columns))
    if scale is None:
        out[..., :D] = x
    else:
        torch.mul(x, scale, out=out[..., :D])  # scaled and copied in one pass
    for j, column in enumerate(columns):
        out[..., D + j : D + j + 1] = column
    return out


def _split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x as hi + lo, two bf16 tensors whose sum carries ~16 bits of x's mantissa."""
    hi = x.to(torch.bfloat16)
    return hi, (x - hi.float()).to(torch.bfloat16)


def _heads_backward(q_aug, k_aug, grad_aug, v_aug, k, n_blocks: int, dq, dk, dv) -> None:
    """The gradients for a few heads, written into dq, dk, dv (n, T, hs) bf16. q_aug is
    [q * scale, -lse as bf16 hi + lo], k_aug [k, 1, 1], grad_aug [dO, -delta as hi + lo],
    v_aug [v, 1, 1], each (n, T, hs + 2); k is k alone.

    Key block j meets the query rows from its own first row on: the blocks above the
    diagonal are never computed, and the block's diagonal square is masked after the exp.
    dV and dK of block j are then one matmul each, written straight into dv and dk; only
    dQ, whose rows meet several key blocks, is summed (in fp32).

    Everything is bf16, and a bf16 matmul's output is rounded relative to its size: scores
    rounded before subtracting lse would put ~2% errors into P. So the subtractions ride
    inside the matmuls, on the two extra columns holding -lse and -delta as bf16 hi + lo
    pairs against columns of ones: the products come out as (s - lse) and (dP - delta),
    rounded relative to those. The gradients' error is then about that of SDPA's own bf16
    backward (tests/test_attention.py)."""
    T, D = k.shape[-2:]
    scale = 1.0 / math.sqrt(D)
    rows = T // n_blocks
    q_scaled, grad_out = q_aug[..., :D], grad_aug[..., :D]
    dq_sum = None  # fp32
    for j in range(n_blocks):
        k0, k1 = j * rows, (j + 1) * rows
        # 1) P recomputed: exp(scale * q.k - lse)                      (n, T - k0, rows)
        p = torch.matmul(q_aug[:, k0:], k_aug[:, k0:k1].transpose(-1, -2)).exp_()
        # the diagonal square's future keys zeroed (tril_ is much faster than a masked
        # fill here, and exp(-inf) is slow on CPU)
        p[:, :rows].tril_()
        # 2) dV = P^T dO
        torch.matmul(p.transpose(-1, -2), grad_out[:, k0:], out=dv[:, k0:k1])
        # 3) dS = P * (dO V^T - delta)
        ds = torch.matmul(grad_aug[:, k0:], v_aug[:, k0:k1].transpose(-1, -2)).mul_(p)
        # 4) dK = dS^T (Q * scale);  dQ += dS K (* scale, below)
        torch.matmul(ds.transpose(-1, -2), q_scaled[:, k0:], out=dk[:, k0:k1])
        part = torch.matmul(ds, k[:, k0:k1])
        if dq_sum is None:
            dq_sum = part.float()  # block 0 reaches every query row
        else:
            dq_sum[:, k0:] += part
    torch.mul(dq_sum, scale, out=dq)  # scaled and cast in one pass


CPU_OPS = Ops(
    rms_norm=_RMSNorm.apply,
    relu_squared=_ReLUSquared.apply,
    scaled_sum=_ScaledSum.apply,
    attention_heads=attention_heads,
    attention=causal_attention,
    soft_cap=soft_cap,
)


# --- the allocator ----------------------------------------------------------------------


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def keep_freed_memory_for_reuse() -> bool:
    """Stop glibc's malloc from giving freed activations back to the kernel between steps.

    PyTorch's CPU allocator is plain malloc. By default glibc serves large blocks with
    mmap and trims the heap top as soon as it is free, so every training step faults its
    activations' pages in again: measured 25,000 page faults and ~10% of a step for the
    `small` model on 2 cores. A fixed mmap threshold at glibc's 64-bit maximum (32 MiB) and
    a 1 GiB trim threshold keep that memory in the process for the next step; the cost is
    that a run's memory stays at its peak until release_freed_memory(). PyTorch's CPU-tuning
    guide gets the same effect by preloading jemalloc or tcmalloc, which this needs no
    system package for. A no-op (False) where the C library has no mallopt (musl, macOS,
    Windows).
    """
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's <malloc.h>
    return bool(mallopt(m_trim_threshold, 1 << 30) and mallopt(m_mmap_threshold, 32 << 20))


def release_freed_memory() -> None:
    """Hand back to the kernel what earlier runs in this process freed: glibc's malloc_trim
    over every arena, after a collection of the runs' garbage cycles.

    Why: each thread allocates from its own malloc arena, and Tune runs every trial of a
    reused worker in a new thread. With the trim threshold above, each arena keeps its
    trial's peak: four `small` runs in new threads grew a process from 0.94 to 1.43 GB
    without this, and stay at 0.87-0.89 GB with it. A larger peak multiplies that: when an
    evaluation briefly kept its autograd graph (3.5 GB peaks), lr_bs's workers reached
    11-15 GB and Ray's memory monitor killed one. Costs 0.12-0.17 s at a run's start
    (mostly the collection): under 0.5% of a 30-100 s CPU trial. No-op without glibc.
    """
    import gc

    gc.collect()
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)
