"""LR schedules as pure functions of training progress (a fraction of total steps).

Fractions rather than step counts keep a schedule's shape the same for any budget, which is
what lets a sweep compare trials of different lengths and lets ASHA cut any of them short.
"""

from __future__ import annotations

import math


def lr_multiplier(
    step: int,
    total_steps: int,
    name: str,
    warmup_ratio: float,
    warmdown_ratio: float,
    final_lr_frac: float,
) -> float:
    """Multiplier of each group's peak LR at optimizer step `step` (0-based) of `total_steps`."""
    progress = step / max(total_steps, 1)
    # 1) linear warm-up from near zero over whole steps, the fraction's rounded up, the last
    # of them at the peak: 0.02 of 74 steps is 1.48, and 2/1.48 would overshoot it 1.35x
    if warmup_ratio > 0:
        warmup_steps = max(math.ceil(warmup_ratio * total_steps - 1e-9), 1)
        if step < warmup_steps:
            return (step + 1) / warmup_steps
    if name == "constant":
        return 1.0
    if name == "cosine":
        # 2) half-cosine from the peak to final_lr_frac over the steps after warm-up
        span = max(1.0 - warmup_ratio, 1e-12)
        t = min((progress - warmup_ratio) / span, 1.0)
        return final_lr_frac + (1.0 - final_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * t))
    # wsd: 2) stable at the peak, 3) linear warm-down to final_lr_frac over the last steps
    if warmdown_ratio <= 0 or progress < 1.0 - warmdown_ratio:
        return 1.0
    remaining = max(1.0 - progress, 0.0) / warmdown_ratio  # 1 -> 0 across the warm-down
    return final_lr_frac + (1.0 - final_lr_frac) * remaining


def weight_decay_multiplier(step: int, total_steps: int, name: str) -> float:
    """Multiplier of each group's weight decay at optimizer step `step`: 1 throughout
    (`constant`), or falling linearly to 0 at the run's end (`linear`, nanochat's). Either
    way the decay applied each step is lr x weight_decay (decoupled), so it also follows
    the LR schedule; on the 74-step default run linear was no better (BENCHMARKS.md)."""
    if name == "linear":
        return max(1.0 - step / max(total_steps, 1), 0.0)
    return 1.0


def muon_momentum(step: int, start: float, end: float, warmup_steps: int) -> float:
    """Muon momentum raised linearly from `start` to `end` over `warmup_steps` steps: a
    low momentum early avoids overshooting while the gradients still change fast."""
    if warmup_steps <= 0:
        return end
    frac = min(step / warmup_steps, 1.0)
    return (1.0 - frac) * start + frac * end
