"""MLflow tracking of a sweep, from the Ray driver.

One parent run per sweep (tag run_dir) and one child run per trial (tags stage, trial_id;
mlflow.parentRunId), plus one for the baseline. A Tune callback per stage turns trial events
into queued calls (`mlflow_queue`): no Ray worker talks to MLflow, no global active run.

A trial's run ends FINISHED (completed), KILLED (pruned, interrupted) or FAILED (diverged,
failed; the `status` tag tells which). A trial paused and resumed by Hyperband/BOHB, retried
or restored by `sweep.resume=true` keeps its one run, found again by its tags.
"""

from __future__ import annotations

import atexit
import json
import re
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweeper.config.errors import ConfigError
from sweeper.config.paths import PACKAGE_DIR
from sweeper.config.sweep import flatten, flatten_params
from sweeper.files import write_json_atomic
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.space import to_builtin
from sweeper.sweep.state import STATE_NAME
from sweeper.sweep.trainable import RUNG_METRIC, UPDATE_RATIO_COLUMNS, trial_config
from sweeper.tracking.mlflow_queue import OpQueue, finite, is_number, short_error
from sweeper.tracking.mlflow_store import (
    check_reachable,
    get_or_create_experiment,
    quick_quiet_calls,
    resolve_tracking_uri,
    shown,
    ui_hint,
)
from sweeper.train.activations import ACTIVATION_COLUMNS

# why: mlflow_callback imports Ray's Tune; a single run (run_tracker) shares this module's
# helpers and imports no Ray, so the callback is imported where a sweep uses it
if TYPE_CHECKING:
    from sweeper.tracking.mlflow_callback import MlflowCallback

# sweep settings a stage may set for itself, the sweep's being its default
STAGE_DEFAULTS = ("search", "scheduler", "reports_per_trial")
METRICS = (
    "train_loss",
    "val_bpb",
    "lr",
    "grad_norm",
    "grad_norm_max",
    *UPDATE_RATIO_COLUMNS,
    *ACTIVATION_COLUMNS,
    "tokens",
    "flops",
    "tokens_per_s",
    "mfu",
    "peak_memory_gib",
    "params",  # N of the scaling fits, on every run that has one
    RUNG_METRIC,  # what ASHA, HyperBand and BOHB ranked, where rungs fork a cooled copy
    "fork_flops",
)
# what sweeper's trial wrapper adds to a report: not a user's function's own numbers
TRIAL_KEYS = ("wall_time", RUNG_METRIC)
RUN_STATUS = {
    "completed": "FINISHED",
    "pruned": "KILLED",
    "interrupted": "KILLED",
    "diverged": "FAILED",
    "failed": "FAILED",
}
PENDING_NAME = "mlflow_pending.jsonl"
RUN_FILE = "mlflow_run.json"  # the run dir's own MLflow run (sweeper.compare reads it)
PARENT = "sweep"
PARENT_FILES = ("report.html", "report.md", "summary.json", "reports.csv", "fit.json")


class QueuedRun:
    """What a sweep's tracker and a single run's share: the run dir's own MLflow run (the
    sweep's parent, or the single run), opened at the start, and the queue of calls."""

    finished = False

    def _start(self, mlflow_cfg, out: Path, key: str, open_op: dict, sweep: bool) -> int:
        """Opens the run now (raises: for a sweep, a ConfigError that names the store), writes
        mlflow_run.json, starts the queue. Returns how many calls an earlier driver kept."""
        from mlflow import MlflowClient

        self.uri = resolve_tracking_uri(mlflow_cfg.get("tracking_uri"))
        self.experiment = str(mlflow_cfg.get("experiment") or "sweeper")
        if sweep:
            check_reachable(self.uri)
        quick_quiet_calls()
        try:
            client = MlflowClient(self.uri)  # a fresh SQLite file is migrated here, once
            self.experiment_id = get_or_create_experiment(client, self.experiment)
            self.queue = OpQueue(client, self.experiment_id, out / PENDING_NAME, self.uri)
            kept = self.queue.load_pending()
            self.queue.apply_now(open_op)
        except Exception as error:
            if not sweep or isinstance(error, ConfigError):
                raise
            raise ConfigError(f"MLflow store {shown(self.uri)}: {short_error(error)}") from None
        self.run_id = self.queue.run_id(key)
        out.mkdir(parents=True, exist_ok=True)
        # no password in the run dir: sweeper.compare asks for it where one was masked
        where = {"tracking_uri": shown(self.uri), "experiment": self.experiment}
        write_json_atomic(
            out / RUN_FILE, {**where, "experiment_id": self.experiment_id, "run_id": self.run_id}
        )
        self.queue.start()
        atexit.register(self._at_exit)
        return kept

    def _close(self, where: str, resend: str = "", say_dropped: bool = False) -> None:
        """Sends what is queued; says what could not be sent, and where the run is."""
        left = self.queue.close()
        stats = self.queue.stats()
        if left:
            print(
                f"[mlflow] {left} MLflow calls could not be sent to {shown(self.uri)} "
                f"({stats['last_error']}); kept in {self.queue.pending_path}{resend}",
                flush=True,
            )
        if say_dropped and stats["dropped"]:
            print(f"[mlflow] {stats['dropped']} MLflow calls were refused by the store")
        print(f"[mlflow] {where}{ui_hint(self.uri, self.experiment_id, self.run_id)}", flush=True)


class MlflowTracker(QueuedRun):
    def __init__(self, plan: SweepPlan, out_dir, announce: bool = True):
        self.plan, self.spec, self.out = plan, plan.spec, Path(out_dir).resolve()
        self.base = plan.base
        self.users_function = plan.target is not None
        self.commit, dirty = git_commit()
        self.common = {"sweep": self.spec.name, "run_dir": str(self.out), "git_commit": self.commit}
        self.open: set[str] = set()
        self.retries: dict[str, int] = {}
        self.ended: dict[str, str] = {}  # run key -> the status it was ended with
        kept = self._start(plan.mlflow, self.out, PARENT, self._parent_op(dirty), sweep=True)
        from sweeper.tracking.mlflow_callback import LIVE

        LIVE[str(self.out)] = self
        self.announcement = (
            f"[mlflow] sweep run {self.run_id} in {shown(self.uri)} (experiment '{self.experiment}')"
            + (f"; {kept} calls kept from an earlier run are sent first" if kept else "")
        )
        if announce:
            self.announce()

    def announce(self) -> None:
        """The line that says where this sweep's runs go."""
        print(self.announcement, flush=True)

    # --- the engine's interface --------------------------------------------------------
    def stage_callbacks(self, stage: str, base: dict, ctx: Any, search: str, scheduler: str):
        from sweeper.tracking.mlflow_callback import MlflowCallback

        return [MlflowCallback(str(self.out), stage, base, ctx, search, scheduler)]

    def log_baseline(self, baseline: dict, config: dict | None = None) -> None:
        """The baseline's run; `config`: what it trained, else the base config."""
        status = baseline.get("status") or "completed"
        tags = {**self.common, "role": "baseline", "stage": "baseline", "status": status}
        if baseline.get("error"):
            tags["error"] = str(baseline["error"])[:500]
        # logged after the stages, it ran in a slot a stage left idle: its run shows when it
        # trained, and its values at its last step, as a trial's do
        started, ended = baseline.get("started_ms"), baseline.get("ended_ms")
        opened = self._open_op(
            "baseline", "baseline", {"role": "baseline"}, tags, config or self.base
        )
        self.queue.put({**opened, "start_time": started})
        values = {self.spec.metric: baseline.get("value"), **baseline}
        values = {k: v for k, v in values.items() if k not in ("started_ms", "ended_ms", "steps")}
        self._metrics("baseline", values, step=int(baseline.get("steps") or 0), at=ended)
        self._end("baseline", status, end_time=ended)

    def finish(self, summary: dict, out_dir: Any, status: str = "FINISHED") -> None:
        if self.finished:
            return
        self.finished = True
        default = "pruned" if status == "FINISHED" else "interrupted"  # a trial left open
        for key in sorted(self.open):
            self._end(key, default)
        out, metric = Path(out_dir), self.spec.metric
        best, baseline = summary.get("best") or {}, summary.get("baseline") or {}
        confirmation = summary.get("confirmation") or {}
        values = {
            f"best_{metric}": best.get("value"),
            f"baseline_{metric}": baseline.get("value"),
            "improvement": summary.get("improvement"),
            # sweep.confirm_seeds: the same over fresh seeds, and its spread
            "confirm_improvement_mean": confirmation.get("improvement_mean"),
            "confirm_improvement_std": confirmation.get("improvement_std"),
            "trials": summary.get("trials"),
            "total_flops": summary.get("total_flops"),
            "elapsed_s": summary.get("elapsed_s"),
        }
        # a resume that ran more trials logs a new step; one that only confirmed or fitted
        # updates the same step
        self._metrics(PARENT, values, step=int(summary.get("trials") or 0), latest=True)
        files = [out / name for name in PARENT_FILES] + sorted(out.glob("*.png"))
        files = [[str(path), None] for path in files if path.is_file()]
        if files:
            self.queue.put({"op": "artifacts", "run": PARENT, "files": files})
        # the sweep state has the last word on a trial's status (a stage stopped by the time
        # cap), also for the runs a killed driver left RUNNING
        recorded = recorded_statuses(out)
        for key, value in recorded.items():
            if key in self.ended and self.ended[key] != value:
                self._end(key, value)
        statuses = {key: [value, RUN_STATUS[value]] for key, value in recorded.items()}
        close = {"op": "close_children", "run": PARENT, "statuses": statuses}
        self.queue.put({**close, "default": [default, RUN_STATUS[default]]})
        if best:
            self.queue.put({"op": "tags", "run": PARENT, "tags": {"best": json.dumps(best)[:5000]}})
        parent_status = {"FINISHED": "completed", "KILLED": "interrupted"}.get(status, "failed")
        end = {"op": "end", "run": PARENT, "status": status, "end_time": now_ms()}
        self.queue.put({**end, "tags": {"status": parent_status}})
        from sweeper.tracking.mlflow_callback import LIVE

        LIVE.pop(str(self.out), None)
        self._close(
            f"sweep run {self.run_id} in {shown(self.uri)}: compare its trials with "
            f"python -m sweeper.compare {self.out}",
            resend=": the next `sweep.resume=true` in this run dir sends them",
            say_dropped=True,
        )

    # --- trial events (from MlflowCallback, on the driver's thread) -----------------------
    def trial_started(self, cb: MlflowCallback, trial) -> None:
        key = trial_key(cb.stage, trial)
        if key in self.open:  # a paused trial resumed by Hyperband/BOHB: same run
            return
        self.open.add(key)
        params = to_builtin(dict(trial.config or {}))
        tags = {
            **self.common,
            "role": "trial",
            "search": cb.search,
            "scheduler": cb.scheduler,
            "status": "running",
            "sampled": ", ".join(sorted(params)),
        }
        match = {"role": "trial", "stage": cb.stage, "trial_id": trial.trial_id}
        config = trial_config(params, cb.base, cb.ctx)
        self.queue.put(self._open_op(key, f"{cb.stage}-{trial.trial_id}", match, tags, config))

    def trial_result(self, cb: MlflowCallback, trial, result: dict) -> None:
        key = trial_key(cb.stage, trial)
        if key not in self.open:
            self.trial_started(cb, trial)
        result = to_builtin(dict(result))
        step = result.get("step")
        if not is_number(step):
            step = result.get("training_iteration") or 0
        self._metrics(key, result, step=int(step))

    def trial_ended(self, cb: MlflowCallback, trial, status: str, error: str = "") -> None:
        key = trial_key(cb.stage, trial)
        if key not in self.open:
            self.trial_started(cb, trial)
        tags = {"error": error[:500]} if error else {}
        if reused := (trial.last_result or {}).get("reused_from"):
            tags["reused_from"] = str(reused)  # replayed, not trained
        if status == "diverged":  # the why of a diverged trial, on its run
            tags["reason"] = str((trial.last_result or {}).get("reason") or "non-finite metric")
        self._end(key, status, tags)

    def trial_retried(self, cb: MlflowCallback, trial) -> None:
        key = trial_key(cb.stage, trial)
        self.retries[key] = self.retries.get(key, 0) + 1
        self.queue.put({"op": "tags", "run": key, "tags": {"retries": self.retries[key]}})

    def stage_ended(self, cb: MlflowCallback, trials) -> None:
        """Trials Tune left running, paused or pending (Ctrl+C) end as interrupted; a
        resumed stage reopens them."""
        from sweeper.tracking.mlflow_callback import final_status

        for trial in trials:
            if trial_key(cb.stage, trial) in self.open:
                self.trial_ended(cb, trial, final_status(trial))

    # --- ops -----------------------------------------------------------------------------
    def _open_op(self, key: str, name: str, match: dict, tags: dict, config: dict) -> dict:
        if not self.users_function:
            config = vocab_as_trained(config)
        return open_op(key, name, match, {**tags, **match}, config, parent=PARENT)

    def _metrics(
        self, key: str, values: dict, step: int, at: int | None = None, latest: bool = False
    ) -> None:
        """A trial's run gets the training metrics, or every number a user's function
        reported; the sweep and baseline runs every number they are given."""
        trial = key not in (PARENT, "baseline")
        if not trial:
            names = list(values)
        elif self.users_function:
            from ray.tune.result import AUTO_RESULT_KEYS  # the trial's driver runs Tune

            added = {*AUTO_RESULT_KEYS, *TRIAL_KEYS, "step"}
            names = [self.spec.metric, *(k for k in values if k not in added)]
        else:
            names = [self.spec.metric, *METRICS]
        if trial and values.get("status") == "diverged":
            # why: the searcher's penalty stands where the metric was not finite; it is no
            # measurement, and one 1e9 point flattens the UI's chart of every trial
            names = [n for n in names if n not in (self.spec.metric, RUNG_METRIC)]
        rows = metric_rows(values, [n for n in names if n != "value"], step, at)
        if rows:
            self.queue.put({"op": "metrics", "run": key, "metrics": rows, "latest": latest})

    def _end(
        self, key: str, status: str, tags: dict | None = None, end_time: int | None = None
    ) -> None:
        self.open.discard(key)
        self.ended[key] = status
        end = {"op": "end", "run": key, "status": RUN_STATUS.get(status, "FAILED")}
        self.queue.put(
            {**end, "end_time": end_time or now_ms(), "tags": {"status": status, **(tags or {})}}
        )

    def _parent_op(self, dirty: bool) -> dict:
        spec = self.spec
        tags = {**self.common, "role": "sweep", "status": "running", "git_dirty": str(dirty)}
        if self.commit != "unknown":
            tags["mlflow.source.git.commit"] = self.commit
        settings = asdict(spec)
        settings.pop("stages"), settings.pop("resume")
        for key in STAGE_DEFAULTS:
            # why: the sweep's value is only the default of a stage that sets none; where
            # every stage sets its own, it would name a search that never ran
            if all(stage.get(key) for stage in self.plan.definition["stages"]):
                settings.pop(key)
        params = params_of(settings)
        for stage in spec.stages:
            prefix = param_key(f"stage.{stage.name}")
            for name in ("search", "scheduler", "num_samples", "reports_per_trial", "lr_rule"):
                params[f"{prefix}.{name}"] = str(getattr(stage, name))
            params[f"{prefix}.space"] = json.dumps(to_builtin(flatten_params(stage.params)))
        match = {"role": "sweep", "run_dir": str(self.out)}
        # a new sweep in a reused run dir gets a new run; sweep.resume=true finds its own
        op = open_op(PARENT, run_name(spec.name, self.out), match, {**tags, **match}, None)
        return {**op, "create": not spec.resume, "params": params}

    def _at_exit(self) -> None:
        if not self.finished:  # the sweep died outside the engine's own handling
            self.finish({}, self.out, status="FAILED")


# --- helpers ------------------------------------------------------------------------------
def open_op(key, name, match, tags, config, parent=None, create=False) -> dict:
    """The op that finds or creates run `key` (tags `match`) with `config` as its params."""
    op = {"op": "open", "run": key, "parent": parent, "create": create, "name": name}
    op.update(match=match, tags=tags)
    if config is not None:
        op.update(params=params_of(config), text={"config.yaml": config_yaml(config)})
    return op


def params_of(config: dict) -> dict[str, str]:
    return {param_key(k): "null" if v is None else str(v) for k, v in flatten(config).items()}


def metric_rows(values: dict, names, step: int, at: int | None = None) -> list[list]:
    """[name, value, step, time] of each of `names` whose value is a finite number (NaN and
    inf would not plot) and a name MLflow takes."""
    return [
        [name, float(values[name]), step, at or now_ms()]
        for name in dict.fromkeys(names)
        if finite(values.get(name)) and metric_name_taken(name)
    ]


def recorded_statuses(out: Path) -> dict[str, str]:
    """stage/trial_id -> status of every trial in the finished stages of the sweep state."""
    try:
        state = json.loads((out / STATE_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return {
        f"{stage['name']}/{record['trial_id']}": record["status"]
        for stage in state.get("stages", [])
        for record in stage.get("records", [])
        if record.get("status") in RUN_STATUS
    }


def trial_key(stage: str, trial) -> str:
    return f"{stage}/{trial.trial_id}"


def vocab_as_trained(config: dict) -> dict:
    """model.vocab_size null is the data's, as a single run's params record it, so that
    MLflow's diff of a trial and its reproduced run shows no false difference."""
    model, data = config.get("model") or {}, config.get("data") or {}
    if model.get("vocab_size") is not None or data.get("vocab_size") is None:
        return config
    return {**config, "model": {**model, "vocab_size": data["vocab_size"]}}


def now_ms() -> int:
    return int(time.time() * 1000)


def param_key(key: str) -> str:
    """MLflow accepts letters, digits and `_-./ :` in names (and at most 250 of them)."""
    return re.sub(r"[^\w\-./ :]", "_", str(key))[:250]


def config_yaml(config: dict) -> str:
    import yaml

    try:
        return yaml.safe_dump(to_builtin(config), sort_keys=False, default_flow_style=False)
    except yaml.YAMLError:
        return json.dumps(config, indent=2, default=str)


TAKEN_NAMES: set[str] = set()
REFUSED_NAMES: set[str] = set()  # said once each


def metric_name_taken(name: str) -> bool:
    """Whether MLflow takes `name` as a metric's name (a user's function may report `acc@1`):
    it refuses a batch with one bad name whole. MLflow's own check decides; it is not public
    API, so where it has moved the store does."""
    if name in TAKEN_NAMES:
        return True
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.utils.validation import _validate_metric_name
    except ImportError:
        return True
    try:
        _validate_metric_name(name)
        TAKEN_NAMES.add(name)
        return True
    except MlflowException as error:
        if name not in REFUSED_NAMES:
            REFUSED_NAMES.add(name)
            print(f"[mlflow] metric {name!r} is not logged: {short_error(error)}", flush=True)
        return False


def run_name(sweep: str, out: Path) -> str:
    """smoke-2026-11-22_04-25-12 for Hydra's dated run dirs, run-2026-11-22_04-25-12-3 for
    job 3 of a dated `--multirun` (every multirun has a job 0), smoke-my_sweep otherwise."""
    date = r"\d{4}-\d{2}-\d{2}"
    if re.fullmatch(date, out.parent.name):
        return f"{sweep}-{out.parent.name}_{out.name}"
    if out.name.isdigit() and re.fullmatch(date, out.parent.parent.name):
        return f"{sweep}-{out.parent.parent.name}_{out.parent.name}-{out.name}"
    return f"{sweep}-{out.name}"


def git_commit() -> tuple[str, bool]:
    """HEAD of the repository sweeper's code is in ("unknown" outside one), and whether
    tracked files differ from it."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", *args], cwd=PACKAGE_DIR, capture_output=True, text=True, timeout=5
        )

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return "unknown", False
        status = git("status", "--porcelain", "--untracked-files=no")
        return head.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", False
