"""Causal attention: PyTorch's SDPA, with a faster backward pass on CPUs in bf16.

On a CPU, SDPA's flash-attention backward in bf16 takes 2-3x its forward and about a third
of the `small` model's step (BENCHMARKS.md). For the short sequences CPU runs train on,
the same gradients come faster from the textbook formulas: recompute the attention
probabilities P from the log-sum-exp the forward saved, then four more matmuls,

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(dO * O)),
    dQ = dS K * scale,   dK = dS^T Q * scale,

done a few heads and a block of keys at a time, so that each (queries, keys) block of
scores stays in cache, and skipping the blocks above the diagonal that the causal mask
zeroes (a quarter of the work with two blocks), in bf16 throughout, with lse and
rowsum(dO * O) subtracted inside the matmuls (`_heads_backward` says why).

The forward is SDPA's own CPU flash kernel, so outputs are bit-identical to
`F.scaled_dot_product_attention`. Anywhere else (CUDA, fp32, under torch.compile, or with
no gradient to take) `causal_attention` is SDPA itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# bytes of one block of bf16 scores (heads x query rows x keys) in the backward, each of
# the few the block's work holds at once. Measured on a 2-core EPYC (1 MiB of L2 a core, 32
# MiB of L3), a layer of the `small` model: 0.25 MiB 12.9 ms, 0.5 MiB 9.7, 1 MiB 8.4,
# 2 MiB 8.0, 4 MiB 7.8; the gain flattens out, and the blocks' memory grows
BLOCK_BYTES = 2 << 20
SCORE_BYTES = 2  # bf16


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of (B, nh, T, hs) queries, keys and values."""
    if use_cpu_backward(q, k, v):
        return _CausalAttentionCPU.apply(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b) over the last dimension, kept as a size-1 dimension: (..., D) -> (..., 1).

    On CPU a batched (1 x D) @ (D x 1) matmul: it reads a and b once, where vecdot and
    (a * b).sum write the products to memory first. Measured on a 2-core EPYC, fp32,
    (16, 256, 256): 0.32 against 0.63 ms. Elsewhere vecdot: CUDA runs fp32 matmuls in TF32
    (runtime.resolve_device), which would round a and b to 10 bits."""
    if a.device.type == "cpu":
        return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).squeeze(-1)
    return torch.linalg.vecdot(a, b).unsqueeze(-1)


def use_cpu_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # fp32 is not faster this way (18.5 against 19.8 ms a layer, within noise); under
    # compile Inductor takes SDPA as it is
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and not torch.compiler.is_compiling()
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
    v_aug [v, 1, 1], each (n, T, hs + 2); k is k alone. (q * scale is rounded to bf16,
    exactly where scale is a power of 2 as at 64-dim heads; elsewhere it moves each score
    and dK by ~2^-9 / sqrt(hs) of their size, less than their own rounding.)

    Key block j (keys [j rows, (j+1) rows)) meets the query rows from its own first row
    on: P and dS for the block are (T - j rows) x rows, the blocks above the diagonal are
    never computed, and the block's diagonal square is masked after the exp. That makes
    dV and dK of block j one matmul each over every query row that sees it, written
    straight into dv and dk (rounded once), where query blocks would have summed partial
    products in fp32 buffers: only dQ, whose rows meet several key blocks, is summed
    here (in fp32). A layer of the `small` model (2-core EPYC, caches flushed between
    runs, alternating): 7.4-8.1 against 8.4-9.3 ms.

    Everything here is bf16 (torch computes each op in fp32 and rounds once), and a bf16
    matmul's output is rounded relative to its size: scores of up to 8 (QK-norm's bound for
    64-dim heads) rounded before subtracting lse would put ~2% errors into P. So the
    subtractions ride inside the matmuls, on the two extra columns holding -lse and -delta
    as bf16 hi + lo pairs against columns of ones: the products come out as (s - lse) and
    (dP - delta), rounded relative to those, which are near 0 exactly where P is large
    and where dP and delta cancel. The gradients' error is then about that of SDPA's own
    bf16 backward (1.1x at 64-dim heads; tests/test_attention.py). Each elementwise pass in
    fp32 instead cost ~0.4 ms a layer of the `small` model: 11 against 8.5 ms."""
    T, D = k.shape[-2:]
    scale = 1.0 / math.sqrt(D)
    rows = T // n_blocks
    q_scaled, grad_out = q_aug[..., :D], grad_aug[..., :D]
    dq_sum = None  # fp32
    for j in range(n_blocks):
        k0, k1 = j * rows, (j + 1) * rows
        # 1) P recomputed: exp(scale * q.k - lse)                      (n, T - k0, rows)
        p = torch.matmul(q_aug[:, k0:], k_aug[:, k0:k1].transpose(-1, -2)).exp_()
        # the diagonal square's future keys zeroed (tril_ is 20x faster than a masked fill
        # here, and exp(-inf) is slow on CPU)
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
