"""Where the schedulers rank trials: pure arithmetic of ASHA and HyperBand rungs."""

from __future__ import annotations

import math


def budget_key(time_attr: str) -> str:
    """Result key the HyperBand schedulers read: ``time_attr`` in units of the grace period."""
    return f"{time_attr}_grace_units"


def hyperband_units(max_t: float, grace_period: float, reduction_factor: int) -> tuple[float, int]:
    """HyperBand's time unit and ``max_t`` in that unit: ``(unit, reduction_factor**k)``.

    Every bracket must end on the full budget, so ``max_t`` must be a whole power of eta in
    units: Ray computes a bracket's rungs as ``int(max_t * eta**-s) * eta**j``, and with
    ``max_t = 4`` units (a grace period of a quarter) the s=1 bracket runs rungs 1 and 3,
    and stops its best trial at three quarters of the budget, before it ever completes.
    ``k`` is the largest with a unit no shorter than the grace period, so no trial stops
    earlier than the user allowed: a quarter becomes a third at eta=3, 0.111 a ninth.
    """
    k = math.floor(math.log(max_t / grace_period) / math.log(reduction_factor) + 1e-9)
    return max_t / reduction_factor**k, reduction_factor**k


def rungs(scheduler: str, max_t: float, grace_period: float, reduction_factor: float) -> list:
    """Where ``scheduler`` may stop a trial, in ``time_attr`` (the full budget excluded)."""
    if scheduler == "asha":
        # Ray's ASHA: grace_period * eta**k for k < int(log_eta(max_t / grace_period) + 1)
        count = int(math.log(max_t / grace_period) / math.log(reduction_factor) + 1)
        found = [grace_period * reduction_factor**k for k in range(count)]
        return [t for t in found if t < max_t]
    if scheduler in ("hyperband", "bohb"):
        eta = int(reduction_factor)
        unit, units = hyperband_units(max_t, grace_period, eta)
        return [unit * eta**j for j in range(round(math.log(units, eta)))]
    return []


def check_reduction_factor(scheduler: str, reduction_factor: float) -> None:
    """Ray's HyperBand truncates rungs to whole units, so with a fractional eta its brackets
    never land on the full budget: refuse one for hyperband/bohb (ASHA takes any eta > 1)."""
    if scheduler in ("hyperband", "bohb") and reduction_factor != int(reduction_factor):
        raise ValueError(
            f"scheduler {scheduler!r} needs a whole reduction_factor, got {reduction_factor!r}"
        )


def _check_time_axis(
    scheduler: str, max_t: float, grace_period: float, reduction_factor: float
) -> None:
    if not 0 < grace_period <= max_t:
        raise ValueError(f"need 0 < grace_period <= max_t, got {grace_period!r} and {max_t!r}")
    if not reduction_factor > 1:
        raise ValueError(f"reduction_factor must be > 1, got {reduction_factor!r}")
    check_reduction_factor(scheduler, reduction_factor)
