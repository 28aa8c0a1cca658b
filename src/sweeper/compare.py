"""`python -m sweeper.compare [SWEEP]`: a sweep's trials as MLflow has them, best first.
`--runs`: the latest `--last` single runs (`python -m sweeper` without a sweep), best first,
each with the commit it ran; `--plot FILE.png` draws their val_bpb curves (runs_plot.py).

SWEEP is a sweep's name (its latest run), the MLflow run id of a sweep, or its run dir
(default: the latest sweep). The store is --tracking-uri, the one a run dir recorded, or
MLflow's default (sqlite:///mlflow.db in the working directory). Columns: stage, trial,
status, the metric, tokens, peak memory (GiB) and each parameter that differs across trials.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

from sweeper.config.errors import ConfigError, OneLineParser, fail
from sweeper.report.runs_plot import plot_runs
from sweeper.signals import end_quietly_when_output_closes
from sweeper.text import rounded_text
from sweeper.tracking.mlflow_queue import quote, short_error
from sweeper.tracking.mlflow_store import (
    check_reachable,
    check_scheme,
    quick_quiet_calls,
    resolve_tracking_uri,
    shown,
    sqlite_path,
)
from sweeper.train.run_checkpoint import RUN_SETTINGS

RUN_ID = re.compile(r"[0-9a-f]{32}")
MEMORY = "peak_memory_gib"  # shown as "GiB": the most a trial held (runtime.peak_memory_bytes)
BROKEN = ("failed", "diverged")  # trials whose last value is no measurement of the config
NEWEST = ["attributes.start_time DESC"]


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(
        prog="python -m sweeper.compare",
        description="Compare a sweep's trials from MLflow, sorted by the sweep's metric.",
    )
    parser.add_argument(
        "sweep", nargs="?", help="sweep name, sweep run id or run dir (default: the latest)"
    )
    parser.add_argument("--tracking-uri", help="MLflow store (default: sqlite:///mlflow.db)")
    parser.add_argument("--experiment", help="only this MLflow experiment (default: all)")
    parser.add_argument(
        "--runs", action="store_true", help="the single runs instead of a sweep's trials"
    )
    parser.add_argument(
        "--last", type=int, metavar="N", help="with --runs: the latest N (default 20)"
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", help="with --runs: their val_bpb curves on one axis, in FILE"
    )
    args = parser.parse_args(argv)
    end_quietly_when_output_closes()
    try:
        if args.runs and args.sweep:
            raise ConfigError(f"--runs lists the single runs: leave out '{args.sweep}'")
        if args.last is not None and not args.runs:
            raise ConfigError(
                f"--last {args.last} counts the single runs: add --runs (a sweep's table has "
                "all its trials)"
            )
        last = 20 if args.last is None else args.last
        if last < 1:
            raise ConfigError(f"--last must be >= 1, got {last}")
        if args.plot is not None:
            check_plot_path(args.plot, args.runs)
        if args.runs:
            print(compare_runs(args.tracking_uri, args.experiment, last, args.plot))
        else:
            print(compare(args.sweep, args.tracking_uri, args.experiment))
    except ConfigError as error:
        fail(str(error))
    except Exception as error:  # the store's own failure (a file that is no database)
        fail(f"MLflow store: {type(error).__name__}: {short_error(error)}")


def compare(sweep: str | None, tracking_uri: str | None, experiment: str | None) -> str:
    if sweep and os.sep in sweep and not Path(sweep).is_dir():  # a path, not a sweep's name
        raise ConfigError(f"{sweep}: no such directory (name a sweep's run dir, name or run id)")
    run_dir = Path(sweep) if sweep and Path(sweep).is_dir() else None
    recorded = _recorded(run_dir) if run_dir else {}
    named_by = None if tracking_uri or not recorded.get("tracking_uri") else run_dir
    if not tracking_uri and "***" in recorded.get("tracking_uri", ""):
        # the run dir keeps no password: the user's environment holds it, or they pass it
        tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not tracking_uri:
            raise ConfigError(
                f"{run_dir} was logged to {recorded['tracking_uri']}, whose password is not "
                "kept: pass --tracking-uri with it, or set MLFLOW_TRACKING_URI"
            )
    client, uri = _client(tracking_uri or recorded.get("tracking_uri"), named_by)
    experiments = _experiments(client, experiment)
    parent = _find_sweep(client, experiments, sweep, run_dir, recorded.get("run_id"))
    if parent.data.tags.get("role") == "run":  # a single run has no trials to compare
        raise ConfigError(
            f"{sweep} is a single run (MLflow run {parent.info.run_id}), not a sweep: "
            "`python -m sweeper.compare --runs` lists it with the other single runs"
        )
    return _render(parent, _children(client, parent), uri)


def check_plot_path(plot: str, runs: bool) -> None:
    """--plot names a PNG that can be written, and goes with --runs (a sweep draws its own
    learning_curves.png)."""
    if not runs:
        raise ConfigError(
            f"--plot {plot} draws the single runs' curves: add --runs (a sweep's run dir "
            "has its trials' curves in learning_curves.png)"
        )
    path = Path(plot)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--plot {plot}: name a .png file")
    folder = path.parent.resolve()
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        where = "is a directory" if path.is_dir() else f"cannot be written in {folder}"
        raise ConfigError(f"--plot {plot}: {where}")
    existed = path.exists()
    try:  # as root, os.access allows what the file system may still refuse (/proc)
        path.open("ab").close()
    except OSError as error:
        raise ConfigError(f"--plot {plot}: cannot be written ({error.strerror})") from None
    if not existed:
        path.unlink()


def compare_runs(
    tracking_uri: str | None, experiment: str | None, last: int, plot: str | None = None
) -> str:
    """The latest `last` single runs, best val_bpb first; with `plot`, their curves there."""
    client, uri = _client(tracking_uri)
    experiments = _experiments(client, experiment)
    with _reading():
        runs = client.search_runs(
            experiments, "tags.role = 'run'", order_by=NEWEST, max_results=last
        )
    if not runs:
        raise ConfigError("no single runs in the MLflow store (python -m sweeper logs one)")
    table = _render_runs(runs, uri)
    if plot is None:
        return table
    varied = _varied_keys(runs)
    values = {r.info.run_id: {k: _param(r.data.params.get(k)) for k in varied} for r in runs}
    drawn = plot_runs(client, runs, values, Path(plot))
    return f"{table}\nval_bpb curves of {drawn} of them -> {plot}"


@contextlib.contextmanager
def _reading():
    """The store's own errors while reading it, as one line."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(f"cannot read the MLflow store: {short_error(error)}") from None


def _recorded(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "mlflow_run.json").read_text())
    except (OSError, ValueError):
        return {}


def _client(tracking_uri: str | None, named_by: Path | None = None):
    """A client of the store; `named_by`: the run dir whose mlflow_run.json named it."""
    from mlflow import MlflowClient

    uri = resolve_tracking_uri(tracking_uri)
    check_scheme(uri, "--tracking-uri" if tracking_uri else "MLFLOW_TRACKING_URI")
    path = sqlite_path(uri)
    if path is not None and not Path(path).is_file():
        if named_by is not None:  # the sweep ran against a store that has moved or gone
            raise ConfigError(
                f"no MLflow store at {path}, where {named_by}/mlflow_run.json says the sweep "
                "logged: pass --tracking-uri if it has moved"
            )
        raise ConfigError(
            f"no MLflow store at {path}: run a sweep or a run in this directory first, "
            "or pass --tracking-uri"
        )
    check_reachable(uri, hint="is it running? (or pass another --tracking-uri)")
    quick_quiet_calls()
    return MlflowClient(uri), uri


def _experiments(client, name: str | None) -> list[str]:
    with _reading():
        if not name:
            return [e.experiment_id for e in client.search_experiments()]
        found = client.get_experiment_by_name(name)
        if found is None:
            raise ConfigError(f"no MLflow experiment '{name}'")
        return [found.experiment_id]


def _find_sweep(client, experiments, sweep, run_dir, recorded_id):
    """The sweep's parent run, by the run id its run dir recorded, its run dir, a run id (a
    trial's: its parent), its name, or the latest."""
    found = []
    with _reading():
        if recorded_id:
            return client.get_run(recorded_id)
        where = f"tags.sweep = {quote(sweep)}" if sweep else ""
        if run_dir is not None:
            where = f"tags.run_dir = {quote(str(run_dir.resolve()))}"
        elif sweep and RUN_ID.fullmatch(sweep):
            run, where = _run_or_none(client, sweep), None  # None: said below, as for a name
            parent = run and run.data.tags.get("mlflow.parentRunId")
            if run is not None:
                return (
                    client.get_run(parent)
                    if run.data.tags.get("role") != "sweep" and parent
                    else run
                )
        if where is not None:
            clauses = " and ".join(c for c in ("tags.role = 'sweep'", where) if c)
            found = client.search_runs(experiments, clauses, order_by=NEWEST, max_results=1)
    if found:
        return found[0]
    if sweep:
        raise ConfigError(
            f"no sweep '{sweep}' in the MLflow store: give a sweep's name, its MLflow run id "
            "or its run dir"
        )
    raise ConfigError(
        "no sweep in the MLflow store yet: run one (python -m sweeper +sweep=smoke), "
        "or see its single runs with --runs"
    )


def _run_or_none(client, run_id: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def _children(client, parent) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(
            [parent.info.experiment_id],
            f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
            max_results=1000,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _render(parent, children: list, uri: str) -> str:
    params, tags = parent.data.params, parent.data.tags
    metric, mode = params.get("metric", "val_bpb"), params.get("mode", "min")
    trials = [r for r in children if r.data.tags.get("role", "trial") == "trial"]
    baselines = [r for r in children if r.data.tags.get("role") == "baseline"]
    keys = sorted({k for r in trials for k in r.data.params})
    varied = [k for k in keys if len({r.data.params.get(k) for r in trials}) > 1]

    def status(run) -> str:
        return run.data.tags.get("status", run.info.status.lower())

    def value(run) -> float | None:
        # why: as in the stage tables, a failed trial's last value is from a broken run, and
        # a diverged one's was the searcher's penalty (logged by older sweeps)
        return None if status(run) in BROKEN else run.data.metrics.get(metric)

    def order(run):
        v = value(run)
        ranked = 0.0 if v is None else (v if mode == "min" else -v)
        return (v is None, ranked, run.data.tags.get("trial_id", run.info.run_name))

    memory = any(MEMORY in r.data.metrics for r in trials)  # a user's function may log none
    header = ["stage", "trial", "status", metric, "tokens", *["GiB"] * memory, *varied]
    rows = [
        [
            r.data.tags.get("stage", "-"),
            r.data.tags.get("trial_id", r.info.run_name),
            status(r),
            _number(value(r), ".4f"),
            _number(r.data.metrics.get("tokens"), ",.0f"),
            *[_number(r.data.metrics.get(MEMORY), ".2f")] * memory,
            *(_param(r.data.params.get(k)) for k in varied),
        ]
        for r in sorted(trials, key=order)
    ]
    lines = [
        f"sweep '{tags.get('sweep', '?')}' run {parent.info.run_id} "
        f"({tags.get('status', parent.info.status.lower())}), {len(trials)} trials, "
        f"sorted by {metric} ({mode}) | {shown(uri)}",
        *(_table(header, rows) if rows else ["no trials logged yet"]),
    ]
    for run in baselines:
        lines.append(
            f"baseline (unmodified config): {metric} {_number(run.data.metrics.get(metric), '.4f')}"
        )
    return "\n".join(lines)


def _render_runs(runs: list, uri: str) -> str:
    metric = "val_bpb"

    def order(run):
        value = run.data.metrics.get(metric)
        return (value is None, 0.0 if value is None else value)

    varied = _varied_keys(runs)
    # runs of users' functions (a sweep's reproduce line) beside sweeper's own training
    trainables = {r.data.tags.get("trainable", "sweeper") for r in runs}
    ran = ["trainable"] if len(trainables) > 1 else []
    header = ["run", "started", "commit", "status", metric, "tokens", "GiB", *ran, *varied]
    rows = []
    for r in sorted(runs, key=order):
        tags = r.data.tags
        dirty = "*" if tags.get("git_dirty") == "True" else ""
        rows.append(
            [
                r.info.run_name,
                time.strftime("%Y-%m-%d %H:%M", time.localtime(r.info.start_time / 1000)),
                tags.get("git_commit", "unknown")[:7] + dirty,
                tags.get("status", r.info.status.lower()),
                _number(r.data.metrics.get(metric), ".4f"),
                _number(r.data.metrics.get("tokens"), ",.0f"),
                _number(r.data.metrics.get(MEMORY), ".2f"),
                *(tags.get("trainable", "sweeper") for _ in ran),
                *(_param(r.data.params.get(k)) for k in varied),
            ]
        )
    title = f"the latest {len(runs)} single runs" if len(runs) > 1 else "the latest single run"
    head = f"{title}, sorted by {metric}; commit * = uncommitted changes | {shown(uri)}"
    return "\n".join([head, *_table(header, rows)])


def _table(header: list, rows: list[list]) -> list[str]:
    """The header and rows, each column right-aligned to its widest cell."""
    table = [header, *rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    return ["  ".join(str(cell).rjust(width) for cell, width in zip(row, widths)) for row in table]


def _varied_keys(runs: list) -> list[str]:
    """The config keys whose values differ between the runs, less what only says how a
    run ran (threads, checkpointing)."""
    keys = sorted({k for r in runs for k in r.data.params})
    return [
        k
        for k in keys
        if len({_param(r.data.params.get(k)) for r in runs}) > 1 and k not in RUN_SETTINGS
    ]


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _param(value: str | None) -> str:
    if value is None:
        return "-"
    try:
        number = float(value)
    except ValueError:
        return value
    return str(int(number)) if number.is_integer() and abs(number) < 1e6 else rounded_text(number)


if __name__ == "__main__":
    sys.exit(main())
