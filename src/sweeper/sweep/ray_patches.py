"""Ray's HyperBand schedulers (``hyperband``, and ``bohb``'s HyperBandForBOHB) as the sweeps use
them: time in units of the grace period, brackets that close once filled, and a concurrency
limit that counts running trials, not paused ones.

Imported lazily by ``algorithms`` (it imports Ray). Three faults of Ray 2.60 are fixed here,
each measured with a stand-in trainable (ray-project/ray#12536 reports the first):

- A bracket counts as filled while its live trials number its size, so once its last trial
  completes it has room again: every later trial joins that finished bracket and runs to the
  full budget. BOHB at ``sweep.concurrency=1`` pruned nothing after its first bracket.
- Ray's concurrency limits (``ConcurrencyLimiter``, ``BasicVariantGenerator(max_concurrent)``)
  count paused trials as running, so with N at once a bracket never holds more than N trials.
- Plain HyperBand halves a bracket as soon as its live trials reach the rung, filled or not:
  with those two, ``hyperband`` at any ``sweep.concurrency`` ran every trial to the end.

Ray also saves no scheduler's state (ray-project/ray#30838): ``Tuner.restore`` rebuilds a
HyperBand as it was made, so an interrupted stage's brackets were lost. ``BracketState``
saves them with every experiment checkpoint and gives them back on restore.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ray.tune import Callback
from ray.tune.experiment import Trial
from ray.tune.schedulers import HyperBandForBOHB, HyperBandScheduler
from ray.tune.schedulers.hyperband import _Bracket
from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

from sweeper.sweep.rungs import budget_key, hyperband_units

_ACTIVE = (Trial.RUNNING, Trial.PENDING)  # trials that hold, or are about to hold, a slot


class ClosingBracket(_Bracket):
    """A bracket takes its n0 trials and no more: filled means every slot was given once."""

    def __init__(self, *, s: int, **kwargs: Any) -> None:
        super().__init__(s=s, **kwargs)
        self.s = s  # Ray keeps only the halvings left; a restored bracket is made with this
        self._saved: dict = {}  # a restored bracket's snapshot (restore, add_restored)
        self._order: dict[str, int] = {}

    def filled(self) -> bool:
        return len(self._all_trials) >= self._n0

    def snapshot(self, time_attr: str, metric: str) -> dict:
        """The bracket's bookkeeping by trial id, in plain values (see BracketState)."""
        status = {t.trial_id: str(t.status) for t in self._all_trials}
        return {
            "s": self.s,
            "progress": [self._n, self._r, self._cumul_r, self._halves, self._completed_progress],
            "halved": self.is_being_processed,  # Ray's name for "has been halved once"
            "trials": [t.trial_id for t in self._all_trials],
            # what a halving reads of each live trial's last result: its time and metric
            "live": {
                t.trial_id: None if r is None else {k: r[k] for k in (time_attr, metric) if k in r}
                for t, r in self._live_trials.items()
            },
            "paused": [i for i in status if status[i] == Trial.PAUSED],
            "to_unpause": [t.trial_id for t in self.trials_to_unpause],
        }

    def restore(self, saved: dict) -> None:
        """Takes back a snapshot's counters; its trials come back one by one (add_restored)."""
        self._n, self._r, self._cumul_r, self._halves, self._completed_progress = saved["progress"]
        self.is_being_processed = saved["halved"]
        self._saved = saved
        self._order = {trial_id: i for i, trial_id in enumerate(saved["trials"])}

    def add_restored(self, trial: Trial) -> None:
        """Puts a restored trial back where the snapshot had it, with the status it had.

        Tune restores every trial its saved state calls unfinished as pending, and starts
        pending trials by itself. That state lags behind the brackets: a trial HyperBand
        stopped while it was paused keeps the PAUSED it was last saved with (here: 4
        trials of 8 pruned or finished read PAUSED after Ctrl+C), so it would train again.
        Tune reads the status after on_trial_add, so setting it here holds: a trial the
        bracket had dropped (pruned, finished, failed) ends, and one paused at a rung stays
        paused rather than training past it."""
        saved = self._saved
        if trial.trial_id in saved["live"]:
            self._live_trials[trial] = saved["live"][trial.trial_id]
            if trial.trial_id in saved["paused"] and trial.status == Trial.PENDING:
                trial.set_status(Trial.PAUSED)
        elif trial.status == Trial.PENDING:
            trial.set_status(Trial.TERMINATED)
        self._all_trials.append(trial)
        if trial.trial_id in saved["to_unpause"]:
            self.trials_to_unpause.add(trial)
        key = lambda t: self._order.get(t.trial_id, len(self._order))
        self._all_trials.sort(key=key)
        self._live_trials = dict(sorted(self._live_trials.items(), key=lambda kv: key(kv[0])))


class RunningLimiter(ConcurrencyLimiter):
    """``ConcurrencyLimiter`` whose limit counts trials that run or wait to, not paused ones.

    The schedulers below say when a trial pauses and when it is picked to go on (at that point
    it counts again, so the searcher cannot take its place while it waits to resume).
    """

    def __init__(self, searcher: Any, max_concurrent: int) -> None:
        super().__init__(searcher, max_concurrent=max_concurrent)
        self.paused: set[str] = set()

    def on_pause(self, trial_id: str) -> None:
        if trial_id in self.live_trials:
            self.live_trials.remove(trial_id)
            self.paused.add(trial_id)
        if hasattr(self.searcher, "on_pause"):  # TuneBOHB keeps its own count
            self.searcher.on_pause(trial_id)

    def on_unpause(self, trial_id: str) -> None:
        if trial_id in self.paused:
            self.paused.remove(trial_id)
            self.live_trials.add(trial_id)
        if hasattr(self.searcher, "on_unpause"):
            self.searcher.on_unpause(trial_id)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        if trial_id in self.paused:  # stopped while paused: still the searcher's to learn from
            self.paused.remove(trial_id)
            self.live_trials.add(trial_id)  # the parent passes on only trials it counts
        super().on_trial_complete(trial_id, result=result, error=error)


class RunningVariantGenerator(BasicVariantGenerator):
    """``BasicVariantGenerator`` whose ``max_concurrent`` counts running trials, not paused."""

    def on_pause(self, trial_id: str) -> None:
        self._live_trials.discard(trial_id)

    def on_unpause(self, trial_id: str) -> None:
        self._live_trials.add(trial_id)


def _tell_searcher(tune_controller: Any, event: str, trial: Trial) -> None:
    """Call ``on_pause``/``on_unpause`` on the searcher where it has one (the limiters above,
    TuneBOHB); Ray's plain HyperBand tells no searcher, and Optuna's has no such hook."""
    search_alg = tune_controller.search_alg
    hook = getattr(getattr(search_alg, "searcher", search_alg), event, None)
    if hook is not None:
        hook(trial.trial_id)


class GraceUnitMixin:
    """A HyperBand scheduler (mixed into Ray's by `grace_unit_scheduler`) that measures time in units of its smallest rung,
    closes filled brackets, runs at most ``max_concurrent`` trials at once, and cycles
    through the ``brackets`` most aggressive brackets only (1: successive halving).

    HyperBand has no grace period: its smallest rung is 1 time unit and it opens
    log_eta(max_t) brackets, so with max_t counted in tokens (~1e9) it would open ~19
    brackets and cut trials after a handful of tokens. Feeding it tokens / unit (see
    ``hyperband_units``) makes the first rung the grace period, rounded up to a rung that
    leads to the full budget. The key is added to the result in place because
    HyperBandForBOHB's budget annotations on the same dict must reach TuneBOHB.
    """

    # Ray's HyperBandForBOHB differs from its HyperBand twice, and both are kept: it opens
    # the most aggressive bracket first (HyperBand the one that stops nothing), and it
    # goes on with the oldest bracket (HyperBand the least complete, for fairness): its
    # model needs results at the larger budgets, and the oldest bracket is closest to them.
    _is_bohb = False  # set by grace_unit_scheduler

    def __init__(
        self,
        *,
        time_attr: str,
        max_t: float,
        grace_period: float,
        reduction_factor: int,
        max_concurrent: int | None = None,
        brackets: int | None = None,
        **kwargs: Any,
    ) -> None:
        unit, units = hyperband_units(max_t, grace_period, reduction_factor)
        super().__init__(
            time_attr=budget_key(time_attr),
            max_t=units,
            reduction_factor=reduction_factor,
            **kwargs,
        )
        # how many brackets a band cycles through, the most aggressive kept: 1 is
        # successive halving from the first rung (Ray's ASHA runs one bracket too)
        self._bracket_count = min(brackets or self._s_max_1, self._s_max_1)
        # Ray's own int(max_t * eta**-s) drops to 0 where eta**-s rounds below 1/eta**s
        # (729 * 3**-6 = 0.999...); in whole units the first rung is exact.
        self._get_r0 = lambda s: units // reduction_factor**s
        self._source_time_attr = time_attr
        self._unit = unit
        self._max_concurrent = max_concurrent
        self._halving_unfilled = False
        self._restored: dict[str, tuple[ClosingBracket, int]] = {}

    def snapshot(self) -> dict | None:
        """The brackets by trial id (None before the first trial): BracketState saves it."""
        if not self._trial_info:
            return None
        current = self._state["bracket"]
        return {
            "bands": [  # Ray's HyperBand can leave None for a bracket too small to open
                [b and b.snapshot(self._time_attr, self._metric) for b in band]
                for band in self._hyperbands
            ],
            "current": next(
                (
                    [i, j]
                    for i, band in enumerate(self._hyperbands)
                    for j, b in enumerate(band)
                    if b is current
                ),
                None,
            ),
            "band_idx": self._state["band_idx"],
            "num_stopped": self._num_stopped,
        }

    def restore(self, saved: dict) -> None:
        """Rebuilds the saved brackets, empty; on_trial_add puts each trial back in its
        own as Tune restores it."""
        self._hyperbands, self._restored, self._trial_info = [], {}, {}
        for band_idx, band in enumerate(saved["bands"]):
            rebuilt = []
            for bracket_state in band:
                if bracket_state is None:
                    rebuilt.append(None)
                    continue
                bracket = self._new_bracket(bracket_state["s"])
                bracket.restore(bracket_state)
                rebuilt.append(bracket)
                for trial_id in bracket_state["trials"]:
                    self._restored[trial_id] = (bracket, band_idx)
            self._hyperbands.append(rebuilt)
        i, j = saved["current"] if saved["current"] else (None, None)
        self._state = {
            "bracket": None if i is None else self._hyperbands[i][j],
            "band_idx": saved["band_idx"],
        }
        self._num_stopped = saved["num_stopped"]

    def on_trial_add(self, tune_controller: Any, trial: Trial) -> None:
        place = self._restored.get(trial.trial_id)
        if place is None or trial in self._trial_info:
            return super().on_trial_add(tune_controller, trial)
        bracket, band_idx = place
        bracket.add_restored(trial)
        self._trial_info[trial] = bracket, band_idx

    def _cur_band_filled(self) -> bool:
        return len(self._hyperbands[self._state["band_idx"]]) >= self._bracket_count

    def _create_bracket(self, s: int) -> ClosingBracket:
        if not self._is_bohb:
            # Ray's HyperBand counts s up from 0, the bracket that stops nothing:
            # shift it so that the band keeps the most aggressive brackets
            s += self._s_max_1 - self._bracket_count
        return self._new_bracket(s)

    def _new_bracket(self, s: int) -> ClosingBracket:
        return ClosingBracket(
            time_attr=self._time_attr,
            max_trials=self._get_n0(s),
            init_t_attr=self._get_r0(s),
            max_t_attr=self._max_t_attr,
            eta=self._eta,
            s=s,
            stop_last_trials=self._stop_last_trials,
        )

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        if self._source_time_attr not in result:
            # a user's function that does not report the stage's time axis (tokens):
            # Ray's HyperBand fails the whole run on it (a KeyError), its ASHA lets the
            # trial go on unranked, as this does; the progress display says so
            return self.CONTINUE
        # rounded: the full budget must read as exactly `units`, not 8.999999
        units = round(result[self._source_time_attr] / self._unit, 9)
        result[budget_key(self._source_time_attr)] = units
        decision = super().on_trial_result(tune_controller, trial, result)
        if decision == self.PAUSE:
            _tell_searcher(tune_controller, "on_pause", trial)
        if decision == self.STOP and "budget" in result.get("hyperband_info", {}):
            # Tune passes a result to the searcher only when the scheduler does not stop
            # the trial, and HyperBandForBOHB stops the trial whose result completes a
            # rung: TuneBOHB never saw the result that decided each rung (measured: 4
            # of 12 full-budget results reached it), so its model started late and
            # learnt from the weaker trials. Pass those results on.
            tune_controller.search_alg.on_trial_result(trial.trial_id, result)
        return decision

    def _process_bracket(self, tune_controller: Any, bracket: Any) -> str:
        # a rung is decided among all the bracket's trials: until the last has been
        # given, the ones at the rung wait (plain HyperBand halved whatever was there)
        if not bracket.filled() and not self._halving_unfilled:
            return self.PAUSE
        return super()._process_bracket(tune_controller, bracket)

    def _unpause_trial(self, tune_controller: Any, trial: Any) -> None:
        super()._unpause_trial(tune_controller, trial)
        _tell_searcher(tune_controller, "on_unpause", trial)

    def _next_in_brackets(self, tune_controller: Any) -> Any:
        """A trial waiting to start, or promoted and paused, in the bracket to go on."""
        if not self._is_bohb:
            return HyperBandScheduler.choose_trial_to_run(self, tune_controller)
        for band in self._hyperbands:
            for bracket in band:
                for trial in bracket.current_trials() if bracket else ():
                    if trial.status == Trial.PENDING or (
                        trial.status == Trial.PAUSED and trial in bracket.trials_to_unpause
                    ):
                        return trial
        return None

    def choose_trial_to_run(self, tune_controller: Any, allow_recurse: bool = True) -> Any:
        trial = self._next_in_brackets(tune_controller)
        active = [t for t in tune_controller.get_trials() if t.status in _ACTIVE]
        if trial is None and not active:
            # Nothing runs or waits, so no trial is coming to fill a bracket (the stage
            # has proposed all it will): decide the rungs among the trials there are.
            self._halving_unfilled = True
            try:
                for band in self._hyperbands:
                    for bracket in band:
                        if bracket and any(
                            t.status == Trial.PAUSED for t in bracket.current_trials()
                        ):
                            self._process_bracket(tune_controller, bracket)
            finally:
                self._halving_unfilled = False
            trial = self._next_in_brackets(tune_controller)
        if (
            trial is not None
            and trial.status == Trial.PAUSED
            and self._max_concurrent
            and len(active) >= self._max_concurrent
        ):
            return None  # it goes on when a running trial pauses or ends
        return trial


@functools.cache
def grace_unit_scheduler(base: type) -> type:
    """`base` (Ray's HyperBandScheduler or HyperBandForBOHB) with GraceUnitMixin's changes."""
    name = f"GraceUnit{base.__name__}"
    return type(name, (GraceUnitMixin, base), {"_is_bohb": issubclass(base, HyperBandForBOHB)})


class BracketState(Callback):
    """Saves a HyperBand's brackets with each of Tune's experiment checkpoints, and gives
    them back to the restored scheduler (Tune calls set_state before it re-adds the
    restored trials, which the scheduler then puts back where they were).

    Without it an interrupted hyperband/bohb stage had to start over: Tuner.restore hands
    the restored trials to a HyperBand as it was made, whose brackets then never fill, and
    its paused trials waited for ever. Tune pickles the scheduler and this callback into
    the stage's tuner.pkl together, so the restored callback holds the restored scheduler;
    `link` makes that explicit."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def get_state(self) -> dict | None:
        return self.scheduler.snapshot()

    def set_state(self, state: dict) -> None:
        self.scheduler.restore(state)

    @staticmethod
    def saved(experiment: Path) -> bool:
        """Whether an interrupted stage's Tune run saved its brackets (not when it was cut
        before Tune's first experiment checkpoint, nor by a version without this)."""
        return any(experiment.glob("callback-states-*.pkl"))

    @staticmethod
    def link(tuner: Any) -> None:
        """Points a restored Tuner's BracketState at the scheduler that Tuner runs (its
        TunerInternal's configs, Ray 2.60)."""
        local = getattr(tuner, "_local_tuner", None)
        scheduler = getattr(getattr(local, "_tune_config", None), "scheduler", None)
        callbacks = getattr(getattr(local, "_run_config", None), "callbacks", None) or []
        for callback in callbacks:
            if isinstance(callback, BracketState) and scheduler is not None:
                callback.scheduler = scheduler


def replay_restored_rungs(tuner: Any, time_attr: str, metric: str) -> int:
    """Gives a restored stage's ASHA the values its trials reported before the interrupt;
    returns how many trials it records.

    Tuner.restore rebuilds the scheduler as it was made, with empty rungs (Ray saves no
    scheduler's state, ray-project/ray#30838): trials that ended before the interrupt
    report nothing again, so the rungs would rank the resumed trials against each other
    only, and a resumed trial past a rung would be recorded there at a later, lower value.
    Replayed under the trials' own ids, each rung holds what an uninterrupted run's would,
    and a resumed trial goes on past the rungs it had passed (Ray's `_Bracket.on_result`
    skips a rung that holds its id). The scheduler is the one the restored Tuner runs
    with (its TunerInternal's TuneConfig, Ray 2.60)."""
    config = getattr(getattr(tuner, "_local_tuner", None), "_tune_config", None)
    scheduler = getattr(config, "scheduler", None)
    if scheduler is None:
        return 0
    rows = []
    for result in tuner.get_results():
        trial_id = (result.metrics or {}).get("trial_id")
        frame = result.metrics_dataframe
        if trial_id is None or frame is None:
            continue
        rows += [{**row, "trial_id": trial_id} for row in frame.to_dict("records")]
    return record_earlier_trials(scheduler, rows, time_attr, metric, own_ids=True)


def record_earlier_trials(
    scheduler: Any, reports: list[dict], time_attr: str, metric: str, own_ids: bool = False
) -> int:
    """Record trials of an earlier run of a stage at the rungs of Ray's ASHA, as if they had
    run under it; returns how many trials were recorded.

    A stage's extension round (sweep/extend.py) is a Tune run of its own. Its ASHA would
    otherwise rank the round's few trials only against each other: the best third of them
    go on to the full budget however far behind the first round they are. Replayed here,
    each rung's cutoff is the one a single ASHA over both rounds would have set. Ray has no
    way to give a scheduler earlier results, so this feeds each report to the bracket's own
    bookkeeping (`_Bracket.on_result`, Ray 2.60), under an id no trial of the round can
    have. Every bracket records every earlier trial (one ASHA over both rounds would have
    given each trial one bracket; with Ray's default of one bracket, that is the same).
    `reports` are a stage's report rows (sweep/results.py), in the order each trial made
    them. Tune pickles the scheduler into the round's tuner.pkl when its Tuner is made, so
    a resumed round (`Tuner.restore`) keeps these records. `own_ids`: record each trial
    under its own id (a restored run's own trials, replay_restored_rungs)."""
    from types import SimpleNamespace

    op = getattr(scheduler, "_metric_op", None)
    brackets = getattr(scheduler, "_brackets", None)
    if op is None or not brackets:
        return 0
    rows_by_trial: dict[str, list[dict]] = {}
    for row in reports:
        rows_by_trial.setdefault(str(row["trial_id"]), []).append(row)
    recorded = 0
    for trial_id, rows in rows_by_trial.items():
        earlier = SimpleNamespace(trial_id=trial_id if own_ids else f"earlier round: {trial_id}")
        for iteration, row in enumerate(rows, 1):
            # a user's function's clock is its report count, which Tune does not keep here
            when = iteration if time_attr == "training_iteration" else row.get(time_attr)
            value = row.get(metric)
            if when is None or not isinstance(value, int | float) or value != value:
                continue
            for bracket in brackets:
                bracket.on_result(earlier, when, op * value)
        recorded += any(earlier.trial_id in r for b in brackets for _, r in b._rungs)
    return recorded
