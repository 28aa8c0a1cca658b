"""The MLflow calls of a sweep or a run, sent in order by one background thread, so that a
slow or dead tracking server never holds up training.

Why not MLflow's own async logging (3.17): it keeps failed batches only in memory, retries
them only through urllib3 (minutes, with its defaults) and then drops them with a log line,
sends batches on 10 threads in no order, and cannot create or find a run. It would lose data
through a server outage and could not keep one run per trial across a resume.

Each call is an *op*: a JSON-able dict that names its run by a local key ("sweep",
"lr/3f2a1_00000", "baseline"), since the MLflow run may not exist yet. A transient failure
(no answer, a timeout, a 5xx) keeps the op at the head of the queue, retried with backoff
up to MAX_BACKOFF_S; a call the store refuses (a 4xx) is dropped with a warning. While the
server is down the queue is mirrored to the run dir's `mlflow_pending.jsonl`; what is left
when the queue closes stays there, and the next driver in that run dir sends it first.

Every op is idempotent, so a retry after an ambiguous failure duplicates nothing: a run is
looked up by its tags before one is created; (metric, step) pairs a run already has are
skipped, read back from the store after a failure or when a run is reopened (an op marked
`latest` logs a changed value at a logged step again); params, tags, status and artifacts
are the same when set twice.
"""

from __future__ import annotations

import collections
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

MAX_BACKOFF_S = 15.0
# a run's metrics wait this long at the head of the queue, so that its reports meanwhile go
# in one log_batch call: each call costs the driver CPU that the trials share
METRICS_LINGER_S = 1.0
CLOSE_ATTEMPTS = 2  # tries of the head call once the queue closes, before giving up
MAX_PARAM_LENGTH = 6000


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def finite(value) -> bool:
    """A number MLflow can plot (not a bool, NaN or inf)."""
    return is_number(value) and math.isfinite(value)


def is_transient(error: BaseException) -> bool:
    """Worth retrying: no answer, a timeout, a 5xx or 429; not a 4xx or a bug here."""
    from mlflow.exceptions import MlflowException

    if isinstance(error, MlflowException):
        code = error.get_http_status_code()
        return not (400 <= code < 500) or code in (408, 429)
    if isinstance(error, OSError):  # requests' errors, a file being written
        return True
    try:
        from sqlalchemy.exc import OperationalError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(error, OperationalError)  # "database is locked"


def short_error(error: BaseException) -> str:
    """One short line: what went wrong, without urllib3's nested reprs."""
    text = str(error)
    lowered = text.lower()
    for needle, reason in (
        ("refused", "connection refused"),
        ("remotedisconnected", "connection lost"),
        ("connection aborted", "connection lost"),
        ("connection reset", "connection lost"),
        ("timed out", "timed out"),
        ("timeout", "timed out"),
        ("name or service not known", "unknown host"),
    ):
        if needle in lowered:
            return reason
    # SQLAlchemy appends the statement and a link to its docs
    text = text.split("[SQL:")[0].split("(Background on this error")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0][:200] if lines else "") or type(error).__name__


def chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def quote(value: str) -> str:
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def earlier(key: str) -> str:
    """The key of a run an earlier driver's kept ops log to (OpQueue.load_pending)."""
    return f"{key}@earlier"


class OpQueue:
    def __init__(self, client, experiment_id: str, pending_path: Path, where: str = "", say=print):
        self.client, self.experiment_id, self.where = client, experiment_id, where
        self.pending_path = Path(pending_path)
        self.say = say
        self.ops: collections.deque[dict] = collections.deque()
        self.cond = threading.Condition()
        self.run_ids: dict[str, str] = {}
        # run key -> metric -> logged step -> its latest value
        self.seen: dict[str, dict[str, dict[int, float]]] = {}
        self.checked: dict[str, set[str]] = {}  # suspect run -> metrics read back since
        self.dropped = self.close_failures = 0
        self.failures = 0  # consecutive failed tries of the head op
        self.retry_at, self.down_since, self.last_error = 0.0, None, ""
        self.mirroring = False  # the pending file mirrors the queue until it is drained
        self.closing = False
        self.thread: threading.Thread | None = None

    # --- the driver's side -----------------------------------------------------------
    def load_pending(self) -> int:
        """Queues first the ops an earlier driver left in the pending file. They go to the
        runs that driver logged to, under keys of their own: this driver's runs of the same
        key may be new runs."""
        if not self.pending_path.is_file():
            return 0
        count = 0
        with open(self.pending_path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a killed driver
                    continue
                if "runs" in item:
                    self.run_ids.update({earlier(k): v for k, v in item["runs"].items()})
                    continue
                for field in ("run", "parent"):
                    if item.get(field):
                        item[field] = earlier(item[field])
                self.ops.append(item)
                count += 1
        for key in self.run_ids:
            self.suspect(key)
        self.mirroring = count > 0  # the file goes once they are sent
        return count

    def start(self) -> None:
        self.thread = threading.Thread(target=self._work, name="mlflow-log", daemon=True)
        self.thread.start()

    def put(self, op: dict) -> None:
        if op["op"] == "metrics":
            op = {**op, "queued": time.time()}  # it lingers from then (METRICS_LINGER_S)
        with self.cond:
            self.ops.append(op)
            if self.mirroring:  # a driver killed now still leaves every unsent call
                with open(self.pending_path, "a") as f:
                    f.write(json.dumps(op) + "\n")
            self.cond.notify_all()

    def close(self, timeout: float = 120.0) -> int:
        """Sends what is queued (a dead server gets CLOSE_ATTEMPTS quick tries), then stops
        the worker. Returns how many ops are left: written to the pending file."""
        with self.cond:
            self.closing = True
            self.retry_at = 0.0  # try again now, not after the backoff
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout)
        with self.cond:
            left = len(self.ops)
            if left:
                self._write_pending()
            elif self.pending_path.is_file():
                self.pending_path.unlink()
            return left

    def run_id(self, key: str) -> str | None:
        return self.run_ids.get(key)

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return {"left": len(self.ops), "dropped": self.dropped, "last_error": self.last_error}

    # --- the worker ------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.ops and not self.closing:
                    self.cond.wait()
                if not self.ops:
                    return
                wait = self.retry_at - time.monotonic()
                if wait > 0:
                    self.cond.wait(wait)
                    continue
                head = self.ops[0]
                if head["op"] == "metrics" and not self.closing and not self.failures:
                    wait = head.get("queued", 0.0) + METRICS_LINGER_S - time.time()
                    if wait > 0:
                        self.cond.wait(wait)
                        continue
                    self._merge_head_metrics()
                op = self.ops[0]
            error = None
            try:
                self.apply_now(op)
            except Exception as exc:
                error = exc
            with self.cond:
                if error is None or not is_transient(error):
                    self.ops.popleft()
                    if error is not None:
                        self._drop(op, error)
                    if self.down_since is not None:
                        self._recovered()
                    if self.mirroring and not self.ops:
                        self.mirroring = False
                        self.pending_path.unlink(missing_ok=True)
                    self.failures = 0
                    continue
                self._failed(op, error)
                if self.closing:
                    self.close_failures += 1
                    if self.close_failures >= CLOSE_ATTEMPTS:
                        return

    def _merge_head_metrics(self) -> None:
        """Folds the head run's later metric ops into the head op. Ops of other runs keep
        their order; nothing moves past a non-metrics op of the same run (or of no run), nor
        past one that treats logged steps otherwise (`latest`)."""
        head = self.ops[0]
        run, merged, rest = head["run"], list(head["metrics"]), []
        ops = list(self.ops)[1:]
        for i, op in enumerate(ops):
            if (
                op.get("run") == run
                and op["op"] == "metrics"
                and bool(op.get("latest")) == bool(head.get("latest"))
            ):
                merged.extend(op["metrics"])
            elif op.get("run") in (run, None):
                rest.extend(ops[i:])
                break
            else:
                rest.append(op)
        if len(rest) < len(ops):
            self.ops = collections.deque([{**head, "metrics": merged}, *rest])

    def _failed(self, op: dict, error: Exception) -> None:
        self.failures += 1
        self.last_error = short_error(error)
        backoff = min(2.0 ** (self.failures - 1), MAX_BACKOFF_S)
        self.retry_at = time.monotonic() + (min(backoff, 0.5) if self.closing else backoff)
        if op.get("run"):
            self.suspect(op["run"])
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.say(
                f"[mlflow] logging to {self.where or 'MLflow'} failed ({self.last_error}): "
                f"training goes on; the calls are kept, retried, and mirrored to "
                f"{self.pending_path}"
            )
        self._write_pending()

    def _recovered(self) -> None:
        seconds = time.monotonic() - (self.down_since or time.monotonic())
        self.down_since = None
        self.say(f"[mlflow] logging works again after {seconds:.0f}s; sending the kept calls")

    def _drop(self, op: dict, error: Exception) -> None:
        self.dropped += 1
        if self.dropped <= 3:
            message = f"{op.get('op')} {op.get('run')}: {short_error(error)}"
            self.say(f"[mlflow] a call was refused and dropped: {message}")

    def suspect(self, key: str) -> None:
        """The run's logged steps must be read back from the store before the next batch."""
        self.checked[key] = set()

    # --- the pending file (callers hold self.cond) ------------------------------------
    def _write_pending(self) -> None:
        self.mirroring = True
        tmp = self.pending_path.with_name(f".{self.pending_path.name}.tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps({"runs": self.run_ids}) + "\n")
            for op in self.ops:
                f.write(json.dumps(op) + "\n")
        os.replace(tmp, self.pending_path)

    # --- the calls -------------------------------------------------------------------
    def apply_now(self, op: dict) -> None:
        """Makes the op's calls on the calling thread; raises what they raise."""
        getattr(self, "_op_" + op["op"])(op)

    def _id(self, key: str) -> str:
        run_id = self.run_ids.get(key)
        if run_id is None:
            raise KeyError(f"run '{key}' was never opened")
        return run_id

    def _log(self, run_id: str, params: dict | None = None, tags: dict | None = None) -> None:
        from mlflow.entities import Param, RunTag

        for part in chunks([Param(k, v) for k, v in (params or {}).items()], 100):
            self.client.log_batch(run_id, params=part)
        for part in chunks([RunTag(k, str(v)) for k, v in (tags or {}).items()], 100):
            self.client.log_batch(run_id, tags=part)

    def _op_open(self, op: dict) -> None:
        """Finds the run (by its tags, under its parent) or creates it; logs what it lacks."""
        key = op["run"]
        parent = self._id(op["parent"]) if op.get("parent") else None
        match = dict(op.get("match") or {})
        tags = dict(op.get("tags") or {})
        if parent:
            tags["mlflow.parentRunId"] = parent
        params = {k: str(v)[:MAX_PARAM_LENGTH] for k, v in (op.get("params") or {}).items()}
        run = None if op.get("create") else self._find(match, parent)
        if run is None:
            run_id = self._create(key, op, {**tags, **match})
            self._log(run_id, params)
        else:
            run_id = run.info.run_id
            self._reopen(key, run)
            self._log(run_id, {k: v for k, v in params.items() if k not in run.data.params}, tags)
        for name, text in (op.get("text") or {}).items():
            self.client.log_text(run_id, text, name)
        self.run_ids[key] = run_id

    def _find(self, match: dict, parent: str | None):
        """The latest run with the `match` tags under `parent`, or None."""
        clauses = [f"tags.`{k}` = {quote(v)}" for k, v in sorted(match.items())]
        if parent:
            clauses.append(f"tags.`mlflow.parentRunId` = {quote(parent)}")
        found = self.client.search_runs(
            [self.experiment_id],
            filter_string=" and ".join(clauses),
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return found[0] if found else None

    def _create(self, key: str, op: dict, tags: dict) -> str:
        run = self.client.create_run(
            self.experiment_id,
            run_name=op.get("name"),
            tags=tags,
            start_time=op.get("start_time"),  # None: now
        )
        self.seen[key] = {}
        self.checked.pop(key, None)
        return run.info.run_id

    def _reopen(self, key: str, run) -> None:
        from mlflow.entities import RunStatus

        if run.info.status != RunStatus.to_string(RunStatus.RUNNING):
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.suspect(key)  # it may hold metric steps from an earlier driver

    def _op_metrics(self, op: dict) -> None:
        from mlflow.entities import Metric

        key = op["run"]
        run_id = self._id(key)
        seen = self.seen.setdefault(key, {})
        checked = self.checked.get(key)
        batch, batch_keys = [], set()
        for name, value, step, timestamp in op["metrics"]:
            if checked is not None and name not in checked:
                history = sorted(self.client.get_metric_history(run_id, name), key=_when)
                seen.setdefault(name, {}).update((m.step, m.value) for m in history)
                checked.add(name)
            logged = seen.setdefault(name, {})
            step = int(step)
            if (name, step) in batch_keys or (
                step in logged and not (op.get("latest") and logged[step] != float(value))
            ):
                continue
            batch_keys.add((name, step))
            batch.append(Metric(name, float(value), int(timestamp), step))
        for part in chunks(batch, 1000):
            self.client.log_batch(run_id, metrics=part)
        for metric in batch:
            seen[metric.key][metric.step] = metric.value

    def _op_tags(self, op: dict) -> None:
        self._log(op.get("run_id") or self._id(op["run"]), tags=op["tags"])

    def _op_end(self, op: dict) -> None:
        if op.get("tags"):
            self._op_tags(op)
        self.client.set_terminated(self._id(op["run"]), op["status"], op.get("end_time"))

    def _op_close_children(self, op: dict) -> None:
        """Ends the children still RUNNING (a killed driver's), with their status from the
        sweep state where it has one."""
        parent = self._id(op["run"])
        token = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=f"tags.`mlflow.parentRunId` = {quote(parent)} "
                "and attributes.status = 'RUNNING'",
                max_results=1000,
                page_token=token,
            )
            for run in page:
                tags = run.data.tags
                key = f"{tags.get('stage')}/{tags.get('trial_id')}"
                status, run_status = op["statuses"].get(key, op["default"])
                self._log(run.info.run_id, tags={"status": status})
                self.client.set_terminated(run.info.run_id, run_status)
            token = page.token
            if not token:
                return

    def _op_artifacts(self, op: dict) -> None:
        run_id = self._id(op["run"])
        for path, folder in op["files"]:
            if os.path.isfile(path):  # a file gone since (a cleaned run dir): nothing to send
                self.client.log_artifact(run_id, path, folder)


def _when(metric) -> tuple[int, int]:
    """A metric point's place in its history: MLflow's latest value is the one logged last
    at the highest step."""
    return (metric.timestamp, metric.step)
