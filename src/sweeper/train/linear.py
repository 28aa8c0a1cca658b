"""Linear layers: torch's own, or in fp32 on CPUs where it is faster, oneDNN's matmul.

torch runs fp32 matmuls on CPU through MKL's sgemm, and MKL picks its kernels by CPU
vendor: on an AMD EPYC with AVX-512 it runs its AVX2 kernel, at half the machine's rate
(measured on a 2-core EPYC of family 26: 210 GF/s, where oneDNN's fp32 matmul, the one
torch itself uses for bf16, reached 455-499 GF/s). torch has no switch for fp32 (its
`fp32_precision` knobs only let fp32 drop to bf16 or tf32), so `Linear` below calls
oneDNN's matmul itself, forward and backward, where runtime.cpu_fp32_matmul_by_onednn
says a timed probe found it faster. Everywhere else (bf16 autocast, CUDA, under
torch.compile, or where MKL is as fast) it is nn.Linear.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sweeper.train.device import cpu_fp32_matmul_by_onednn, onednn_fp32_linear


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T, without a bias: F.linear, or oneDNN's fp32 matmul (see the module)."""
    if use_onednn(x, weight):
        return _OneDNNLinear.apply(x, weight)
    return F.linear(x, weight)


def use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")  # autocast casts to bf16 in F.linear
        and not torch.compiler.is_compiling()  # Inductor picks its own kernels
        and cpu_fp32_matmul_by_onednn()
    )


class Linear(nn.Linear):
    """nn.Linear without a bias whose matmul is `linear`'s. A module, not a function, so
    forward hooks (the ActivationWatch's) and state_dict keys stay nn.Linear's."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return onednn_fp32_linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_fp32_linear(grad, weight.T)  # grad @ weight
        if ctx.needs_input_grad[1]:
            # grad.T @ x over every token, (out, in). oneDNN is faster with the product's
            # longer side as its columns (the `small` model's MLP, 4096 tokens: 5.9 ms with
            # a transposing copy after it against 8.7 ms without), so a tall gradient is
            # computed as (x.T @ grad).T
            x2, grad2 = x.reshape(-1, x.size(-1)), grad.reshape(-1, grad.size(-1))
            if weight.size(0) > weight.size(1):
                grad_weight = onednn_fp32_linear(x2.T, grad2.T).T.contiguous()
            else:
                grad_weight = onednn_fp32_linear(grad2.T, x2.T)
        return grad_x, grad_weight
