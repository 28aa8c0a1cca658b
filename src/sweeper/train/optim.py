"""Optimizers: Muon for hidden matrices + AdamW for the rest, or plain AdamW.

Each parameter group keeps its peak LR in `initial_lr` and its weight decay in
`initial_weight_decay`; the training loop multiplies them by their schedules at every
step. `ChainedOptimizer` lets the loop treat two optimizers as one.
"""

from __future__ import annotations

import torch

from sweeper.config.schema import OptimizerConfig
from sweeper.train.device import bf16_is_fast
from sweeper.train.model import GPT
from sweeper.train.muon import Muon


class ChainedOptimizer:
    """Steps several torch optimizers as one (Muon and AdamW take different parameters)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list[dict]) -> None:
        for opt, state in zip(self.optimizers, states, strict=True):
            opt.load_state_dict(state)


def build_optimizer(model: GPT, cfg: OptimizerConfig) -> ChainedOptimizer:
    groups = model.param_groups()
    # AdamW LRs were tuned at d_model 768; wider models need smaller steps (~1/sqrt(width))
    width_scale = (model.shape.d_model / 768) ** -0.5
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    device = model.lm_head.weight.device
    # fused: one kernel for all of AdamW's parameters on a GPU; CPUs keep torch's default
    fused = True if device.type == "cuda" else None
    if cfg.name == "adamw":
        # decay only the matrices: embeddings are sparse lookups and scalars are gains
        adam_groups = [
            dict(
                name="matrix",
                params=groups["matrix"] + groups["unembedding"],
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
            ),
            dict(name="embedding", params=groups["embedding"], lr=cfg.lr, weight_decay=0.0),
            dict(name="scalar", params=groups["scalar"], lr=cfg.lr, weight_decay=0.0),
        ]
        optimizers = [torch.optim.AdamW(adam_groups, betas=betas, eps=cfg.adam_eps, fused=fused)]
    else:
        adam_groups = [
            dict(name=name, params=groups[name], lr=lr * width_scale, weight_decay=0.0)
            for name, lr in (
                ("embedding", cfg.embedding_lr),
                ("unembedding", cfg.unembedding_lr),
                ("scalar", cfg.scalar_lr),
            )
        ]
        muon = Muon(
            [dict(name="matrix", params=groups["matrix"])],
            # torch's bf16 Newton-Schulz where bf16 is fast; fp32 where it is emulated
            ns_dtype=torch.bfloat16 if bf16_is_fast(device) else torch.float32,
            lr=cfg.matrix_lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum,
            nesterov=True,
            # Keller Jordan's original shape scaling sqrt(max(1, rows/cols)): the LR values
            # of nanochat / modded-nanogpt carry over unchanged
            adjust_lr_fn="original",
        )
        adamw = torch.optim.AdamW(adam_groups, betas=betas, eps=cfg.adam_eps, fused=fused)
        optimizers = [muon, adamw]
    chained = ChainedOptimizer(optimizers)
    for group in chained.param_groups:
        group["initial_lr"] = group["lr"]
        group["initial_weight_decay"] = group["weight_decay"]
    return chained


def weights_before_step(optimizer: ChainedOptimizer) -> dict[str, list[torch.Tensor]]:
    """Copies of each parameter group's weights, for `update_ratios` after the step."""
    return {g["name"]: [p.detach().clone() for p in g["params"]] for g in optimizer.param_groups}


def update_ratios(
    optimizer: ChainedOptimizer, before: dict[str, list[torch.Tensor]]
) -> dict[str, float]:
    """How far one optimizer step moved each group's weights, relative to their size:
    ||W_after - W_before|| / ||W_before||, the group's tensors taken as one vector (torch
    keeps no such figure). Karpathy's rule of thumb puts it near 1e-3; short runs with LRs
    tuned for their length sit higher (~1.5e-2 for the default's matrices at peak LR)."""
    ratios = {}
    for group in optimizer.param_groups:
        old = before[group["name"]]
        if not old:
            continue
        moved = [p.detach() - w for p, w in zip(group["params"], old, strict=True)]
        size = torch.nn.utils.get_total_norm(old)
        ratios[group["name"]] = (
            (torch.nn.utils.get_total_norm(moved) / size).item() if size > 0 else float("nan")
        )
    return ratios
