"""A modern GPT in the nanochat style.

RoPE positions, parameter-free RMSNorm (also on queries and keys), ReLU^2 MLP, untied
embedding and unembedding, a tanh soft-cap on the logits, zero-initialised output
projections (every block starts as the identity), per-layer residual scalars, and a width
that follows the depth; on a GPU the residual stream travels in bf16 (`residual_dtype_for`).
The parameter and FLOP accounting used by MFU and the scaling fits lives here too, next to
the shapes it counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from sweeper.train.attention import causal_attention, row_dot
from sweeper.train.linear import Linear, linear


@dataclass(frozen=True)
class GPTShape:
    depth: int
    d_model: int
    head_dim: int
    seq_len: int
    vocab_size: int
    softcap: float = 15.0

    @property
    def n_heads(self) -> int:
        return self.d_model // self.head_dim

    @property
    def n_params(self) -> int:
        """Total parameters, counted from the shape without building the model (a model
        too big to build can still be counted): embedding and unembedding, 12 d^2 per block
        (q, k, v, output; the 4x MLP), two scalars per layer. GPT.param_counts agrees."""
        d = self.d_model
        return 2 * self.vocab_size * d + self.depth * (12 * d * d + 2)

    @property
    def n_matmul_params(self) -> int:
        """The N of 6N, from the shape: the hidden matrices and the output head."""
        d = self.d_model
        return self.depth * 12 * d * d + self.vocab_size * d

    @property
    def flops_per_token(self) -> int:
        """GPT.flops_per_token from the shape alone. A sweep's driver weighs every trial by
        its planned FLOPs, and a model built on the meta device to count them took it 2-4 s
        (torch loading its meta kernels) at each stage's start."""
        return 6 * self.n_matmul_params + 12 * self.depth * self.d_model * self.seq_len

    @classmethod
    def from_config(cls, model) -> GPTShape:
        """From a validated `ModelConfig` (vocab_size already resolved)."""
        return cls(
            model.depth, model.width, model.head_dim, model.seq_len, model.vocab_size, model.softcap
        )


# --- elementwise pieces with hand-written backward passes ----------------------------------
# On CPU every elementwise pass over the activations is a trip through memory, and
# autograd's generic backward formulas take several. The autograd.Functions below compute
# the same maths in fewer passes (each is tested against the plain ops, values and
# gradients). Under torch.compile the plain ops are used instead: Inductor fuses those
# with their neighbours, which it cannot do across a custom autograd.Function.


# an explicit epsilon: F.rms_norm's default on bf16 is bf16's machine epsilon (0.0078), which
# blunts QK-norm. A module constant, not a class attribute: torch.compile (Dynamo) breaks the
# graph at a class attribute of an autograd.Function, measured as half the d12 MFU on an H100.
RMS_NORM_EPS = 1e-6


class _RMSNorm(torch.autograd.Function):
    """Parameter-free RMSNorm, computed in (at least) fp32: 2 passes forward, 4 backward.
    torch 2.13 has no fused CPU kernel for F.rms_norm; its composite takes about ten
    passes and is 2x slower here."""

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


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    # parameter-free: no gain to tune, nothing for weight decay to touch
    if torch.compiler.is_compiling():
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS)).to(x.dtype)
    return _RMSNorm.apply(x)


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
        # (mul then mul_(2) is two: 0.54 against 0.35 ms on the `small` model's MLP)
        return torch.addcmul(grad.new_zeros(()), grad, r, value=2)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return F.relu(x).square()
    return _ReLUSquared.apply(x)


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


def scaled_sum(a: torch.Tensor, x: torch.Tensor, b: torch.Tensor, y: torch.Tensor):
    if torch.compiler.is_compiling():
        return a * x + b * y
    return _ScaledSum.apply(a, x, b, y)


def rotary_table(seq_len: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """RoPE rotations as (cos, sin) of position * frequency: (T, 1, 1, head_dim/2, 2).
    Real, not complex, so a compiled graph and DDP's buffer broadcast never meet a complex
    tensor; `torch.view_as_complex` reads it as e^(i * angle) without a copy."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[:, None, None]


def attention_heads(
    qkv: torch.Tensor, rotary: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as (B, nh, T, hs) from the projections qkv (B, T, 3, nh, hs): RoPE, then
    QK-norm, on queries and keys. QK-norm keeps attention logits bounded at any LR.

    Each head's dimensions rotate in adjacent pairs (2i, 2i+1), read as one complex number,
    so the rotation is a single complex multiply (one pass, where the rotate-half form takes
    seven each way). Which dimensions pair up is only a relabelling of the q/k projection's
    rows: the model family is the same. Eagerly, `_AttentionHeads` does it all in one
    autograd.Function; under torch.compile the plain ops below, for Inductor to fuse.
    """
    if not torch.compiler.is_compiling():
        return _AttentionHeads.apply(qkv, rotary[:, 0, 0])  # rotary (T, hs/2, 2)
    qk, v = qkv.split([2, 1], dim=2)  # split, not indexing: one pass for its backward
    q, k = rotate_and_normalise(qk, rotary).unbind(2)  # (B, T, nh, hs)
    return q.transpose(1, 2), k.transpose(1, 2), v.squeeze(2).transpose(1, 2)


def rotate_and_normalise(qk: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """RoPE, then QK-norm, on queries and keys together (qk: (B, T, 2, nh, hs)) in plain
    real-arithmetic ops: the form torch.compile sees (Inductor has no complex kernels)."""
    x = qk.to(torch.promote_types(qk.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
    return rms_norm(rotate_real(x, rotary)).to(qk.dtype)


class _AttentionHeads(torch.autograd.Function):
    """`attention_heads` eagerly: 4 passes over q and k forward and 5 backward, where the
    same ops through autograd take 5 and 9, and the attention then copied its transposed
    heads. The outputs come out contiguous in the (B, nh, T, hs) layout attention reads,
    and the backward writes the projections' gradient in one buffer (no `cat` of q/k's
    and v's). Measured on a layer of the `small` model (2-core EPYC, bf16), forward and
    backward: 5.0 against 7.4 ms, and 22.2 against 24.4 with the attention after it.
    Computed in (at least) fp32, like rms_norm."""

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


def rotate_real(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """The complex multiply in real arithmetic: (a, b) -> (a cos - b sin, a sin + b cos) as
    x * (cos, cos) + (b, a) * (-sin, sin), the pair swapped by a flip. Inductor makes one
    pointwise kernel of it each way; splitting the pairs and stacking the results back made
    a `cat` kernel, and the d12 step on an H100 was 1.3% slower (BENCHMARKS.md)."""
    cos, sin = rotary.unbind(-1)
    cos2 = torch.stack([cos, cos], dim=-1).flatten(-2)
    sin2 = torch.stack([-sin, sin], dim=-1).flatten(-2)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos2 + swapped * sin2


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): logits bounded in (-cap, cap); 0 means no cap."""
    if not cap:
        return logits
    if logits.device.type == "cpu" and not torch.compiler.is_compiling():
        # tanh(z) = 2 sigmoid(2z) - 1: torch's CPU tanh is 7x slower than its sigmoid (1.14
        # against 0.16 ms on the `small` model's logits); the capped loss's forward and
        # backward took 3.6 ms a micro-batch with tanh and 2.4 with this. The two agree
        # to ~1e-6 on logits of size 15, far inside the bf16 matmul's rounding before them.
        return torch.sigmoid(logits * (2 / cap)) * (2 * cap) - cap
    return cap * torch.tanh(logits / cap)


def capped_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, cap: float, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy (nats) of the soft-capped logits: (B, T, vocab) against (B, T)."""
    capped = soft_cap(logits, cap)
    return F.cross_entropy(
        capped.view(-1, capped.size(-1)), targets.reshape(-1), reduction=reduction
    )


def residual_dtype_for(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The residual stream's dtype for training on `device` in autocast `dtype`.

    Autocast runs the matmuls in bf16 but leaves the embedding's output in fp32, and with it
    the whole residual stream: every norm, residual add and saved activation between the
    matmuls moves 4 bytes a value. On a GPU, where those elementwise kernels are a quarter
    of a d12 step and bound by memory traffic, the stream is carried in bf16 instead, as
    nanochat does (its embedding table is cast to bf16 on CUDA). Norms still compute in
    fp32 and the loss stays fp32. CPUs keep fp32: there the measured figures, tests and
    sweeps of this project were made with it. Only bf16: an fp16 stream could overflow."""
    return torch.bfloat16 if device.type == "cuda" and dtype == torch.bfloat16 else None


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: GPTShape):
        super().__init__()
        self.n_heads, self.head_dim = shape.n_heads, shape.head_dim
        self.c_q = Linear(shape.d_model, shape.d_model)
        self.c_k = Linear(shape.d_model, shape.d_model)
        self.c_v = Linear(shape.d_model, shape.d_model)
        self.c_proj = Linear(shape.d_model, shape.d_model)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # one matmul for q, k, v (faster than three on CPU); the weights stay three
        # matrices, so Muon orthogonalises each on its own
        w_qkv = torch.cat([self.c_q.weight, self.c_k.weight, self.c_v.weight])
        qkv = linear(x, w_qkv).view(B, T, 3, self.n_heads, self.head_dim)
        q, k, v = attention_heads(qkv, rotary)  # (B, nh, T, hs); q, k rotated and normed
        y = causal_attention(q, k, v)  # SDPA; on CPU in bf16 a faster backward
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, shape: GPTShape):
        super().__init__()
        self.c_fc = Linear(shape.d_model, 4 * shape.d_model)
        self.c_proj = Linear(4 * shape.d_model, shape.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(relu_squared(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, shape: GPTShape):
        super().__init__()
        self.attn = CausalSelfAttention(shape)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(rms_norm(x), rotary)
        return x + self.mlp(rms_norm(x))


class GPT(nn.Module):
    def __init__(self, shape: GPTShape, residual_dtype: torch.dtype | None = None):
        """residual_dtype: the dtype the residual stream travels in between the blocks; None
        keeps the embedding's fp32 (see `residual_dtype_for`). A model given one runs under
        autocast of that dtype (as train() and evaluate() run it): outside autocast its fp32
        weights would meet bf16 activations."""
        super().__init__()
        self.shape = shape
        self.residual_dtype = residual_dtype
        self.wte = nn.Embedding(shape.vocab_size, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.depth))
        self.lm_head = Linear(shape.d_model, shape.vocab_size)
        # per-layer scalars: x <- resid * x + x0_mix * x0 before each block (modded-nanogpt);
        # they let a layer re-read the token embedding and rescale the residual stream
        self.resid_lambdas = nn.Parameter(torch.ones(shape.depth))
        self.x0_lambdas = nn.Parameter(torch.zeros(shape.depth))
        self.register_buffer(
            "rotary", rotary_table(shape.seq_len, shape.head_dim), persistent=False
        )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        d = self.shape.d_model
        nn.init.normal_(self.wte.weight, std=1.0)
        # a near-zero head makes the initial prediction uniform: loss starts at ln(vocab)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        bound = math.sqrt(3.0 / d)  # uniform with std 1/sqrt(fan_in)
        for block in self.blocks:
            for layer in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.uniform_(layer.weight, -bound, bound)
            # zero output projections: each block starts as the identity
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
        self.resid_lambdas.fill_(1.0)
        self.x0_lambdas.fill_(0.0)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """idx: (B, T) token ids. Returns the cross-entropy loss (nats) if targets are
        given, else the soft-capped logits (B, T, vocab)."""
        T = idx.size(1)
        rotary = self.rotary[:T]
        x = x0 = rms_norm(self.wte(idx))  # (B, T, C)
        if self.residual_dtype is not None:
            x = x0 = x.to(self.residual_dtype)
        for i, block in enumerate(self.blocks):
            x = scaled_sum(self.resid_lambdas[i], x, self.x0_lambdas[i], x0)
            x = block(x, rotary)
        logits = self.lm_head(rms_norm(x)).float()  # the loss is computed in fp32
        if targets is None:
            return soft_cap(logits, self.shape.softcap)
        return capped_cross_entropy(logits, targets, self.shape.softcap, reduction)

    # --- accounting -------------------------------------------------------------------
    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Every parameter in exactly one group, by role (the optimizers' split)."""
        matrices = [p for block in self.blocks for p in block.parameters()]
        return {
            "matrix": matrices,  # 2-D hidden matrices: Muon
            "embedding": [self.wte.weight],
            "unembedding": [self.lm_head.weight],
            "scalar": [self.resid_lambdas, self.x0_lambdas],
        }

    def param_counts(self) -> dict[str, int]:
        """total; embedding (wte); non_embedding = total - embedding; matmul = every weight
        that is multiplied against activations (hidden matrices + lm_head), the N of 6N."""
        count = lambda ps: sum(p.numel() for p in ps)
        groups = self.param_groups()
        total = count(self.parameters())
        return {
            "total": total,
            "embedding": count(groups["embedding"]),
            "non_embedding": total - count(groups["embedding"]),
            "matmul": count(groups["matrix"]) + count(groups["unembedding"]),
        }

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 * matmul params (forward 2, backward 4) plus attention's
        QK^T and AV, 12 * layers * d_model * seq_len (PaLM's convention: the causal half is
        not subtracted). The embedding lookup and the scalars do no matmul."""
        s = self.shape
        return 6 * self.param_counts()["matmul"] + 12 * s.depth * s.d_model * s.seq_len
