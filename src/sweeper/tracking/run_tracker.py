"""MLflow tracking of a single run (`python -m sweeper` without a sweep), in the logger
process `run_logger` starts: `python -m sweeper.tracking.run_tracker` reads the run's
events as JSON lines on its stdin.

One MLflow run per run dir (tags role=run, run_dir, git_commit), in the same store and
experiment as the sweeps, so a run made by hand (a sweep's reproduce line, the run a
scaling fit predicts) sits beside the trials it came from in the MLflow UI. Its params are
the run config, flattened; its metrics the figures of each evaluation, at the step they
were taken; at the end it gets result.json and curves.png, and the status the run ended
with (completed -> FINISHED, diverged and failed -> FAILED, interrupted -> KILLED).
`trainer.resume=true` goes on in the same MLflow run; steps it already has are not logged
twice. A user's function run once (`trainable._target_=...`, a sweep's reproduce line) is
tracked the same way: the tree it is given as params, every number it reports as metrics,
tag `trainable`.

The calls go through the sweeps' background queue (`mlflow_queue`): a slow or dead
tracking server never holds up the logger's reading, and what cannot be sent waits in
`mlflow_pending.jsonl` for the next resume in that run dir. A DDP run's rank 0 sends its
evaluations to the training driver through a Ray queue, and the driver passes them on here.
"""

from __future__ import annotations

import atexit
import json
import math
import sys
from pathlib import Path

from sweeper.config.sweep import flatten
from sweeper.tracking.mlflow_queue import OpQueue, short_error
from sweeper.tracking.mlflow_store import (
    get_or_create_experiment,
    quick_http_calls,
    quiet_store_creation,
    resolve_tracking_uri,
    shown,
    ui_hint,
)
from sweeper.tracking.mlflow_tracker import (
    METRICS,
    PENDING_NAME,
    RUN_STATUS,
    config_yaml,
    git_commit,
    metric_name_taken,
    now_ms,
    param_key,
    param_value,
    run_name,
    write_run_file,
)

RUN = "run"  # the queue's key of this run
RUN_FILES = ("result.json", "curves.png")


class RunTracker:
    def __init__(
        self, mlflow_cfg, run_config: dict, out_dir, resume: bool, trainable: str | None = None
    ):
        from mlflow import MlflowClient

        self.uri = resolve_tracking_uri(mlflow_cfg.get("tracking_uri"))
        quick_http_calls()
        quiet_store_creation()
        self.out = Path(out_dir).resolve()
        self.experiment = str(mlflow_cfg.get("experiment") or "sweeper")
        commit, dirty = git_commit()
        match = {"role": "run", "run_dir": str(self.out)}
        tags = {**match, "git_commit": commit, "git_dirty": str(dirty), "status": "running"}
        if trainable:
            tags["trainable"] = trainable
        # sweeper's training reports its own figures at their step; a user's function
        # reports what it likes, with or without a step (its report's count, then)
        self.users_function, self.reports = bool(trainable), 0
        if commit != "unknown":
            tags["mlflow.source.git.commit"] = commit
        client = MlflowClient(self.uri)  # a fresh SQLite file is migrated here, once
        self.experiment_id = experiment_id = get_or_create_experiment(client, self.experiment)
        self.queue = OpQueue(client, experiment_id, self.out / PENDING_NAME, self.uri)
        self.kept = self.queue.load_pending()
        self.queue.apply_now(
            {
                "op": "open",
                "run": RUN,
                "parent": None,
                "create": not resume,  # a resumed run goes on in its own MLflow run
                "name": run_name(RUN, self.out),
                "match": match,
                "tags": tags,
                "params": {param_key(k): param_value(v) for k, v in flatten(run_config).items()},
                "text": {"config.yaml": config_yaml(run_config)},
            }
        )
        self.run_id = self.queue.run_id(RUN)
        write_run_file(self.out, self.uri, self.experiment, experiment_id, self.run_id)
        self.finished, self.resumed = False, resume
        self.queue.start()
        atexit.register(self._at_exit)

    def report(self, metrics: dict) -> None:
        """One evaluation's figures, at its optimizer step; a user's function's numbers, at
        its `step` or its report's count."""
        self.reports += 1
        step = metrics.get("step")
        if not is_number(step):
            step = self.reports
        names = [k for k in metrics if k != "step"] if self.users_function else METRICS
        rows = []
        for name in names:
            value = metrics.get(name)
            if is_number(value) and math.isfinite(value) and metric_name_taken(name):
                rows.append([name, float(value), int(step), now_ms()])  # NaN/inf: no plot
        if rows:
            self.queue.put({"op": "metrics", "run": RUN, "metrics": rows})

    def finish(self, status: str, result: dict | None = None) -> None:
        """Ends the run with `status` (completed, diverged, failed, interrupted): the
        evaluations not logged yet (any a DDP run's queue lost), its files, then the status."""
        if self.finished:
            return
        self.finished = True
        for metrics in (result or {}).get("history") or []:
            self.report(metrics)  # steps already logged are skipped by the queue
        files = [[str(self.out / name), None] for name in RUN_FILES if (self.out / name).is_file()]
        if files:
            self.queue.put({"op": "artifacts", "run": RUN, "files": files})
        tags = {"status": status}
        for name in ("reason", "error"):
            if (result or {}).get(name):
                tags[name] = str(result[name])[:500]
            elif self.resumed:  # an earlier attempt's (interrupted), which this one ended
                tags[name] = ""
        end = {"op": "end", "run": RUN, "status": RUN_STATUS.get(status, "FAILED")}
        self.queue.put({**end, "end_time": now_ms(), "tags": tags})
        left = self.queue.close()
        if left:
            print(
                f"[mlflow] {left} MLflow calls could not be sent to {shown(self.uri)} "
                f"({self.queue.stats()['last_error']}); kept in {self.queue.pending_path}",
                flush=True,
            )
        ui = ui_hint(self.uri, self.experiment_id, self.run_id)
        print(
            f"[mlflow] run {self.run_id} in {shown(self.uri)} (experiment '{self.experiment}'){ui}",
            flush=True,
        )

    def _at_exit(self) -> None:
        if not self.finished:  # the run died outside run_job's own handling
            self.finish("failed")


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def main() -> None:
    """The logger process of one run: a `start` line, `report` lines, a `finish` line."""
    lines = iter(sys.stdin)
    try:
        start = json.loads(next(lines))["start"]
        tracker = RunTracker(
            start["mlflow"],
            start["run_config"],
            start["out_dir"],
            start["resume"],
            start.get("trainable"),
        )
    except Exception as error:  # the run trains on untracked; its writes to us are dropped
        print(f"note: this run is not logged to MLflow: {short_error(error)}", file=sys.stderr)
        return
    for line in lines:
        message = json.loads(line)
        if "report" in message:
            tracker.report(message["report"])
        elif "finish" in message:
            tracker.finish(**message["finish"])
            return
    tracker.finish("failed", {"error": "the run's process ended without saying how (killed)"})


if __name__ == "__main__":
    main()
