"""Ray's OptunaSearch, told a trial's value when a scheduler pauses it at a rung, and told a
diverged trial as the worst value instead of its penalty.

**Paused trials.** Optuna's samplers learn only from trials that have ended (TPE and the GP
skip running ones). Ray's ASHA stops a trial at its rung and the searcher is told its rung
value at once; ASHA with promotions (`promotion.py`) and HyperBand pause it instead, and a
paused trial ends only when no rung can promote it any more, at the stage's end game. Under
TPE, on `+sweep=lr_bs`, the stage's proposals were then made from a handful of ended trials
(seventieth session: on one sweep seed every proposal stayed in one narrow LR band). So a
trial's first pause tells Optuna what Ray's ASHA tells it when it stops one there: the trial
ended with its rung value. Optuna cannot change a trial once told, so a paused trial that
goes on and ends later is added again, as a completed trial with the same parameters and
its last value: the searcher then holds the configuration's rung value and its best-trained
one, as it holds a stopped trial's and a finished trial's under Ray's ASHA.

**Diverged trials.** A diverged trial reports a finite penalty (`engine.default_penalty`:
8 bits per byte for sweeper's training, 1e9 for a user's function) because Ray's schedulers
cannot rank NaN. TPE only ranks values, so any penalty does, but Optuna's GPSampler fits a
Gaussian process to the standardised values: one 1e9 among values of order 1 flattens every
other point to the same number, and the model is blind from then on. Told +inf (-inf for
mode=max) instead, the GP clips it to the worst finite value of each fit
(`optuna._gp.gp.warn_and_convert_inf`), a penalty in the metric's own scale that follows
the study. On a stand-in LR stage whose optimum lies at half the divergence edge
(`bench/bench_gp_penalty.py`, 20 seeds of 24 trials), the GP's median regret was 0.012 told
1e9, 0.0044 told 8 and 0.0002 told +inf; TPE's is the same whatever it is told.

Imported lazily by `algorithms` (it imports Ray).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import optuna
from ray.tune.search.optuna import OptunaSearch


class PausedTrialsOptunaSearch(OptunaSearch):
    """OptunaSearch that learns a paused trial's rung value when it pauses (see above).

    The schedulers call ``on_pause`` before Tune hands the searcher the result that made the
    trial pause, so the trial is told at that result."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pausing: set[str] = set()  # paused, its rung result not yet seen
        self._told_at_pause: set[str] = set()  # Optuna's trial has ended at its first pause
        # ...and the trial trained on after it: its last value (Tune ends a trial that is
        # paused at its end without a result)
        self._went_on: dict[str, float | None] = {}

    def _as_told(self, result: dict) -> dict:
        """The result as Optuna is told it."""
        return result

    def on_pause(self, trial_id: str) -> None:
        # a restored stage pauses its trials again: those told before are not told twice
        if trial_id not in self._told_at_pause:
            self._pausing.add(trial_id)

    def on_unpause(self, trial_id: str) -> None:
        self._pausing.discard(trial_id)
        if trial_id in self._told_at_pause:
            self._went_on.setdefault(trial_id, None)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id in self._told_at_pause:
            # its Optuna trial has ended; what it reaches is told when it ends
            if trial_id in self._went_on and self.metric in result:
                self._went_on[trial_id] = self._as_told(result)[self.metric]
            return
        super().on_trial_result(trial_id, result)
        if trial_id in self._pausing and self.metric in result:
            self._pausing.discard(trial_id)
            told = self._as_told(result)[self.metric]
            self._ot_study.tell(self._ot_trials[trial_id], told)
            self._told_at_pause.add(trial_id)

    def on_trial_complete(
        self, trial_id: str, result: dict | None = None, error: bool = False
    ) -> None:
        self._pausing.discard(trial_id)
        result = self._as_told(result) if result else result
        if trial_id not in self._told_at_pause:
            super().on_trial_complete(trial_id, result=result, error=error)
            return
        # a trial ended where it first paused was told so then; one that went on is told
        # again, at its last value
        went_on = trial_id in self._went_on
        last = self._went_on.pop(trial_id, None)
        if went_on and result and self.metric in result:
            last = result[self.metric]
        if last is not None and not error:
            asked = self._ot_trials[trial_id]
            self._ot_study.add_trial(
                optuna.trial.create_trial(
                    params=asked.params, distributions=asked.distributions, value=last
                )
            )
        self._completed_trials.add(trial_id)


class WorstOnDivergenceOptunaSearch(PausedTrialsOptunaSearch):
    def _as_told(self, result: dict) -> dict:
        if result.get("status") == "diverged" and self.metric in result:
            worst = math.inf if self.mode == "min" else -math.inf
            return {**result, self.metric: worst}
        return result

    def suggest(self, trial_id: str):
        with warnings.catch_warnings():
            # the GP's "Clip non-finite values to the min/max finite values" is the point
            # here, not news, at every proposal after a divergence
            warnings.filterwarnings("ignore", message="Clip non-finite values")
            return super().suggest(trial_id)
