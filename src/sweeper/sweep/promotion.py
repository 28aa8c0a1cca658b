"""ASHA as published (Li et al., 2020, "A System for Massively Parallel Hyperparameter
Tuning", Algorithm 2), on Ray Tune: ``sweep.asha_promotion=true``.

Ray's ASHA decides a trial at its rung from the values recorded there before it, and stops
it or lets it go on: a rung's first trial always goes on, unranked, and so does the second
if it beats the first. Here every trial pauses at its rung (Tune checkpoints it), and a
free slot goes to the best trial not yet promoted from the top floor(n / eta) of the
highest rung that has one, else to a new trial. Once the stage has no trial left to start,
the top ceil(n / eta) of each rung may go on, so a rung's leader is never left waiting,
and the trials no rung can promote any more are ended (pruned).

Written here because Ray has no promotion-based ASHA (its HyperBand pauses, but in
synchronous brackets). The rungs stay Ray's ``_Bracket`` (Ray 2.60), so what reads or
feeds them (``hyperband.record_earlier_trials`` for extension rounds and resumed stages)
works unchanged. Imported lazily by ``algorithms`` (it imports Ray).
"""

from __future__ import annotations

import math
from typing import Any

from ray.tune.experiment import Trial
from ray.tune.schedulers import AsyncHyperBandScheduler

from sweeper.sweep.hyperband import _tell_searcher


class PromotingASHA(AsyncHyperBandScheduler):
    """One bracket of asynchronous successive halving that pauses trials at its rungs and
    promotes the best of each. ``max_concurrent``: a paused trial goes on only while fewer
    trials run or wait to (the searcher's limit, as in ``hyperband``)."""

    def __init__(self, *, max_concurrent: int | None = None, **kwargs: Any) -> None:
        super().__init__(brackets=1, **kwargs)
        self._max_concurrent = max_concurrent
        # paused at rung k and not promoted from it: a promoted trial leaves for good, since
        # it comes back only at a higher rung (at rung k it is recorded, and goes on)
        self._waiting: dict[str, tuple[Trial, int]] = {}

    def _ascending_rungs(self) -> list[tuple[float, dict]]:
        return list(reversed(self._brackets[0]._rungs))  # Ray keeps them highest first

    def _reached_rung(self, time: float) -> int | None:
        """The highest rung at or below `time` (None: below the first)."""
        rungs = self._ascending_rungs()
        reached = [k for k, (milestone, _) in enumerate(rungs) if time >= milestone]
        return reached[-1] if reached else None

    def promotion(
        self, last_draws: bool, arriving: Trial | None = None
    ) -> tuple[Trial, int] | None:
        """The paused trial to go on next and its rung: the best not yet promoted among the
        top of the highest rung that has one. `last_draws`: no new trial is left to start,
        so a rung keeps ceil(n / eta) of its trials, not floor. `arriving`: the trial whose
        report is being decided, which may go on at once.

        A trial Tune is still pausing (its checkpoint being saved) reads RUNNING: it waits
        its turn until it reads PAUSED, and is never dropped, or it would stay paused for
        ever and the stage would never end."""
        rungs = self._ascending_rungs()
        for k in reversed(range(len(rungs))):
            recorded = rungs[k][1]
            # values are metric x Ray's sign (higher is better), penalised when diverged
            ranked = sorted(recorded, key=recorded.get, reverse=True)
            share = len(ranked) / self._reduction_factor
            keep = math.ceil(share - 1e-9) if last_draws else math.floor(share + 1e-9)
            for trial_id in ranked[:keep]:
                waiting = self._waiting.get(trial_id)
                if (
                    waiting
                    and waiting[1] == k
                    and (waiting[0] is arriving or waiting[0].status == Trial.PAUSED)
                ):
                    return waiting
        return None

    def _promote(self, trial_id: str) -> None:
        self._waiting.pop(trial_id, None)

    @staticmethod
    def _last_draws(tune_controller: Any) -> bool:
        """No trial waits to start and the searcher will propose no more."""
        if any(t.status == Trial.PENDING for t in tune_controller.get_trials()):
            return False
        return tune_controller.search_alg.is_finished()

    def on_trial_result(self, tune_controller: Any, trial: Trial, result: dict) -> str:
        if self._time_attr not in result or self._metric not in result:
            return self.CONTINUE  # a report off the time axis: Ray's ASHA lets it go on too
        time = result[self._time_attr]
        if time >= self._max_t and self._stop_last_trials:
            self._num_stopped += 1
            return self.STOP
        k = self._reached_rung(time)
        if k is None:
            return self.CONTINUE
        recorded = self._ascending_rungs()[k][1]
        if trial.trial_id in recorded:
            return self.CONTINUE  # promoted from this rung, on its way to the next
        recorded[trial.trial_id] = self._metric_op * result[self._metric]
        if time >= self._max_t or result.get("status") == "diverged":
            # a user's function counted in reports goes on past max_t, which only placed
            # the rungs, and a diverged trial ends itself: their values rank the others,
            # and they are not held back
            return self.CONTINUE
        self._waiting[trial.trial_id] = (trial, k)
        chosen = self.promotion(self._last_draws(tune_controller), arriving=trial)
        if chosen is not None and chosen[0] is trial:
            self._promote(trial.trial_id)
            return self.CONTINUE
        _tell_searcher(tune_controller, "on_pause", trial)
        return self.PAUSE  # the slot goes to choose_trial_to_run's pick

    def choose_trial_to_run(self, tune_controller: Any) -> Trial | None:
        trials = tune_controller.get_trials()
        active = [t for t in trials if t.status in (Trial.RUNNING, Trial.PENDING)]
        last_draws = self._last_draws(tune_controller)
        for trial, _ in list(self._waiting.values()):
            if trial.status in (Trial.TERMINATED, Trial.ERROR):  # ended while it waited
                self._waiting.pop(trial.trial_id)
        chosen = self.promotion(last_draws)
        if chosen is not None:
            trial, _ = chosen
            if self._max_concurrent and len(active) >= self._max_concurrent:
                return None  # it goes on when a running trial pauses or ends
            self._promote(trial.trial_id)
            _tell_searcher(tune_controller, "on_unpause", trial)
            return trial
        pending = next((t for t in trials if t.status == Trial.PENDING), None)
        if pending is None and last_draws and not active:
            # nothing runs (so no pause is in flight), nothing is left to start, and no
            # rung promotes any of the paused trials: they are done (pruned at their rung).
            # Every paused trial, not only those waiting here: one left paused would keep
            # Tune's loop going for ever.
            self._waiting.clear()
            for trial in trials:
                if trial.status == Trial.PAUSED:
                    self._num_stopped += 1
                    tune_controller.stop_trial(trial)
        return pending

    def on_trial_add(self, tune_controller: Any, trial: Trial) -> None:
        super().on_trial_add(tune_controller, trial)
        # A resumed stage (Tuner.restore) gives back its trials as pending, their rung
        # values replayed (hyperband.replay_restored_rungs). One whose last report is the
        # one its rung recorded was paused there, and waits again to be ranked (Tune reads
        # the status after on_trial_add); who was promoted is not saved, so it is decided
        # again against the rung as it is now.
        last = trial.last_result or {}
        time, value = last.get(self._time_attr), last.get(self._metric)
        if trial.status != Trial.PENDING or time is None or value is None:
            return
        k = self._reached_rung(time)
        recorded = {} if k is None else self._ascending_rungs()[k][1]
        if recorded.get(trial.trial_id) == self._metric_op * value and time < self._max_t:
            self._waiting[trial.trial_id] = (trial, k)
            trial.set_status(Trial.PAUSED)
            _tell_searcher(tune_controller, "on_pause", trial)

    def on_trial_complete(self, tune_controller: Any, trial: Trial, result: dict) -> None:
        self._waiting.pop(trial.trial_id, None)
        if trial.trial_id in self._trial_info:
            super().on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller: Any, trial: Trial) -> None:
        self._waiting.pop(trial.trial_id, None)
        self._trial_info.pop(trial.trial_id, None)

    def debug_string(self) -> str:
        return f"Using ASHA with promotions: num_stopped={self._num_stopped}"
