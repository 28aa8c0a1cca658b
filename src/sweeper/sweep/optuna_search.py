"""Ray's OptunaSearch, told a diverged trial as the worst value instead of its penalty.

A diverged trial reports a finite penalty because Ray's schedulers cannot rank NaN. TPE only
ranks values, so any penalty does; Optuna's GPSampler fits a Gaussian process to the
standardised values, where one 1e9 among values of order 1 flattens every other point.
Told +inf (-inf for mode=max), the GP clips it to the worst finite value of each fit
(`optuna._gp.gp.warn_and_convert_inf`): a penalty in the metric's own scale
(`bench/bench_gp_penalty.py`). Imported lazily by `algorithms` (it imports Ray).
"""

from __future__ import annotations

import math
import warnings

from ray.tune.search.optuna import OptunaSearch


class WorstOnDivergenceOptunaSearch(OptunaSearch):
    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        if result and result.get("status") == "diverged" and self.metric in result:
            worst = math.inf if self.mode == "min" else -math.inf
            result = {**result, self.metric: worst}
        super().on_trial_complete(trial_id, result=result, error=error)

    def suggest(self, trial_id: str):
        with warnings.catch_warnings():
            # the GP's "Clip non-finite values to the min/max finite values" is the point
            # here, not news, at every proposal after a divergence
            warnings.filterwarnings("ignore", message="Clip non-finite values")
            return super().suggest(trial_id)
