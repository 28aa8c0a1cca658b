"""Where MLflow runs go, and whether that place answers: shared by the tracker and
`python -m sweeper.compare`. Imports neither Ray nor (until needed) MLflow."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from urllib.parse import urlparse

from sweeper.config.errors import ConfigError
from sweeper.text import mask_secrets

PROBE_TIMEOUT_S = 3.0

# MLflow's REST client retries a refused connection for minutes and waits 120 s for an
# answer; our queue retries instead, so each call gets one quick try. Its "View run ... at"
# lines as each run ends would crowd a sweep's output; the last line has the run's page
# instead (ui_hint). A value the user set wins.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


def quick_quiet_calls() -> None:
    """HTTP_DEFAULTS, and no INFO lines when MLflow creates a SQLite store's tables (its
    warnings and errors still show)."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)


def resolve_tracking_uri(uri: str | None) -> str:
    """`uri`, or MLflow's own default (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the
    working directory), with a relative SQLite path made absolute so it names one file."""
    if not uri:
        import mlflow

        uri = mlflow.get_tracking_uri()
    uri, path = str(uri), sqlite_path(str(uri))
    if path and path != ":memory:" and not path.startswith("/"):
        uri = "sqlite:///" + os.path.abspath(path)
    return uri


def shown(uri: str) -> str:
    """`uri` for the console, logs and files: a password in it (`postgresql://me:pw@host/db`,
    `https://me:pw@host`, `?token=...`) becomes ***."""
    return mask_secrets(uri)


def is_http(uri: str) -> bool:
    return urlparse(uri).scheme in ("http", "https")


def ui_hint(uri: str, experiment_id: str, run_id: str) -> str:
    """Where to see a run: its page on a tracking server, or the command that serves a
    local store in the MLflow UI."""
    if is_http(uri):
        return f"; in the MLflow UI: {shown(uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"; mlflow ui --backend-store-uri {shown(uri)}"


def sqlite_path(uri: str) -> str | None:
    prefix = "sqlite:///"
    return uri[len(prefix) :] if uri.startswith(prefix) else None


SWEEP_HINT = "start it, or set mlflow.tracking_uri to another store, or mlflow.enabled=false"


def check_reachable(uri: str, timeout: float = PROBE_TIMEOUT_S, hint: str = SWEEP_HINT) -> None:
    """A tracking server that does not answer within `timeout`, or answers but not as
    MLflow's REST API does, is a ConfigError (one line). An auth error (401, 403) passes:
    the first real call names it."""
    if not is_http(uri):
        return
    import requests

    try:
        answer = requests.get(
            uri.rstrip("/") + "/api/2.0/mlflow/experiments/get-by-name",
            params={"experiment_name": "Default"},
            timeout=timeout,
        )
    except requests.RequestException as error:
        reason = type(error).__name__
        if isinstance(error, requests.ConnectionError) and "refused" in str(error).lower():
            reason = "connection refused"
        raise ConfigError(
            f"MLflow tracking server {shown(uri)} is unreachable ({reason}): {hint}"
        ) from None
    if answer.status_code not in (401, 403) and not speaks_mlflow(answer):
        raise ConfigError(
            f"{shown(uri)} answers (HTTP {answer.status_code}), but not as an MLflow tracking "
            "server does: another service on that port? check the URI's host and port"
        )


def speaks_mlflow(answer) -> bool:
    """An MLflow server answers its REST API in JSON: the experiment, or an error_code."""
    try:
        body = answer.json()
    except ValueError:
        return False
    return isinstance(body, dict) and ("experiment" in body or "error_code" in body)


def check_store(cfg) -> None:
    """The fail-fast check of `cfg.mlflow` before anything runs or is written."""
    mlflow_cfg = cfg.get("mlflow") or {}
    uri = mlflow_cfg.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    if mlflow_cfg.get("enabled", True) and uri:
        check_scheme(
            str(uri),
            "mlflow.tracking_uri" if mlflow_cfg.get("tracking_uri") else "MLFLOW_TRACKING_URI",
        )
        check_reachable(str(uri))
        check_sqlite_writable(resolve_tracking_uri(str(uri)))
        check_database_driver(str(uri))


def check_config_in_a_process(cfg) -> None:
    """check_store in a process of its own, as a single run checks before it trains: the
    scheme check imports MLflow, which would stay resident in the training process and
    count in a CPU run's peak memory."""
    mlflow_cfg = cfg.get("mlflow") or {}
    uri = mlflow_cfg.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    if not (mlflow_cfg.get("enabled", True) and uri):
        return  # tracking off, or the default store: nothing to import for
    given = {k: mlflow_cfg[k] for k in ("enabled", "tracking_uri") if k in mlflow_cfg}
    proc = subprocess.run(
        [sys.executable, "-m", "sweeper.tracking.mlflow_store"],
        input=json.dumps(given),
        capture_output=True,
        text=True,
    )
    if proc.returncode == 2:
        raise ConfigError(proc.stderr.strip())
    if proc.returncode != 0:  # not the user's mistake: the logger will say what it is
        print(
            f"note: the MLflow store was not checked: {proc.stderr.strip()[-300:]}",
            file=sys.stderr,
        )


def check_scheme(uri: str, name: str = "mlflow.tracking_uri") -> None:
    """A URI no MLflow store takes (`sqllite:///x.db`, `foo://bar`) is a ConfigError.
    MLflow's own registry of stores decides, plugins included; it is not public API, so
    where it has moved the check is left to the tracker, inside the job."""
    from mlflow.exceptions import MlflowException

    scheme = urlparse(uri).scheme
    if scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() != "true":
        # MLflow 3 refuses to open its file store unless the variable opts in
        raise ConfigError(
            f"{name}={shown(uri)}: MLflow's file store is retired (it refuses to open one "
            "unless MLFLOW_ALLOW_FILE_STORE=true); use a database, e.g. sqlite:///mlflow.db"
        )
    if scheme == "sqlite" and uri.split(":", 1)[1].strip("/") in ("", ":memory:"):
        # SQLAlchemy's in-memory database: the sweep's record would end with its process
        raise ConfigError(
            f"{name}={shown(uri)} names no database file; write sqlite:///PATH/TO/mlflow.db"
        )
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry

        _tracking_store_registry.get_store_builder(uri)
    except (ImportError, AttributeError):
        return
    except MlflowException:
        schemes = sorted(s for s in getattr(_tracking_store_registry, "_registry", {}) if s)
        raise ConfigError(
            f"{name}={shown(uri)}: MLflow has no store for this URI (schemes: {', '.join(schemes)})"
        ) from None


def check_database_driver(uri: str) -> None:
    """A database store whose SQLAlchemy driver is not installed (psycopg for postgresql://,
    by default) is a ConfigError. Making an engine imports the driver and connects nowhere."""
    if urlparse(uri).scheme.split("+")[0] not in ("postgresql", "mysql", "mssql"):
        return
    import sqlalchemy

    try:
        sqlalchemy.create_engine(uri)
    except (ImportError, sqlalchemy.exc.NoSuchModuleError) as error:
        raise ConfigError(
            f"mlflow.tracking_uri={shown(uri)}: its database driver is not installed ({error})"
        ) from None


def check_sqlite_writable(uri: str) -> None:
    """A SQLite store where no file can be made is a ConfigError (MLflow would retry for a
    minute, then fail with a traceback): probed in the nearest folder that exists."""
    path = sqlite_path(uri)
    if not path or path == ":memory:":
        return
    if os.path.isdir(path):
        raise ConfigError(f"mlflow.tracking_uri={uri}: {path} is a directory, not a database file")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ConfigError(
            f"mlflow.tracking_uri={uri}: cannot write in {folder} "
            f"({error.strerror or type(error).__name__})"
        ) from None


def get_or_create_experiment(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name)
        except MlflowException:  # created meanwhile by another sweep
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage != "active":
        raise ConfigError(
            f"MLflow experiment '{name}' is deleted: restore it, or set mlflow.experiment=NAME"
        )
    return experiment.experiment_id


if __name__ == "__main__":  # check_config_in_a_process's child: the mlflow section on stdin
    try:
        check_store({"mlflow": json.load(sys.stdin)})
    except ConfigError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
