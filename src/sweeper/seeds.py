"""Is the best configuration clearly better than another one, given runs of both on the same
seeds? Used by the scaling fits (is a budget's optimum resolved?) and by the stage tables of
a sweep whose grid has `trainer.seed` as an axis (is the frozen value resolved?).

Seeds are compared pairwise because a seed's luck is shared: runs on one seed see the same
data in the same order (one seed trained 0.15-0.20 bpb better than another at every LR), so
the spread of single runs would bury differences every seed agrees on. Two seeds can only
say whether both agree. From three on, the lead is resolved where the one-sided 95% lower
bound of the paired t-interval of the margins is above 0: one unlucky seed among many does
not unresolve a clear lead, and margins scattered around 0 do not resolve it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Lead:
    """The best's lead over a rival on their shared seeds (margins > 0: the best won)."""

    n: int  # shared seeds
    wins: int  # seeds on which the best won
    mean: float  # mean margin
    lower: float | None  # one-sided 95% lower bound of the mean margin (from 3 seeds on)

    @property
    def resolved(self) -> bool:
        return self.wins == self.n if self.lower is None else self.lower > 0

    def words(self) -> str:
        """How the lead stands, to follow "the best beats X"."""
        if self.lower is None:
            return f"on {self.wins} of {self.n} seeds"
        return (
            f"by {self.mean:.3g} on average over {self.n} seeds (won on {self.wins}), but the "
            f"paired 95% lower bound is {self.lower:.3g}"
        )

    def short(self) -> str:
        """The same in a parenthesis, beside a rival's name."""
        if self.lower is None:
            return f"the best won on {self.wins} of {self.n} seeds"
        return f"paired lower bound {self.lower:.3g}"


def paired_lead(best: dict, rival: dict, sign: float = 1.0) -> Lead | None:
    """The lead of `best` over `rival` ({seed: metric} each) on the seeds both ran; sign
    +1 where lower is better, -1 where higher is. None with fewer than 2 shared seeds."""
    shared = sorted(set(best) & set(rival))
    if len(shared) < 2:
        return None
    margins = np.array([sign * (rival[s] - best[s]) for s in shared])
    n, wins = len(shared), int((margins > 0).sum())
    if n == 2:
        return Lead(n, wins, float(margins.mean()), None)
    # imported here, not above: every trial process imports this module (through the
    # stages' helpers), and scipy.stats alone took 1.1 s of its start-up
    from scipy import stats

    sem = margins.std(ddof=1) / math.sqrt(n)
    lower = margins.mean() - stats.t.ppf(0.95, n - 1) * sem
    return Lead(n, wins, float(margins.mean()), float(lower))
