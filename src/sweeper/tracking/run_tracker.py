"""MLflow tracking of a single run, in the logger process `run_logger` starts: `python -m
sweeper.tracking.run_tracker` reads the run's events as JSON lines on its stdin.

One MLflow run per run dir (tags role=run, run_dir, git_commit), in the sweeps' store and
experiment, so a run made by hand sits beside the trials it came from. Params: the run
config, flattened; metrics: each evaluation's figures at its step; at the end result.json,
curves.png and its status. `trainer.resume=true` goes on in the same run. A user's function
run once is tracked the same way: every number it reports, tag `trainable`. The calls go
through the sweeps' queue (`mlflow_queue`), so a dead server never holds up the reading.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sweeper.tracking.mlflow_queue import is_number, short_error
from sweeper.tracking.mlflow_store import shown
from sweeper.tracking.mlflow_tracker import (
    METRICS,
    RUN_STATUS,
    QueuedRun,
    git_commit,
    metric_rows,
    now_ms,
    open_op,
    run_name,
)

RUN = "run"  # the queue's key of this run
RUN_FILES = ("result.json", "curves.png")


class RunTracker(QueuedRun):
    def __init__(
        self, mlflow_cfg, run_config: dict, out_dir, resume: bool, trainable: str | None = None
    ):
        self.out = Path(out_dir).resolve()
        commit, dirty = git_commit()
        match = {"role": "run", "run_dir": str(self.out)}
        tags = {**match, "git_commit": commit, "git_dirty": str(dirty), "status": "running"}
        if trainable:
            tags["trainable"] = trainable
        if commit != "unknown":
            tags["mlflow.source.git.commit"] = commit
        # sweeper's training reports its figures at their step; a user's function what it
        # likes, with or without a step (its report's count, then)
        self.users_function, self.reports, self.resumed = bool(trainable), 0, resume
        # a resumed run goes on in its own MLflow run
        op = open_op(RUN, run_name(RUN, self.out), match, tags, run_config, create=not resume)
        self._start(mlflow_cfg, self.out, RUN, op, sweep=False)

    def report(self, metrics: dict) -> None:
        """One evaluation's figures, at its optimizer step; a user's function's numbers, at
        its `step` or its report's count."""
        self.reports += 1
        step = metrics.get("step")
        if not is_number(step):
            step = self.reports
        names = [k for k in metrics if k != "step"] if self.users_function else METRICS
        rows = metric_rows(metrics, names, int(step))
        if rows:
            self.queue.put({"op": "metrics", "run": RUN, "metrics": rows})

    def finish(self, status: str, result: dict | None = None) -> None:
        """Ends the run with `status`: the evaluations not logged yet (any a DDP run's queue
        lost), its files, then the status."""
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
        self._close(f"run {self.run_id} in {shown(self.uri)} (experiment '{self.experiment}')")

    def _at_exit(self) -> None:
        if not self.finished:  # the run died outside run_job's own handling
            self.finish("failed")


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
