"""A run's length in optimizer steps, from whichever budget it sets.

Apart from `train.py` because the driver checks budgets before a run or sweep starts,
where importing torch is only worth it for budgets that need the model's size.
"""

from __future__ import annotations

import math

from sweeper.config import ConfigError, RunConfig


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
    from sweeper.model import GPTShape

    shape = GPTShape.from_config(cfg.model)
    return shape.n_params, shape.flops_per_token
