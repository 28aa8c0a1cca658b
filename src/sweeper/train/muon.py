"""torch.optim.Muon, with the Newton-Schulz step in a precision the machine is fast at.

torch.optim.Muon always runs its Newton-Schulz orthogonalisation in bf16, which CPUs without
fast bf16 matmuls (device.cpu_bf16_is_fast) emulate at ~3x fp32's time, and it has no option
for this. So `Muon.step` redoes its ~20 lines (same state, hyperparameters and `state_dict`)
with three changes: the iteration runs in `ns_dtype`; matrices of one shape go through it as
one batched matmul (as in modded-nanogpt); and in fp32 non-square matrices take a Gram form
of the iteration, about half the FLOPs for the MLP's 1 x 4 matrices (`_gram_newton_schulz`).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch


def newton_schulz(
    grads: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Orthogonalise a batch of matrices (..., rows, cols) by the quintic Newton-Schulz
    iteration of Keller Jordan's Muon (what torch.optim.Muon computes), in grads' dtype.

    Outside bf16 (fp32, fp64), non-square matrices take the Gram form below on their wide
    side, the same polynomial in fewer FLOPs; bf16 keeps the textbook form, whose errors
    do not build up."""
    if grads.dim() == 2:
        return newton_schulz(grads[None], coefficients, steps, eps)[0]
    tall = grads.size(-2) > grads.size(-1)
    x = grads.mT if tall else grads  # iterate on the wide side
    # scale each matrix so its spectral norm is at most 1 (Frobenius >= spectral)
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    if x.dtype != torch.bfloat16 and x.size(-1) > x.size(-2):
        x = _gram_newton_schulz(x, coefficients, steps)
    else:
        a, b, c = coefficients
        for _ in range(steps):
            gram = x @ x.mT
            update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if tall else x


def _gram_newton_schulz(
    x: torch.Tensor, coefficients: tuple[float, float, float], steps: int
) -> torch.Tensor:
    """The quintic iteration for x of shape (..., m, n), m < n, on m x m matrices only.

    Each step multiplies x on the left by p(A) = a I + b A + c A^2, where A = x x^T. So
    after k steps x_k = Q_k x_0, and every Q_k and A_k is a polynomial in G = x_0 x_0^T:
    they commute, and A_{k+1} = P_k A_k P_k. Working on m x m matrices and applying Q to
    x_0 once costs 4 m^2 n + 34 m^3 FLOPs for 5 steps (per step: p(A) 2 m^3, Q 2 m^3, A
    4 m^3; the first Q and the last A are free) against 5 (4 m^2 n + 2 m^3): 50 against
    90 m^3, a little over half, for Muon's 1 x 4 MLP matrices. Not in torch; the idea is
    the "Gram Newton-Schulz" of the Muon literature. Kept to fp32 here: in bf16 the
    rounding of A_k accumulates, where the textbook form recomputes A from x every step."""
    a, b, c = coefficients
    gram = x @ x.mT
    q = None
    for step in range(steps):
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        q = poly if q is None else poly @ q
        if step < steps - 1:
            gram = poly @ gram @ poly
    return q @ x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-shape LR adjustment, for the same LR values to carry over."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz step runs in `ns_dtype` (bf16 is torch's fixed
    choice) and over same-shape matrices at once. Everything else is torch's: arguments,
    validation, momentum buffers, state_dict."""

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            if not params:
                continue
            # foreach ops: one C++ loop per list instead of a Python round per matrix (d12 has
            # 72 of them; the same arithmetic as torch's per-parameter loop)
            momentum = group["momentum"]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            updates = (
                torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            )
            by_shape: dict[torch.Size, list[int]] = defaultdict(list)
            for i, grad in enumerate(grads):
                by_shape[grad.shape].append(i)
            lr, decay = group["lr"], group["weight_decay"]
            for shape, indices in by_shape.items():
                # stacked and cast in one pass (stack, then cast, is two)
                stacked = updates[indices[0]].new_empty((len(indices), *shape), dtype=self.ns_dtype)
                torch._foreach_copy_(list(stacked.unbind(0)), [updates[i] for i in indices])
                ortho = newton_schulz(
                    stacked, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                # a tall matrix's result is a transposed view: adding it to the weights read
                # it strided, 5x slower than a copy and a contiguous add
                ortho = ortho.contiguous()
                targets = [params[i] for i in indices]
                if decay:
                    torch._foreach_mul_(targets, 1 - lr * decay)
                torch._foreach_add_(
                    targets,
                    list(ortho.unbind(0)),
                    alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape),
                )
        return loss
