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
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


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


# an explicit epsilon: F.rms_norm's default on bf16 is bf16's machine epsilon (0.0078), which
# blunts QK-norm
RMS_NORM_EPS = 1e-6


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm (no gain to tune, nothing for weight decay to touch), computed
    in (at least) fp32."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
    return F.rms_norm(xf, (x.size(-1),), eps=RMS_NORM_EPS).to(x.dtype)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def scaled_sum(a: torch.Tensor, x: torch.Tensor, b: torch.Tensor, y: torch.Tensor):
    """a * x + b * y for scalar parameters a and b."""
    return a * x + b * y


def rotary_table(seq_len: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """RoPE rotations as (cos, sin) of position * frequency: (T, 1, 1, head_dim/2, 2).
    Real, not complex, so a compiled graph and DDP's buffer broadcast never meet a complex
    tensor; `torch.view_as_complex` reads it as e^(i * angle) without a copy."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[:, None, None]


def rotate_real(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """RoPE on (..., T, nh, hs): each head's dimensions rotate in adjacent pairs (2i, 2i+1),
    (a, b) -> (a cos - b sin, a sin + b cos), written as x * (cos, cos) + (b, a) * (-sin,
    sin) with the pair swapped by a flip: one pointwise kernel each way under Inductor
    (splitting the pairs and stacking them back made a `cat` kernel; BENCHMARKS.md). Which
    dimensions pair up is only a relabelling of the q/k projection's rows."""
    cos, sin = rotary.unbind(-1)
    cos2 = torch.stack([cos, cos], dim=-1).flatten(-2)
    sin2 = torch.stack([-sin, sin], dim=-1).flatten(-2)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos2 + swapped * sin2


def attention_heads(
    qkv: torch.Tensor, rotary: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as (B, nh, T, hs) from the projections qkv (B, T, 3, nh, hs): RoPE, then
    QK-norm, on queries and keys. QK-norm keeps attention logits bounded at any LR."""
    qk, v = qkv.split([2, 1], dim=2)  # split, not indexing: one pass for its backward
    x = qk.to(torch.promote_types(qk.dtype, torch.float32))
    q, k = rms_norm(rotate_real(x, rotary)).to(qk.dtype).unbind(2)  # (B, T, nh, hs)
    return q.transpose(1, 2), k.transpose(1, 2), v.squeeze(2).transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of (B, nh, T, hs) queries, keys and values."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): logits bounded in (-cap, cap); 0 means no cap."""
    return cap * torch.tanh(logits / cap) if cap else logits


class Ops(NamedTuple):
    """The elementwise and attention ops the model is built from. PLAIN_OPS are torch's
    own; `cpu_fast.CPU_OPS` computes the same maths faster on a CPU in eager mode."""

    rms_norm: Callable = rms_norm
    relu_squared: Callable = relu_squared
    scaled_sum: Callable = scaled_sum
    attention_heads: Callable = attention_heads
    attention: Callable = causal_attention
    soft_cap: Callable = soft_cap


PLAIN_OPS = Ops()


def capped_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    cap: float,
    reduction: str = "mean",
    cap_fn: Callable = soft_cap,
) -> torch.Tensor:
    """Cross-entropy (nats) of the soft-capped logits: (B, T, vocab) against (B, T)."""
    capped = cap_fn(logits, cap)
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
    def __init__(self, shape: GPTShape, ops: Ops):
        super().__init__()
        self.n_heads, self.head_dim, self.ops = shape.n_heads, shape.head_dim, ops
        self.c_q = nn.Linear(shape.d_model, shape.d_model, bias=False)
        self.c_k = nn.Linear(shape.d_model, shape.d_model, bias=False)
        self.c_v = nn.Linear(shape.d_model, shape.d_model, bias=False)
        self.c_proj = nn.Linear(shape.d_model, shape.d_model, bias=False)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # one matmul for q, k, v (faster than three on CPU); the weights stay three
        # matrices, so Muon orthogonalises each on its own
        w_qkv = torch.cat([self.c_q.weight, self.c_k.weight, self.c_v.weight])
        qkv = F.linear(x, w_qkv).view(B, T, 3, self.n_heads, self.head_dim)
        q, k, v = self.ops.attention_heads(qkv, rotary)  # (B, nh, T, hs); q, k rotated, normed
        y = self.ops.attention(q, k, v)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, shape: GPTShape, ops: Ops):
        super().__init__()
        self.c_fc = nn.Linear(shape.d_model, 4 * shape.d_model, bias=False)
        self.c_proj = nn.Linear(4 * shape.d_model, shape.d_model, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.ops.relu_squared(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, shape: GPTShape, ops: Ops):
        super().__init__()
        self.attn = CausalSelfAttention(shape, ops)
        self.mlp = MLP(shape, ops)
        self.ops = ops

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ops.rms_norm(x), rotary)
        return x + self.mlp(self.ops.rms_norm(x))


class GPT(nn.Module):
    def __init__(
        self,
        shape: GPTShape,
        residual_dtype: torch.dtype | None = None,
        ops: Ops = PLAIN_OPS,
    ):
        """residual_dtype: the dtype the residual stream travels in between the blocks; None
        keeps the embedding's fp32 (see `residual_dtype_for`). A model given one runs under
        autocast of that dtype (as train() and evaluate() run it): outside autocast its fp32
        weights would meet bf16 activations. ops: torch's own (PLAIN_OPS), or faster forms
        of the same maths (`cpu_fast.ops_for`)."""
        super().__init__()
        self.shape = shape
        self.residual_dtype = residual_dtype
        self.ops = ops
        self.wte = nn.Embedding(shape.vocab_size, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape, ops) for _ in range(shape.depth))
        self.lm_head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
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
        ops = self.ops
        x = x0 = ops.rms_norm(self.wte(idx))  # (B, T, C)
        if self.residual_dtype is not None:
            x = x0 = x.to(self.residual_dtype)
        for i, block in enumerate(self.blocks):
            x = ops.scaled_sum(self.resid_lambdas[i], x, self.x0_lambdas[i], x0)
            x = block(x, rotary)
        logits = self.lm_head(ops.rms_norm(x)).float()  # the loss is computed in fp32
        if targets is None:
            return ops.soft_cap(logits, self.shape.softcap)
        return capped_cross_entropy(logits, targets, self.shape.softcap, reduction, ops.soft_cap)

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
