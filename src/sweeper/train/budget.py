"""A run's length in optimizer steps, from whichever budget it sets; apart from the loop
because the driver checks budgets before a run starts, importing torch only for budgets
that need the model's size."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from sweeper.config.errors import ConfigError
from sweeper.config.schema import RunConfig

if TYPE_CHECKING:
    import torch


def resolve_total_steps(cfg: RunConfig, params: int, flops_per_token: int) -> int:
    """Optimizer steps of the run, from whichever budget is set (exactly one is). A budget
    of less than one optimizer step is refused: the run would train one whole step anyway,
    many times the compute asked for (an IsoFLOP point at the wrong budget)."""
    t = cfg.trainer
    if t.max_steps is not None:
        return int(t.max_steps)
    if t.budget_tokens is not None:
        tokens, given = t.budget_tokens, f"trainer.budget_tokens={t.budget_tokens:g}"
    elif t.budget_flops is not None:
        tokens = t.budget_flops / flops_per_token
        given = (
            f"trainer.budget_flops={t.budget_flops:g} at {flops_per_token:,} FLOPs per token "
            f"is {tokens:,.0f} tokens"
        )
    else:
        tokens = t.tokens_per_param * params  # N = total parameters, as Chinchilla counts
        given = (
            f"trainer.tokens_per_param={t.tokens_per_param:g} x {params:,} parameters "
            f"is {tokens:,.0f} tokens"
        )
    if tokens < t.total_batch_size:
        raise ConfigError(
            f"{given}, less than one optimizer step of trainer.total_batch_size="
            f"{t.total_batch_size} tokens; raise the budget or lower the batch"
        )
    return math.ceil(tokens / t.total_batch_size)


def check_budget(cfg: RunConfig) -> int:
    """The run's optimizer steps, or the one-line error of `resolve_total_steps`, before
    any weights exist."""
    t = cfg.trainer
    if t.budget_flops is None and t.tokens_per_param is None:
        return resolve_total_steps(cfg, 0, 0)  # no model needed, and no torch import
    return resolve_total_steps(cfg, *model_counts(cfg))


def planned_flops(cfg: RunConfig) -> float:
    """Training FLOPs the run is planned to take: steps x batch x FLOPs per token (what a
    sweep's progress line weighs its trials by)."""
    params, flops_per_token = model_counts(cfg)
    steps = resolve_total_steps(cfg, params, flops_per_token)
    return float(steps * cfg.trainer.total_batch_size * flops_per_token)


def model_counts(cfg: RunConfig) -> tuple[int, int]:
    """(total parameters, FLOPs per token) of the run's model, from its shape."""
    from sweeper.train.model import GPTShape

    shape = GPTShape.from_config(cfg.model)
    return shape.n_params, shape.flops_per_token


# bytes a training run holds per parameter before any activation: fp32 weights and
# gradients, and the optimizer's state (AdamW's two moments; Muon keeps one, so for
# muon_adamw this is an upper bound)
TRAINING_BYTES_PER_PARAM = 16


def memory_bytes(device: torch.device) -> int:
    """Memory of the device: a GPU's own, or the machine's RAM under any cgroup limit."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's limit (cgroup v2): "max" when there is none
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        return min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        return total


def check_model_fits(
    run,
    device: torch.device | None = None,
    copies: int = 1,
    copies_are: str = "copies",
    fewer: Callable[[int], str] | None = None,
) -> None:
    """Refuses, before it is built, a model whose weights, gradients and optimizer state
    alone exceed the memory of `device` (else the run's own): building it would fail with
    batch-size advice that cannot help, overflow in torch, or grow until the system kills
    it. `copies` of it may share the device (a sweep's trials at once, CPU DDP ranks) and
    must fit together; `copies_are` says what they are, `fewer(n)` the setting for n."""
    from sweeper.train.device import resolve_device
    from sweeper.train.model import GPTShape

    shape = GPTShape.from_config(run.model)
    need = shape.n_params * TRAINING_BYTES_PER_PARAM
    device = device or resolve_device(run.trainer.device)
    have = memory_bytes(device)
    params, needed = _readable(shape.n_params / 1e9, "B"), _readable(need / 2**30, " GiB")
    model = f"model.depth={shape.depth} (d_model {shape.d_model}) has {params} parameters"
    if need > have:
        raise ConfigError(
            f"{model}, whose weights, gradients and optimizer state need {needed}; "
            f"{device.type} has {have / 2**30:,.0f} GiB: choose a smaller model"
        )
    if need * copies > have:
        fit = int(have // need)
        raise ConfigError(
            f"{model}, whose weights, gradients and optimizer state need {needed} a copy; "
            f"{copies} {copies_are} need {_readable(need * copies / 2**30, ' GiB')}"
            f", and {device.type} has {have / 2**30:,.0f} GiB: {fit} fit{'s' * (fit == 1)}"
            f"{f' ({fewer(fit)})' if fewer else ''}, or choose a smaller model"
        )


def _readable(n: float, unit: str) -> str:
    """12.9B, 192.0 GiB; a count too long to read in thousands, as 4.92e+10B."""
    return f"{n:,.1f}{unit}" if n < 1e6 else f"{n:.2e}{unit}"
