"""Driver-side Tune callbacks: the progress display and the sweep-wide FLOP cap."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from pathlib import Path

from ray import tune

from sweeper.config.schema import load_run_config
from sweeper.sweep.results import error_summary
from sweeper.sweep.space import to_builtin
from sweeper.sweep.stages import sweep_run
from sweeper.train.budget import planned_flops

# seconds without a progress line, while trials run, after which one is printed anyway: a
# stage's first trial can take minutes on a slow CPU, and silence reads as a hang
HEARTBEAT_S = 60.0


class ProgressCallback(tune.Callback):
    """One line per finished trial, and one after `heartbeat` seconds without a line while
    trials run: done (pruned, diverged, failed), running, paused, best so far, ETA. The ETA
    is the training left at the rate trained since the stage's first trial started, counted
    in trials, or given `costs` (`GridCosts`) in compute, as a grid over budgets or model
    sizes has trials 10x apart in cost. A running trial counts by how far along its budget
    it is (`clock`: the time axis and a trial's budget on it), or two trials started at
    once would count as none trained."""

    def __init__(
        self,
        stage: str,
        planned: int,
        metric: str,
        mode: str,
        costs: GridCosts | None = None,
        clock: tuple[str, float] | None = None,
        heartbeat: float | None = None,  # null: HEARTBEAT_S
        scheduler: str = "fifo",
    ):
        self.stage, self.planned, self.metric, self.mode = stage, planned, metric, mode
        self.costs, self.clock, self.scheduler = costs, clock, scheduler
        self.unclocked = False  # a report without the clock was named once
        self.heartbeat = HEARTBEAT_S if heartbeat is None else heartbeat
        self.started = self.last_line = time.time()
        # when the stage's first trial started: the ETA's rate is the training done since
        # then, so Ray starting its workers (~6-8 s here) is not taken for training time
        self.first_trial_started: float | None = None
        self.counts = {"completed": 0, "pruned": 0, "diverged": 0, "failed": 0}
        self.replayed = 0  # done, but in no time: left out of the rate the ETA uses
        # each trial's best value so far: a trial that diverges takes its earlier values
        # with it, as the stage's table ranks it nowhere
        self.values: dict[str, float] = {}
        # the last value of each trial that trained its whole budget: once there is one,
        # the best is among these, as the stage's table picks it (stages.pick_best). A
        # value at fewer tokens (a paused or pruned trial's rung) is not comparable.
        self.finished: dict[str, float] = {}
        self.counted: set[str] = set()  # trials whose end is in `counts`
        self.look_back = False  # at the next step: count the trials that ended before it

    def setup(self, **info):
        """Tune calls this as each run of the stage starts. A resumed stage (Tuner.restore)
        runs with the callback pickled when the stage first started: its clock starts
        again now, and the trials that ended in the earlier run are counted at the first
        step, as done in no time."""
        self.started = self.last_line = time.time()
        self.first_trial_started = None
        self.look_back = True

    @property
    def best(self) -> float | None:
        pool = self.finished or self.values
        if not pool:
            return None
        return (min if self.mode == "min" else max)(pool.values())

    def on_trial_start(self, iteration, trials, trial, **info):
        # Tune calls this once the trial's actor is up, not when it asks Ray for one
        if self.first_trial_started is None:
            self.first_trial_started = time.time()

    def on_trial_result(self, iteration, trials, trial, result, **info):
        clock = self.clock[0] if self.clock else None
        if self.scheduler != "fifo" and clock not in result and not self.unclocked:
            self.unclocked = True
            print(
                f"[{self.stage}] trial {trial.trial_id}'s reports hold no `{clock}`, the "
                f"{self.scheduler} scheduler's time axis: it cannot rank them, and they train "
                f"their whole budget. Report {clock} with each result, or set "
                f"sweep.budget.{clock}_per_trial=null to count reports instead",
                flush=True,
            )
        if result.get("status") == "diverged":
            self.values.pop(trial.trial_id, None)
            return
        self._keep(trial.trial_id, result.get(self.metric))

    def _keep(self, trial_id: str, value) -> bool:
        """Keeps `value` as the trial's best so far where it is one; whether it is a value."""
        if not isinstance(value, int | float) or not math.isfinite(value):
            return False
        known = self.values.get(trial_id)
        if known is None or (value < known if self.mode == "min" else value > known):
            self.values[trial_id] = value
        return True

    def on_trial_complete(self, iteration, trials, trial, **info):
        if trial.trial_id in self.counted:  # Tune ends some restored trials a second time
            return
        if source := (trial.last_result or {}).get("reused_from"):
            self.replayed += 1
            print(
                f"[{self.stage}] trial {trial.trial_id} repeats the run {source} trained "
                "(the config this stage starts from): its reports are replayed, not trained "
                "again",
                flush=True,
            )
        self._finish(trial, trials, self._ending(trial))

    def _ending(self, trial) -> str:
        """completed | pruned | diverged, from the trial's last result (and its value kept)."""
        result = trial.last_result or {}
        status = result.get("status")
        if status == "diverged":
            self.values.pop(trial.trial_id, None)
            return status
        if status != "completed":
            status = "completed" if status is None and result.get("done") else "pruned"
        value = result.get(self.metric)
        if self._keep(trial.trial_id, value) and status == "completed":
            self.finished[trial.trial_id] = value
        return status

    def on_trial_error(self, iteration, trials, trial, **info):
        if trial.trial_id in self.counted:
            return
        self._finish(trial, trials, "failed")
        error_file = Path(trial.local_path or ".") / "error.txt"
        reason = _error_line(error_file)
        print(
            f"[{self.stage}] trial {trial.trial_id} FAILED after its retries: {reason} "
            f"(full error: {error_file}; worker logs: Ray's session logs)",
            flush=True,
        )

    def on_step_end(self, iteration, trials, **info):
        if self.look_back:
            self.look_back = False
            for trial in trials:
                ended = trial.status in (trial.TERMINATED, trial.ERROR)
                if ended and trial.trial_id not in self.counted:
                    ending = "failed" if trial.status == trial.ERROR else self._ending(trial)
                    self._count(trial, ending)
                    self.replayed += 1
        # Tune calls this after each step of its loop (many a second): a clock check only
        if time.time() - self.last_line >= self.heartbeat and any(
            t.status == t.RUNNING for t in trials
        ):
            self._line(trials, finished=None)

    def _count(self, trial, status: str) -> None:
        self.counts[status] += 1
        self.counted.add(trial.trial_id)

    def _finish(self, trial, trials, status: str) -> None:
        self._count(trial, status)
        self._line(trials, finished=trial)

    def _line(self, trials, finished) -> None:
        """The progress line; `finished`: the trial whose end it reports (Tune may not
        have marked it ended yet), or None for a heartbeat."""
        # read from Tune's own trial states: HyperBand and BOHB pause trials between rungs,
        # and a paused trial holds no CPU, so it is not "running"
        rest = [t for t in trials if t is not finished]
        running = sum(t.status == t.RUNNING for t in rest)
        paused = sum(t.status == t.PAUSED for t in rest)
        done = sum(self.counts.values())
        now = time.time()
        elapsed = now - self.started
        training = now - (self.first_trial_started or self.started)
        trained = done + sum(self._along(t) for t in rest if t.status in (t.RUNNING, t.PAUSED))
        left = max(self.planned - trained, 0)
        took_time = trained - self.replayed
        eta = training / took_time * left if took_time > 0 else None
        if self.costs is not None:
            try:
                eta = self.costs.eta(trials, finished, training) or eta
            except Exception:  # an exception in a Tune callback ends the sweep: not for an ETA
                self.costs = None
        endings = ", ".join(f"{n} {k}" for k, n in self.counts.items() if n and k != "completed")
        best = f"{self.best:.4f}" if self.best is not None else "-"
        if self.best is not None and not self.finished:
            best += " (unfinished)"  # no trial has trained its whole budget yet
        # before any trial has reported, nothing says how long one takes
        left_text = f"~{eta:.0f}s left" if eta is not None else "time left once a trial reports"
        print(
            f"[{self.stage}] {done}/{self.planned} trials done"
            f"{f' ({endings})' if endings else ''}, {running} running"
            f"{f', {paused} paused' if paused else ''} | "
            f"best {self.metric} {best} | {elapsed:.0f}s elapsed, {left_text}",
            flush=True,
        )
        self.last_line = time.time()

    def _along(self, trial) -> float:
        """How far along its budget an unfinished trial is, 0 to 1 (0 without a clock)."""
        if self.clock is None:
            return 0.0
        attr, budget = self.clock
        value = (trial.last_result or {}).get(attr)
        if not isinstance(value, int | float) or not budget > 0:
            return 0.0
        return min(max(float(value) / budget, 0.0), 1.0)


# run dir -> what to start in the first trial slot a stage leaves idle (the baseline run's
# launch), looked up rather than held: Tune pickles its callbacks into tuner.pkl, and a
# resumed stage gets copies that must start the live driver's baseline, once
IDLE_WORK: dict[str, Callable[[str], None]] = {}


class MarksStopped(tune.Callback):
    """Writes status "pruned" into the result on which a scheduler or a stopper ended a
    user's function before its budget (`clock`: the stage's time attribute and budget),
    as a user's function, unlike sweeper's training, reports no status. Tune calls
    callbacks with a stopped trial's result (which becomes its last result) but not with
    the one it makes when a function returns, so a `done` seen here is a stop; one at the
    budget (ASHA's stop at max_t) is a run that trained it all."""

    def __init__(self, clock: tuple[str, float]):
        self.clock = clock

    def on_trial_result(self, iteration, trials, trial, result, **info):
        time_attr, budget = self.clock
        if result.get("done") and "status" not in result and result.get(time_attr, 0) < budget:
            result["status"] = "pruned"


class IdleSlot(tune.Callback):
    """Starts the sweep's work outside Tune (`IDLE_WORK`: the baseline) the first time the
    stage leaves a slot idle that it will not fill: fewer trials run than the cluster has
    slots for, and no trial waits to start (pending, paused between rungs, not yet made)
    or sweep.concurrency holds them back. Any earlier, it would take a slot from the stage's
    trials; any later, a slot stays idle and the baseline takes one from the next stage."""

    def __init__(self, run_dir: str, stage: str, planned: int, slots: int, concurrency=None):
        self.run_dir, self.stage, self.planned, self.slots = run_dir, stage, planned, slots
        self.concurrency = concurrency or math.inf

    def on_step_end(self, iteration, trials, **info):
        if self.run_dir not in IDLE_WORK:
            return
        running = sum(t.status == t.RUNNING for t in trials)
        waiting = len(trials) < self.planned or any(
            t.status in (t.PENDING, t.PAUSED) for t in trials
        )
        if running < self.slots and not (waiting and running < self.concurrency):
            IDLE_WORK.pop(self.run_dir)(f"in the slot stage '{self.stage}' leaves idle")


class GridCosts:
    """Each trial's planned training FLOPs, for a grid stage of sweeper's own training,
    whose trials are all known before they run. The ETA is then the compute still to train
    (the unseen trials' plans, the running trials' rest) at the rate trained so far, over
    the trials' own reported FLOPs: a pruned trial leaves none of its plan behind."""

    def __init__(self, base: dict, fixed: dict, grid: dict[str, list]):
        self.base = base
        self.plans: dict[str, float] = {}  # by trial id
        self.total = sum(
            self.of({**fixed, **dict(zip(grid, values))})
            for values in itertools.product(*grid.values())
        )

    def of(self, params: dict) -> float:
        return planned_flops(load_run_config(sweep_run(self.base, to_builtin(dict(params)))))

    def eta(self, trials, finished, elapsed: float) -> float | None:
        """Seconds left, or None before any FLOPs are reported; `finished`: the trial whose
        end is being reported (Tune may not have marked it ended yet)."""
        trained, left = 0.0, self.total
        for trial in trials:
            if trial.trial_id not in self.plans:
                self.plans[trial.trial_id] = self.of(trial.config)
            plan = self.plans[trial.trial_id]
            result = trial.last_result or {}
            if result.get("reused_from"):  # a replay: its plan is done, in no time
                left -= plan
                continue
            flops = float(result.get("flops") or 0.0)
            trained += flops
            ended = trial is finished or trial.status in (trial.TERMINATED, trial.ERROR)
            left -= plan if ended else min(flops, plan)
        return elapsed / trained * max(left, 0.0) if trained > 0 else None


class FlopCap(tune.Stopper):
    """Stops the sweep once the training FLOPs of all trials (rung cooldown forks included)
    reach `max_flops`."""

    def __init__(self, max_flops: float, already: float = 0.0):
        self.max_flops, self.already = max_flops, already
        self.latest: dict[str, float] = {}

    def __call__(self, trial_id, result) -> bool:
        if result.get("reused_from"):  # a replayed run spends nothing (state.spent_flops)
            return False
        self.latest[trial_id] = float(result.get("flops") or 0.0) + float(
            result.get("fork_flops") or 0.0
        )
        return False

    def stop_all(self) -> bool:
        return self.already + sum(self.latest.values()) >= self.max_flops


def _error_line(path: Path) -> str:
    """The error of a failed trial in one line (results.error_summary of its error.txt)."""
    try:
        return error_summary(path.read_text())
    except OSError:
        return "unknown error"
