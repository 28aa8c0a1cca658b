"""MLflow tracking of sweeps: run structure, one run per trial through pauses, retries and
resumes, no lost or duplicated metric step, and a dead tracking server costing seconds."""

from __future__ import annotations

import collections
import csv
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from .conftest import REPO, run_cli
from .conftest import TINY_SWEEP as TINY

TINY_SWEEP = [*TINY, "sweep.stages.1.params.trainer.total_batch_size.grid=[512]"]
# a user's function: seconds per sweep, with knobs in the config's `probe` section
CURVE = ["trainable._target_=tests.tracking_functions.curve", "sweep.stages.0.scheduler=fifo"]
STATUSES = {"completed", "pruned", "diverged", "failed"}
RUN_STATUS = {"completed": "FINISHED", "pruned": "KILLED", "diverged": "FAILED", "failed": "FAILED"}


# --- fixtures and helpers ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path, port: int) -> subprocess.Popen:
    """`mlflow server` on a loopback port, its SQLite file and artifacts under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", MLFLOW_DISABLE_TELEMETRY="true"
    )
    with open(root / "server.log", "a") as log:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"),
                *("--port", str(port), "--workers", "1"),
                *("--backend-store-uri", f"sqlite:///{root}/mlflow.db"),
                *("--artifacts-destination", str(root / "artifacts")),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its uvicorn worker dies with it
        )
    import requests

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, (root / "server.log").read_text()[-2000:]
        try:
            requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except requests.RequestException:
            time.sleep(0.2)
    stop_server(proc)
    raise AssertionError("mlflow server did not start")


def stop_server(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(15)


def wait_for_first_report(probe_dir: Path) -> None:
    """Until a `tracking_functions` trial has reported once (it writes `started`)."""
    deadline = time.monotonic() + 120
    while not (probe_dir / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    port = free_port()
    proc = start_server(tmp_path_factory.mktemp("server"), port)
    yield f"http://127.0.0.1:{port}"
    stop_server(proc)


def sweep(run_dir: Path, *overrides: str) -> dict:
    from sweeper.config.compose import compose
    from sweeper.sweep.preflight import build_plan
    from sweeper.sweep.runner import run_sweep

    run_sweep(build_plan(compose([*TINY_SWEEP, *overrides])), str(run_dir))
    return json.loads((run_dir / "summary.json").read_text())


def logged(uri: str, run_dir: Path):
    """(client, the sweep's parent runs, all their children) in the store at `uri`."""
    from mlflow import MlflowClient

    client, run_dir = MlflowClient(uri), run_dir.resolve()
    experiment = client.get_experiment_by_name("sweeper")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [
        r
        for r in runs
        if r.data.tags.get("role") == "sweep" and r.data.tags.get("run_dir") == str(run_dir)
    ]
    ids = {p.info.run_id for p in parents}
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in ids]
    return client, parents, children


def reported(run_dir: Path, metric: str = "val_bpb") -> dict:
    """(stage, trial id) -> [(step, value)] in the order of reports.csv."""
    rows = collections.defaultdict(list)
    with open(run_dir / "reports.csv") as f:
        for row in csv.DictReader(f):
            if row[metric] not in ("", None):
                rows[(row["stage"], row["trial_id"])].append(
                    (int(float(row["step"])), float(row[metric]))
                )
    return rows


def assert_histories_match(client, children, run_dir: Path, metric: str = "val_bpb") -> None:
    """Every trial's metric history in MLflow holds each reported step exactly once, with
    the value first reported for it (a trial retried from scratch reports steps again)."""
    reports = reported(run_dir, metric)
    trials = [c for c in children if c.data.tags.get("role") == "trial"]
    assert {(c.data.tags["stage"], c.data.tags["trial_id"]) for c in trials} == set(reports)
    for child in trials:
        key = (child.data.tags["stage"], child.data.tags["trial_id"])
        history = client.get_metric_history(child.info.run_id, metric)
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), (key, sorted(steps))  # nothing twice
        first = {}
        for step, value in reports[key]:
            first.setdefault(step, value)
        assert sorted(steps) == sorted(first), key  # nothing lost
        for m in history:
            assert m.value == pytest.approx(first[m.step]), (key, m.step)


def assert_store_holds_the_sweep(uri: str, run_dir: Path, trials: int) -> None:
    """One parent, one run per trial (none RUNNING), every reported step logged once."""
    client, parents, children = logged(uri, run_dir)
    assert_one_run_per_trial_none_running(parents, children, run_dir)
    assert len(children) == trials
    assert_histories_match(client, children, run_dir)


def assert_one_run_per_trial_none_running(parents, children, run_dir: Path) -> None:
    assert len(parents) == 1
    state = json.loads((run_dir / "sweep_state.json").read_text())
    records = {(s["name"], r["trial_id"]): r for s in state["stages"] for r in s["records"]}
    keys = [
        (c.data.tags["stage"], c.data.tags["trial_id"])
        for c in children
        if c.data.tags.get("role") == "trial"
    ]
    assert sorted(keys) == sorted(records)  # exactly one run per trial
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        status = child.data.tags["status"]
        assert status in STATUSES
        assert child.info.status == RUN_STATUS[status]
        key = (child.data.tags.get("stage"), child.data.tags.get("trial_id"))
        if key in records:
            assert status == records[key]["status"]
    assert parents[0].info.status == "FINISHED"


def every_text(run_dir: Path) -> dict[Path, str]:
    return {p: p.read_bytes().decode(errors="replace") for p in run_dir.rglob("*") if p.is_file()}


# --- the engine with the tracker, on Ray ------------------------------------------------
@pytest.mark.slow
def test_a_real_sweep_has_a_parent_and_a_child_per_trial_and_its_uris_password_in_no_output(
    mlflow_server, tmp_path
):
    """A CLI sweep on `mlflow server`, its URI with a password (the server takes any): the
    runs' structure, and the password in no output line, file or MLflow field."""
    secret = "s3cret-pw"
    uri = mlflow_server.replace("http://", f"http://me:{secret}@")
    masked = f"http://me:***@{mlflow_server.removeprefix('http://')}"
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            *TINY_SWEEP,
            "sweep.baseline=true",
            f"mlflow.tracking_uri={uri}",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # no password: in no output line, no file of the run dir, no param or tag
    assert secret not in proc.stdout + proc.stderr
    assert masked in proc.stdout
    texts = every_text(run_dir)
    assert {"report.md", "report.html", "summary.json", "sweep_state.json"} <= {
        p.name for p in texts
    }
    assert [p for p, text in texts.items() if secret in text] == []
    assert "***" in texts[run_dir / "report.md"]  # the launch command, masked
    client, parents, children = logged(mlflow_server, run_dir)
    for run in [*parents, *children]:
        fields = {**run.data.params, **run.data.tags}
        assert [k for k, v in fields.items() if secret in v] == [], run.info.run_name
    report = client.download_artifacts(parents[0].info.run_id, "report.md", str(tmp_path))
    assert secret not in Path(report).read_text()
    assert_one_run_per_trial_none_running(parents, children, run_dir)
    # the baseline's run holds the config it trained: evaluated once, at the end
    (baseline,) = [c for c in children if c.data.tags["role"] == "baseline"]
    assert baseline.data.params["trainer.num_evals"] == "1"
    assert list(baseline.data.metrics) and baseline.info.status == "FINISHED"
    # logged after the stages, it shows when it trained, its value at its last step
    took = baseline.info.end_time - baseline.info.start_time
    assert 0 < took < parents[0].info.end_time - parents[0].info.start_time
    (point,) = client.get_metric_history(baseline.info.run_id, "val_bpb")
    assert point.step == summary["baseline"]["steps"] > 0
    assert "started_ms" not in summary["baseline"]
    children = [c for c in children if c.data.tags["role"] == "trial"]
    # MLflow prints two lines as each of the 4 runs ends; the sweep's last names the parent's page
    out = proc.stdout
    assert "View run" not in out and "View experiment" not in out
    page = f"#/experiments/{parents[0].info.experiment_id}/runs/{parents[0].info.run_id}"
    assert f"; in the MLflow UI: {masked}/{page}" in out
    assert len(children) == summary["trials"] == 3
    parent = parents[0]
    assert parent.data.tags["sweep"] == "smoke" and parent.data.tags["git_commit"]
    assert parent.data.params["stage.lr.search"] == "random"
    assert parent.data.params["stage.lr.scheduler"] == "asha"
    assert parent.data.params["stage.batch_size.scheduler"] == "fifo"
    # both stages set their own search and scheduler: the sweep's defaults governed nothing
    assert "search" not in parent.data.params and "scheduler" not in parent.data.params
    assert (
        parent.data.params["reports_per_trial"] == parent.data.params["stage.lr.reports_per_trial"]
    )
    assert parent.data.metrics["best_val_bpb"] == pytest.approx(summary["best"]["value"])
    assert json.loads((run_dir / "mlflow_run.json").read_text())["run_id"] == parent.info.run_id
    parent_files = {a.path for a in client.list_artifacts(parent.info.run_id)}
    uploaded = {"report.html", "report.md", "summary.json", "reports.csv", "learning_curves.png"}
    assert uploaded | {"fit.json"} <= parent_files

    state = json.loads((run_dir / "sweep_state.json").read_text())
    records = {r["trial_id"]: r for s in state["stages"] for r in s["records"]}
    for child in children:
        tags, params = child.data.tags, child.data.params
        assert {"sweep", "stage", "search", "scheduler", "trial_id", "git_commit"} <= set(tags)
        assert tags["git_commit"] == parent.data.tags["git_commit"]
        record = records[tags["trial_id"]]
        # the trial's whole resolved config, flattened: not only the sampled values
        assert params["model.depth"] == "2" and params["model.seq_len"] == "64"
        assert float(params["trainer.budget_tokens"]) == 8192
        # where and how the trial trained (auto + no GPU share: cpu), as results depend on it
        assert params["trainer.threads"] == "1" and params["trainer.device"] == "cpu"
        for key, value in record["params"].items():
            assert float(params[key]) == pytest.approx(value)
        assert len(params) > 30
        config_file = client.download_artifacts(child.info.run_id, "config.yaml", str(tmp_path))
        assert "matrix_lr" in Path(config_file).read_text()
        assert {"val_bpb", "train_loss", "lr", "tokens", "flops"} <= set(child.data.metrics)
        watched = {"grad_norm", "grad_norm_max", "update_ratio_matrix", "peak_memory_gib"}
        watched |= {"mlp_zero_fraction", "dead_units", "residual_rms", "softcap_saturation"}
        assert watched <= set(child.data.metrics)
    assert_histories_match(client, children, run_dir)
    # reports.csv has the gradient norms too, and MLflow the same values at the same steps
    assert_histories_match(client, children, run_dir, "grad_norm_max")
    assert_histories_match(client, children, run_dir, "update_ratio_matrix")
    assert_histories_match(client, children, run_dir, "peak_memory_gib")
    assert_histories_match(client, children, run_dir, "residual_rms")
    for metric in ("train_loss", "tokens"):
        history = client.get_metric_history(children[0].info.run_id, metric)
        assert len(history) == len({m.step for m in history}) > 0


@pytest.mark.slow
def test_concurrent_trials_lose_no_metric_step(ray_cluster, mlflow_server, tmp_path):
    run_dir = tmp_path / "run"
    sweep(
        run_dir,
        *CURVE,
        f"mlflow.tracking_uri={mlflow_server}",
        "sweep.stages.0.num_samples=4",
        "sweep.concurrency=2",
        "+probe.reports=40",  # 40 results per trial, two trials reporting at once
    )
    assert_store_holds_the_sweep(mlflow_server, run_dir, 5)
    assert all(len(v) == 40 for v in reported(run_dir).values())
    # a user's function's trials log every number it reports (but a name MLflow refuses),
    # and nothing Tune adds
    client, _, children = logged(mlflow_server, run_dir)
    for child in (c for c in children if c.data.tags.get("role") == "trial"):
        assert set(child.data.metrics) == {"val_bpb", "tokens", "lr", "acc"}, child.data.metrics
        accuracy = client.get_metric_history(child.info.run_id, "acc")
        assert sorted((m.step, m.value) for m in accuracy) == [
            (10 * k, pytest.approx(1 - 1 / (k + 1))) for k in range(1, 41)
        ]


@pytest.mark.slow
def test_ctrl_c_leaves_no_run_running_resume_continues_the_same_runs_a_new_sweep_a_new_parent(
    ray_cluster, tmp_path
):
    """Ctrl+C ends every run KILLED; `sweep.resume=true` (also after a SIGKILL left the runs
    RUNNING) continues the parent and each trial's run: restarted trials report their first
    steps again, which are logged once. A new sweep in the same run dir is a new parent."""
    overrides = [
        *TINY_SWEEP,
        *CURVE,
        *("+probe.reports=20", "+probe.sleep=0.5", f"+probe.dir={tmp_path}"),
    ]
    run_dir = tmp_path / "run"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]),
        RAY_USAGE_STATS_ENABLED="0",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "sweeper", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    started = tmp_path / "started"  # a line per trial that has reported (of 20, 0.5 s each)
    while not (started.exists() and len(started.read_text().splitlines()) == 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # Ctrl+C, with both trials under way
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    first = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    client, parents, children = logged(f"sqlite:///{tmp_path}/mlflow.db", run_dir)
    assert len(parents) == 1 and parents[0].info.status == "KILLED"
    assert len(children) == 2
    for child in children:
        assert child.info.status == "KILLED" and child.data.tags["status"] == "interrupted"
    for run in parents + children:  # as a driver killed with SIGKILL would leave them
        client.update_run(run.info.run_id, status="RUNNING")

    from sweeper.config.compose import compose
    from sweeper.sweep.preflight import build_plan
    from sweeper.sweep.runner import run_sweep

    os.chdir(tmp_path)  # the same store as the interrupted driver's
    try:
        run_sweep(build_plan(compose([*overrides, "sweep.resume=true"])), str(run_dir))
        assert json.loads((run_dir / "mlflow_run.json").read_text())["run_id"] == first
        _, parents, _ = logged(f"sqlite:///{tmp_path}/mlflow.db", run_dir)
        assert parents[0].info.run_id == first
        assert_store_holds_the_sweep(f"sqlite:///{tmp_path}/mlflow.db", run_dir, 3)
        # a new sweep (no resume) in the same run dir is a new parent run (no sleeps: quick)
        quick = [o for o in overrides if not o.startswith("+probe.sleep=")]
        run_sweep(build_plan(compose(quick)), str(run_dir))
    finally:
        os.chdir(REPO)
    _, parents, _ = logged(f"sqlite:///{tmp_path}/mlflow.db", run_dir)
    assert len(parents) == 2


@pytest.mark.slow
def test_a_retried_trial_keeps_one_run_in_the_default_store_mlflow_db_in_the_working_dir(
    ray_cluster, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    sweep(
        run_dir,
        "trainable._target_=tests.tracking_functions.fails_once",
        "sweep.stages.0.scheduler=fifo",
        "sweep.max_failures=1",
        f"+probe.dir={tmp_path}",
    )
    assert (tmp_path / "failed_once").is_file()
    assert (tmp_path / "mlflow.db").is_file()  # no tracking URI: the default store
    assert_store_holds_the_sweep(f"sqlite:///{tmp_path}/mlflow.db", run_dir, 3)
    _, _, children = logged(f"sqlite:///{tmp_path}/mlflow.db", run_dir)
    retried = [c for c in children if c.data.tags.get("retries") == "1"]
    assert len(retried) == 1 and retried[0].data.tags["status"] == "completed"
    steps = reported(run_dir)[("lr", retried[0].data.tags["trial_id"])]
    # Ray's record has the retry's repeats (1, 2, 1, 2, 3, 4); reports.csv each report once
    assert [s for s, _ in steps] == [1, 2, 3, 4]


# --- a dead tracking server ------------------------------------------------------------------
@pytest.mark.slow
def test_an_unreachable_server_is_one_line_within_seconds(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    proc = run_cli(["+sweep=smoke", f"mlflow.tracking_uri={uri}"], cwd=tmp_path, timeout=60)
    wall = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and uri in lines[0], proc.stderr
    assert wall < 20
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_port_that_answers_but_not_as_mlflow_does_is_one_line(tmp_path):
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        proc = run_cli(["+sweep=smoke", f"mlflow.tracking_uri={uri}"], cwd=tmp_path, timeout=60)
    finally:
        server.shutdown()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(
        f"error: {uri} answers (HTTP 404), but not as an MLflow tracking server does"
    )
    assert proc.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_server_dying_mid_sweep_costs_seconds_and_keeps_the_calls(
    ray_cluster, tmp_path, capsys, monkeypatch
):
    from sweeper.tracking.mlflow_tracker import MlflowTracker

    finishing = []  # seconds the tracker's finish() took: the stall a dead server causes
    original_finish = MlflowTracker.finish

    def timed_finish(self, *args, **kwargs):
        started = time.monotonic()
        original_finish(self, *args, **kwargs)
        finishing.append(time.monotonic() - started)

    monkeypatch.setattr(MlflowTracker, "finish", timed_finish)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path / "server", port)
    run_dir = tmp_path / "run"
    overrides = [
        *CURVE,
        f"mlflow.tracking_uri={uri}",
        *("+probe.reports=6", "+probe.sleep=0.3", f"+probe.dir={tmp_path}"),
    ]

    def kill_at_first_report():
        wait_for_first_report(tmp_path)
        os.killpg(server.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_at_first_report, daemon=True)
    killer.start()
    try:
        started = time.monotonic()
        sweep(run_dir, *overrides)
        wall = time.monotonic() - started
        killer.join(5)
        assert server.poll() is not None  # it died mid-sweep
        output = capsys.readouterr().out
        # training (3 trials of ~2 s) went on: seconds, where MLflow's own retries of
        # a refused connection take about 4 minutes per call
        # (wall: 55 s of 60 once on a loaded machine; finish() took 0.5 s there)
        assert wall < 150 and finishing[0] < 10, (wall, finishing)
        print(f"dead server: sweep {wall:.1f}s, finish() {finishing[0]:.1f}s")
        pending = run_dir / "mlflow_pending.jsonl"
        kept = len(pending.read_text().splitlines()) - 1  # a header line, then one per call
        assert kept > 0
        assert f"{kept} MLflow calls could not be sent" in output and str(pending) in output

        # the server is back (same port, same database): the next resume sends the rest
        server = start_server(tmp_path / "server", port)
        sweep(run_dir, *overrides, "sweep.resume=true")
        assert not pending.exists()
        client, parents, children = logged(uri, run_dir)
        assert_one_run_per_trial_none_running(parents, children, run_dir)
        assert_histories_match(client, children, run_dir)
    finally:
        stop_server(server, signal.SIGKILL)


@pytest.mark.slow
def test_a_server_stopped_for_30_s_and_restarted_loses_and_repeats_no_step(
    ray_cluster, tmp_path, monkeypatch
):
    from sweeper.tracking.mlflow_callback import MlflowCallback

    longest = [0.0]  # the longest the tracker held Tune's loop: where an outage would stall

    def timed(original):
        def call(self, *args, **kwargs):
            started = time.monotonic()
            original(self, *args, **kwargs)
            longest[0] = max(longest[0], time.monotonic() - started)

        return call

    for name in ("on_trial_start", "on_trial_result", "on_trial_complete"):
        monkeypatch.setattr(MlflowCallback, name, timed(getattr(MlflowCallback, name)))
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path / "server", port)
    run_dir = tmp_path / "run"
    # 2 + 1 trials of 20 reports x 2 s: about 80 s of sweep, the server away for 30 of them
    overrides = [
        *CURVE,
        f"mlflow.tracking_uri={uri}",
        "sweep.stages.0.num_samples=2",
        "sweep.concurrency=2",
        *("+probe.reports=20", "+probe.sleep=2", f"+probe.dir={tmp_path}"),
    ]
    outage = {}

    def stop_then_restart():
        wait_for_first_report(tmp_path)
        stop_server(server, signal.SIGKILL)
        outage["stopped"] = time.monotonic()
        time.sleep(30)
        outage["server"] = start_server(tmp_path / "server", port)
        outage["back"] = time.monotonic()

    chaos = threading.Thread(target=stop_then_restart, daemon=True)
    chaos.start()
    try:
        started = time.monotonic()
        sweep(run_dir, *overrides)
        wall = time.monotonic() - started
        chaos.join(120)
        assert outage["back"] - outage["stopped"] >= 30
        # the server was back before the sweep ended, and the queue caught up by itself
        assert not (run_dir / "mlflow_pending.jsonl").exists()
        client, parents, children = logged(uri, run_dir)
        assert_one_run_per_trial_none_running(parents, children, run_dir)
        assert_histories_match(client, children, run_dir)
        assert all(len(v) == 20 for v in reported(run_dir).values()) and len(children) == 3
        # the outage stalled no trial event: MLflow's own retries of a call to a server
        # that is away take minutes, and the 30 s outage would show here
        assert longest[0] < 10, longest
        # two rounds of 40 s trials; Ray start-up and the end-of-sweep fit and plots are the
        # rest (~125 s in all on a loaded machine): a generous bound, the check is above
        assert wall < 80 + 150, wall
    finally:
        stop_server(outage.get("server", server), signal.SIGKILL)


@pytest.mark.slow
def test_divergence_injected_at_step_k_ends_that_trial_only(ray_cluster, tmp_path):
    """`trainer.nan_at_step=k` poisons the real trainer's loss at step k: that trial ends
    at the report of step k as diverged, with its reason on its MLflow run and a finite
    penalty for the searcher and scheduler; its neighbour trains exactly as it would alone."""
    from sweeper.config.compose import compose
    from sweeper.train.loop import train

    run_dir = tmp_path / "run"
    db = f"sqlite:///{tmp_path}/mlflow.db"
    sweep(
        run_dir,
        f"mlflow.tracking_uri={db}",
        "sweep.stages.0.search=grid",
        "sweep.stages.0.scheduler=asha",
        "~sweep.stages.0.params.optimizer.matrix_lr",
        "+sweep.stages.0.params.trainer.nan_at_step.grid=[3,1000]",
        "sweep.concurrency=2",
        "sweep.rung_cooldown=0.25",  # what ASHA ranks is then a fork's value: logged too
    )
    state = json.loads((run_dir / "sweep_state.json").read_text())
    records = {r["params"]["trainer.nan_at_step"]: r for r in state["stages"][0]["records"]}
    assert records[3]["status"] == "diverged" and "step 3" in records[3]["reason"]
    assert records[1000]["status"] == "completed"
    rows = reported(run_dir)
    steps = {
        records[k]["trial_id"]: [s for s, _ in rows[("lr", records[k]["trial_id"])]]
        for k in (3, 1000)
    }
    # 16 steps, a report every 4: the diverged trial's last report is step 3 itself
    assert steps[records[1000]["trial_id"]] == [4, 8, 12, 16]
    assert steps[records[3]["trial_id"]] == [3]
    assert rows[("lr", records[3]["trial_id"])][-1][1] == pytest.approx(8.0)  # log2(256)

    client, parents, children = logged(db, run_dir)
    assert_one_run_per_trial_none_running(parents, children, run_dir)
    runs = {c.data.tags["trial_id"]: c for c in children}
    diverged = runs[records[3]["trial_id"]]
    assert diverged.info.status == "FAILED" and diverged.data.tags["status"] == "diverged"
    assert "step 3" in diverged.data.tags["reason"] and "nan" in diverged.data.tags["reason"]
    # its one report's val_bpb was the searcher's penalty, not a measurement: not logged
    assert "val_bpb" not in diverged.data.metrics, diverged.data.metrics
    finished = runs[records[1000]["trial_id"]].data.metrics
    assert finished["val_bpb"] == pytest.approx(records[1000]["metric"])
    assert finished["params"] > 0  # N of the scaling fits, on every trial's run
    assert finished["rung_val_bpb"] > 0  # the cooled fork's, at the rung ASHA ranked it

    alone = compose([*TINY_SWEEP, "trainer.budget_tokens=8192", "trainer.num_evals=4"])
    config = {k: alone[k] for k in ("model", "optimizer", "scheduler", "data", "trainer")}
    config["trainer"] = {**config["trainer"], "threads": 1, "checkpoint_every_eval": True}
    result = train(config, verbose=False)
    assert records[1000]["metric"] == pytest.approx(result["val_bpb"], rel=1e-6)


# --- the logging queue against a flaky store (no Ray) ---------------------------------------
class Flaky:
    """An MlflowClient whose calls fail while `down`; with `ambiguous`, a log_batch fails
    AFTER it was written (a timeout on the answer), so a blind retry would duplicate it."""

    def __init__(self, client):
        self.client, self.down, self.ambiguous, self.calls = client, False, 0, 0

    def __getattr__(self, name):
        from mlflow.exceptions import MlflowException

        call = getattr(self.client, name)

        def wrapped(*args, **kwargs):
            self.calls += 1
            if self.down:
                raise MlflowException("API request failed: Connection refused")
            result = call(*args, **kwargs)
            if name == "log_batch" and self.ambiguous and kwargs.get("metrics"):
                self.ambiguous -= 1
                raise MlflowException("API request failed with timeout exception")
            return result

        return wrapped


def test_the_queue_retries_without_losing_or_duplicating_steps(tmp_path):
    from mlflow import MlflowClient

    from sweeper.tracking.mlflow_queue import OpQueue

    real = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = real.create_experiment("sweeper")
    flaky = Flaky(real)
    messages = []
    queue = OpQueue(flaky, experiment, tmp_path / "pending.jsonl", say=messages.append)
    queue.apply_now({"op": "open", "run": "sweep", "name": "p", "match": {"role": "sweep"}})
    queue.start()
    queue.put({"op": "open", "run": "t", "parent": "sweep", "match": {"trial_id": "t"}})

    def report(step):
        queue.put({"op": "metrics", "run": "t", "metrics": [["val_bpb", step / 10, step, 0]]})

    def wait_idle():
        deadline = time.monotonic() + 30
        while queue.stats()["left"] and time.monotonic() < deadline:
            time.sleep(0.05)

    report(1)
    flaky.ambiguous = 2  # steps 2 and 3 are written, but their calls report a failure
    report(2)
    report(3)
    wait_idle()  # each retried after a second's backoff, and skipped: already there
    flaky.down = True  # the server dies: steps 4..6 wait in the queue
    for step in (4, 5, 6):
        report(step)
    time.sleep(1.2)
    assert (tmp_path / "pending.jsonl").is_file()  # mirrored while down
    assert any("failed (connection refused)" in m for m in messages)
    flaky.down = False  # back: the queue drains (at once, when it is closed)
    report(3)  # a retried trial reporting a step again
    report(7)
    queue.put({"op": "end", "run": "t", "status": "FINISHED", "tags": {"status": "completed"}})
    assert queue.close() == 0
    run_id = queue.run_id("t")
    history = real.get_metric_history(run_id, "val_bpb")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6, 7]
    assert real.get_run(run_id).info.status == "FINISHED"
    assert not (tmp_path / "pending.jsonl").exists()


def test_a_runs_queued_metrics_go_out_as_one_call_and_other_runs_keep_their_order(tmp_path):
    from mlflow import MlflowClient

    from sweeper.tracking.mlflow_queue import OpQueue

    real = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = real.create_experiment("sweeper")
    counting = Flaky(real)
    queue = OpQueue(counting, experiment, tmp_path / "pending.jsonl", say=lambda m: None)
    for run in ("a", "b"):
        queue.apply_now({"op": "open", "run": run, "name": run, "match": {"trial_id": run}})
    counting.calls = 0
    queue.start()
    for step in range(1, 11):  # two trials reporting in turn, faster than the linger time
        for run in ("a", "b"):
            value = step / 10 if run == "a" else -step / 10
            queue.put({"op": "metrics", "run": run, "metrics": [["val_bpb", value, step, 0]]})
    queue.put({"op": "end", "run": "a", "status": "FINISHED"})
    queue.put({"op": "metrics", "run": "b", "metrics": [["val_bpb", -1.1, 11, 0]]})
    time.sleep(1.5)  # one linger period: a's ten reports, then b's eleven, go out
    assert counting.calls == 3  # a's batch, a's end, b's batch: not 22 calls
    assert real.get_run(queue.run_id("a")).info.status == "FINISHED"
    queue.put({"op": "end", "run": "b", "status": "FINISHED"})
    assert queue.close() == 0
    for run, sign, steps in (("a", 1, 10), ("b", -1, 11)):
        history = real.get_metric_history(queue.run_id(run), "val_bpb")
        assert sorted((m.step, m.value) for m in history) == [
            (s, sign * s / 10) for s in range(1, steps + 1)
        ]


def test_a_sweep_runs_figures_take_a_changed_value_at_a_logged_step(tmp_path):
    """A resumed sweep that only confirmed (as many trials, so the same step) updates its
    run's figures; the same value again, or a trial's step logged twice, is skipped."""
    from mlflow import MlflowClient

    from sweeper.tracking.mlflow_queue import OpQueue

    real = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = real.create_experiment("sweeper")

    def driver(*ops):
        queue = OpQueue(real, experiment, tmp_path / "pending.jsonl", say=lambda m: None)
        for run in ("sweep", "t"):  # found again by their tags in a later driver
            queue.apply_now({"op": "open", "run": run, "name": run, "match": {"trial_id": run}})
        queue.start()
        for run, name, value, step, latest in ops:
            queue.put(
                {"op": "metrics", "run": run, "metrics": [[name, value, step, 0]], "latest": latest}
            )
            time.sleep(0.05)
        assert queue.close() == 0
        return queue.run_id("sweep"), queue.run_id("t")

    sweep_id, trial_id = driver(
        ("sweep", "elapsed_s", 10.0, 4, True),
        ("sweep", "elapsed_s", 10.0, 4, True),  # the same value: skipped
        ("t", "val_bpb", 3.0, 4, False),
        ("t", "val_bpb", 2.9, 4, False),  # a trial's step: the first value stands
    )
    # the next driver (a resume) reads the logged values back before it logs
    assert driver(
        ("sweep", "elapsed_s", 10.0, 4, True),
        ("sweep", "elapsed_s", 25.0, 4, True),
        ("t", "val_bpb", 2.8, 4, False),
    ) == (sweep_id, trial_id)
    history = [(m.step, m.value) for m in real.get_metric_history(sweep_id, "elapsed_s")]
    assert sorted(history) == [(4, 10.0), (4, 25.0)]
    assert real.get_run(sweep_id).data.metrics["elapsed_s"] == 25.0  # what the UI shows
    assert [(m.step, m.value) for m in real.get_metric_history(trial_id, "val_bpb")] == [(4, 3.0)]


def test_calls_a_dead_server_never_took_are_kept_and_sent_by_the_next_driver(tmp_path):
    from mlflow import MlflowClient

    from sweeper.tracking.mlflow_queue import OpQueue

    real = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = real.create_experiment("sweeper")
    flaky = Flaky(real)
    pending = tmp_path / "pending.jsonl"
    queue = OpQueue(flaky, experiment, pending, say=lambda m: None)
    queue.apply_now({"op": "open", "run": "sweep", "name": "p", "match": {"role": "sweep"}})
    queue.start()
    queue.put({"op": "open", "run": "t", "parent": "sweep", "match": {"trial_id": "t"}})
    queue.put({"op": "metrics", "run": "t", "metrics": [["val_bpb", 1.0, 1, 0]]})
    time.sleep(1.5)  # past the metrics' linger time: step 1 is sent
    flaky.down = True
    queue.put({"op": "metrics", "run": "t", "metrics": [["val_bpb", 0.5, 2, 0]]})
    queue.put({"op": "end", "run": "t", "status": "FINISHED"})
    started = time.monotonic()
    assert queue.close() == 2  # two quick tries, then kept
    assert time.monotonic() - started < 5
    assert pending.is_file()

    run_id = queue.run_id("t")
    again = OpQueue(real, experiment, pending, say=lambda m: None)
    assert again.load_pending() == 2
    # this driver's own run under the same key, another run: the kept calls are not its
    again.apply_now({"op": "open", "run": "t", "name": "new", "match": {"trial_id": "new"}})
    assert again.run_id("t") != run_id
    again.start()
    assert again.close() == 0 and not pending.exists()
    assert [m.step for m in real.get_metric_history(run_id, "val_bpb")] == [1, 2]
    assert real.get_run(run_id).info.status == "FINISHED"
    assert real.get_metric_history(again.run_id("t"), "val_bpb") == []


# --- the tracker's trial bookkeeping, with stand-in Tune trials (no Ray) ---------------------
def test_paused_resumed_and_restarted_trials_keep_one_run(tmp_path, monkeypatch):
    from sweeper.config.compose import compose
    from sweeper.sweep.preflight import build_plan
    from sweeper.tracking import make_tracker

    monkeypatch.chdir(tmp_path)
    plan = build_plan(compose([*TINY_SWEEP, "sweep.stages.0.scheduler=hyperband"]))
    tracker = make_tracker(plan, tmp_path / "run")
    base = plan.base
    ctx = plan.trial_context(plan.stages[0], base)
    (callback,) = tracker.stage_callbacks("lr", base, ctx, "random", "hyperband")
    trial = SimpleNamespace(
        trial_id="abc_00000", config={"optimizer.matrix_lr": 0.02}, last_result={}, status=""
    )
    callback.on_trial_start(0, [], trial)
    callback.on_trial_result(0, [], trial, {"val_bpb": 3.0, "step": 5})
    callback.on_trial_start(0, [], trial)  # paused by Hyperband, then resumed
    callback.on_trial_result(0, [], trial, {"val_bpb": 2.5, "step": 10})
    callback.on_trial_recover(0, [], trial)  # failed, retried from its checkpoint
    callback.on_trial_result(0, [], trial, {"val_bpb": 2.5, "step": 10})
    callback.on_trial_result(0, [], trial, {"val_bpb": 2.0, "step": 15, "status": "completed"})
    trial.last_result = {"status": "completed", "done": True}
    callback.on_trial_complete(0, [], trial)
    other = SimpleNamespace(trial_id="abc_00001", config={"optimizer.matrix_lr": 0.01})
    other.last_result, other.status = {"status": "running"}, "PAUSED"
    callback.on_trial_start(0, [], other)
    callback.on_experiment_end([trial, other])  # Ctrl+C with `other` paused
    confirmation = {"improvement_mean": 0.25, "improvement_std": 0.02}  # sweep.confirm_seeds
    tracker.finish(
        {"trials": 2, "best": {"value": 2.0}, "confirmation": confirmation}, tmp_path / "run"
    )

    client, parents, children = logged(
        f"sqlite:///{tmp_path}/mlflow.db", (tmp_path / "run").resolve()
    )
    assert len(parents) == 1 and len(children) == 2
    runs = {c.data.tags["trial_id"]: c for c in children}
    done = runs["abc_00000"]
    assert done.info.status == "FINISHED" and done.data.tags["status"] == "completed"
    assert done.data.tags["retries"] == "1" and done.data.params["optimizer.matrix_lr"] == "0.02"
    assert done.data.params["model.depth"] == "2"
    history = client.get_metric_history(done.info.run_id, "val_bpb")
    assert [(m.step, m.value) for m in history] == [(5, 3.0), (10, 2.5), (15, 2.0)]
    paused = runs["abc_00001"]
    assert paused.info.status == "KILLED" and paused.data.tags["status"] == "interrupted"
    assert parents[0].data.metrics["best_val_bpb"] == 2.0
    assert parents[0].data.metrics["confirm_improvement_mean"] == 0.25
    assert parents[0].data.metrics["confirm_improvement_std"] == 0.02


# --- single runs (`python -m sweeper` without a sweep) -------------------------------------
SINGLE = ["model=tiny", "trainer.max_steps=6", "trainer.eval_every=2", "trainer.eval_tokens=1024"]
SINGLE += ["trainer.total_batch_size=512", "trainer.device_batch_size=8"]


def single_run(client, run_dir: Path, experiment: str = "sweeper"):
    """The MLflow run of the single run in `run_dir` (there must be exactly one)."""
    experiment = client.get_experiment_by_name(experiment)
    runs = client.search_runs(
        [experiment.experiment_id], f"tags.run_dir = '{run_dir.resolve()}' and tags.role = 'run'"
    )
    assert len(runs) == 1, runs
    return runs[0]


@pytest.mark.slow
def test_an_interrupted_single_run_is_killed_in_mlflow_and_its_resume_goes_on_in_it(tmp_path):
    from mlflow import MlflowClient

    from .test_run_resume import LONG_RUN, LONG_RUN_STEPS, _interrupt_after_first_checkpoint

    args = [*LONG_RUN, "hydra.run.dir=run"]
    code, err = _interrupt_after_first_checkpoint(args, tmp_path)
    assert code == 130, err[-2000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")  # the default store, in the cwd
    stopped = single_run(client, tmp_path / "run")
    assert stopped.info.status == "KILLED" and stopped.data.tags["status"] == "interrupted"
    assert stopped.data.tags["error"].startswith("interrupted")
    proc = run_cli([*args, "trainer.resume=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = single_run(client, tmp_path / "run")  # the same one
    assert resumed.info.run_id == stopped.info.run_id and resumed.info.status == "FINISHED"
    assert resumed.data.tags["status"] == "completed" and resumed.data.tags["error"] == ""
    steps = [m.step for m in client.get_metric_history(resumed.info.run_id, "val_bpb")]
    assert sorted(steps) == list(
        range(20, LONG_RUN_STEPS + 1, 20)
    )  # each once: none lost, none twice


@pytest.mark.slow
def test_a_single_run_killed_outright_is_failed_in_mlflow(tmp_path):
    """SIGKILL leaves the run no word to say; its logger, in a session of its own, sees
    the run's pipe close and ends the MLflow run as failed."""
    from mlflow import MlflowClient

    from .test_run_resume import LONG_RUN, _env

    with subprocess.Popen(
        [sys.executable, "-m", "sweeper", *LONG_RUN, "hydra.run.dir=run"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as proc:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "mlflow_run.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.kill()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    deadline = time.monotonic() + 60
    while (run := single_run(client, tmp_path / "run")).info.status == "RUNNING":
        assert time.monotonic() < deadline, "the logger left the run RUNNING"
        time.sleep(0.2)
    assert run.info.status == "FAILED" and run.data.tags["status"] == "failed"
    assert "killed" in run.data.tags["error"]


def test_a_users_function_run_once_is_an_mlflow_run_with_every_number_it_reports(tmp_path):
    """A sweep's reproduce line of a user's function: the tree it is given as params,
    what it reports as metrics (at its `step`, or its report's count), tag `trainable`;
    one that raises is FAILED with its error."""
    from mlflow import MlflowClient

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]))
    runs = {
        "curve": ["trainable._target_=tests.tracking_functions.curve", "+probe.reports=3"],
        "raises": ["trainable._target_=tests.user_functions.raises_after_a_report"],
        "no_steps": ["trainable._target_=tests.tracking_functions.without_steps"],
    }
    said = {}
    for name, args in runs.items():
        proc = subprocess.run(
            [sys.executable, "-m", "sweeper", *args, f"hydra.run.dir={name}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == (1 if name == "raises" else 0), proc.stderr[-2000:]
        said[name] = proc.stdout
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")  # the default store, in the cwd
    run = single_run(client, tmp_path / "curve")
    assert run.info.status == "FINISHED" and run.data.tags["status"] == "completed"
    assert run.data.tags["trainable"] == "tests.tracking_functions.curve"
    assert (
        run.data.params["optimizer.matrix_lr"] == "0.02" and run.data.params["probe.reports"] == "3"
    )
    assert "mlflow.enabled" not in run.data.params  # the platform's sections are not its tree
    metrics = {
        name: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        for name in ("val_bpb", "tokens", "lr")
    }
    curve = [1.0 + (math.log10(0.02) + 2.0) ** 2 + 1.0 / k for k in (1, 2, 3)]
    assert metrics["val_bpb"] == [(10 * k, pytest.approx(v)) for k, v in zip((1, 2, 3), curve)]
    assert metrics["tokens"] == [(10, 100), (20, 200), (30, 300)]
    assert metrics["lr"] == [(10, 0.02), (20, 0.02), (30, 0.02)]
    assert "result.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    failed = single_run(client, tmp_path / "raises")
    assert failed.info.status == "FAILED" and failed.data.tags["status"] == "failed"
    assert failed.data.tags["error"] == "AssertionError: the function's own bug"
    # its one report held no number: nothing to plot, nothing logged
    assert client.get_metric_history(failed.info.run_id, "val_bpb") == []
    counted = single_run(client, tmp_path / "no_steps")
    mine = client.get_metric_history(counted.info.run_id, "my_loss")
    assert sorted((m.step, m.value) for m in mine) == [(1, 4.0), (2, 2.0), (3, 4.0 / 3)]
    # a name MLflow refuses is left out, once said, and costs the others nothing
    assert set(counted.data.metrics) == {"my_loss"}
    assert said["no_steps"].count("[mlflow] metric 'acc@1' is not logged: ") == 1
    # compare --runs names the function each ran; the ones with no val_bpb last
    proc = run_cli(["--runs"], tmp_path, module="sweeper.compare")
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.strip().splitlines()[1:]
    assert header.split()[:8] == [
        *("run", "started", "commit", "status", "val_bpb", "tokens", "GiB", "trainable")
    ]
    cells = {row.split()[0]: row.split() for row in rows}
    assert rows[0].split()[0] == "run-curve" and set(cells) == {
        *("run-curve", "run-raises", "run-no_steps")
    }
    assert cells["run-curve"][8] == "tests.tracking_functions.curve"
    assert cells["run-raises"][4:9] == [
        *("failed", "-", "-", "-", "tests.user_functions.raises_after_a_report")
    ]


def test_a_single_runs_store_is_checked_without_importing_mlflow_where_it_trains(tmp_path):
    """MLflow's store registry, imported to check a tracking URI, would stay resident in
    the training process and count in a CPU run's peak memory: the check runs apart."""
    script = f"""
import sys
from sweeper.config.errors import ConfigError
from sweeper.tracking.mlflow_store import check_config_in_a_process

check_config_in_a_process({{"mlflow": {{"tracking_uri": "sqlite:///{tmp_path}/ok.db"}}}})
for uri in ("foo://bar", "sqlite:///{tmp_path}/a_file/x.db"):
    try:
        check_config_in_a_process({{"mlflow": {{"tracking_uri": uri}}}})
        print("accepted", uri)
    except ConfigError as error:
        print(error)
print("mlflow imported:", "mlflow" in sys.modules)
"""
    (tmp_path / "a_file").write_text("")
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    scheme, directory, imported = proc.stdout.strip().splitlines()
    assert scheme.startswith("mlflow.tracking_uri=foo://bar: MLflow has no store for this URI")
    assert directory.startswith(f"mlflow.tracking_uri=sqlite:///{tmp_path}/a_file/x.db: ")
    assert imported == "mlflow imported: False"
    assert not (tmp_path / "ok.db").exists()  # checked, not made: the logger makes it


@pytest.mark.parametrize(
    "run_dir, name",
    [
        ("outputs/2026-11-22/04-25-12", "run-2026-11-22_04-25-12"),  # Hydra's run dir
        # a --multirun's jobs: every multirun has a job 0, so its time names it too
        ("multirun/2026-11-28/15-49-37/0", "run-2026-11-28_15-49-37-0"),
        ("multirun/2026-11-28/15-49-37/12", "run-2026-11-28_15-49-37-12"),
        ("runs/lr_high", "run-lr_high"),  # hydra.run.dir as the user named it
        ("runs/7", "run-7"),
    ],
)
def test_a_single_runs_mlflow_name_comes_from_its_run_dir(run_dir, name):
    from sweeper.tracking.mlflow_tracker import run_name

    assert run_name("run", Path(run_dir)) == name


def test_a_single_run_with_tracking_off_writes_no_mlflow_files(tmp_path):
    proc = run_cli([*SINGLE, "mlflow.enabled=false", "hydra.run.dir=run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        not (tmp_path / "mlflow.db").exists()
        and not (tmp_path / "run" / "mlflow_run.json").exists()
    )
    assert "[mlflow]" not in proc.stdout


def test_a_store_the_logger_cannot_open_costs_the_run_its_tracking_not_its_training(tmp_path):
    (tmp_path / "not_a.db").write_text("not a database")
    uri = f"sqlite:///{tmp_path}/not_a.db"
    proc = run_cli([*SINGLE, f"mlflow.tracking_uri={uri}", "hydra.run.dir=run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "note: this run is not logged to MLflow: " in proc.stderr
    assert "file is not a database" in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "completed"


def test_runs_curves_are_by_tokens_only_where_every_run_logged_them(tmp_path):
    """A user's function may log no tokens: the curves then share the step axis; a run
    with no finite val_bpb has no curve."""
    from mlflow import MlflowClient

    from sweeper.report.runs_plot import plot_runs, run_curves

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("plots")
    runs = {}
    for name, logged in {
        "own": {"val_bpb": [3.0, 2.5], "tokens": [1000, 2000]},
        "again": {"val_bpb": [3.5, 3.1], "tokens": [1000, 2000]},  # its run dir used again
        "users": {"val_bpb": [4.0, float("nan")]},
        "none": {"lr": [0.1, 0.1]},
    }.items():
        run_name = "run-x" if name in ("own", "again") else name
        run_id = client.create_run(experiment, run_name=run_name).info.run_id
        for metric, values in logged.items():
            for step, value in enumerate(values, start=1):
                client.log_metric(run_id, metric, value, step=step)
        runs[name] = client.get_run(run_id)
    ids = {name: run.info.run_id for name, run in runs.items()}
    axis, curves = run_curves(client, list(runs.values()))
    assert axis == "step" and curves == {
        ids["own"]: [(1, 3.0), (2, 2.5)],
        ids["again"]: [(1, 3.5), (2, 3.1)],
        ids["users"]: [(1, 4.0)],
    }
    by_tokens = run_curves(client, [runs["own"], runs["again"]])
    assert by_tokens == (
        "tokens",
        {ids["own"]: [(1000, 3.0), (2000, 2.5)], ids["again"]: [(1000, 3.5), (2000, 3.1)]},
    )
    varied = {ids["own"]: {"optimizer.lr": "0.1"}}
    drawn = plot_runs(client, list(runs.values()), varied, tmp_path / "p.png")
    assert drawn == 3 and (tmp_path / "p.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_single_run_on_a_server_is_one_mlflow_run_and_compare_runs_lists_them_best_first(
    mlflow_server, tmp_path
):
    """Two single runs on `mlflow server`: the second (`run`, the default LR) is checked as
    one MLflow run; `compare --runs` lists both, best first, with what differs."""
    from mlflow import MlflowClient

    from sweeper.report.runs_plot import run_curves

    # an experiment of their own on the module's server: other tests' runs are not listed
    at = ["--tracking-uri", mlflow_server, "--experiment", "compared"]
    runs = {
        "low": ["optimizer.matrix_lr=0.005", "trainer.checkpoint_every_eval=true"],
        "run": [],  # the default LR (0.02), run last
    }
    for name, extra in runs.items():
        proc = run_cli(
            [*SINGLE, *extra, f"mlflow.tracking_uri={mlflow_server}", "mlflow.experiment=compared"]
            + [f"hydra.run.dir={name}"],
            tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    client = MlflowClient(mlflow_server)
    run = single_run(client, tmp_path / "run", "compared")
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert run.info.status == "FINISHED" and run.data.tags["status"] == "completed"
    assert run.data.tags["git_commit"] and run.info.run_name == "run-run"
    assert (
        json.loads((tmp_path / "run" / "mlflow_run.json").read_text())["run_id"] == run.info.run_id
    )
    # params: the run config, flattened; metrics: each evaluation at its step
    params = run.data.params
    assert params["optimizer.matrix_lr"] == "0.02" and params["trainer.max_steps"] == "6"
    assert params["model.depth"] == "2" and params["trainer.checkpoint_every_eval"] == "False"
    for name in ("val_bpb", "train_loss", "grad_norm", "peak_memory_gib"):
        history = client.get_metric_history(run.info.run_id, name)
        assert sorted((m.step, m.value) for m in history) == [
            (h["step"], pytest.approx(h[name])) for h in result["history"]
        ], name
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"result.json", "curves.png", "config.yaml"} <= files
    # its line comes before the run's last one, which names result.json as before
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].startswith(f"[mlflow] run {run.info.run_id} in {mlflow_server}")
    page = f"{mlflow_server}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert lines[-2].endswith(f"; in the MLflow UI: {page}")
    assert "View run" not in proc.stdout  # MLflow's own line as each run ends
    assert lines[-1].startswith("completed: val_bpb ")
    # sweeper.compare ranks a sweep's trials: a single run's dir is named as what it is
    compared = run_cli(["run"], tmp_path, module="sweeper.compare")
    assert compared.returncode == 2 and len(compared.stderr.splitlines()) == 1
    assert f"run is a single run (MLflow run {run.info.run_id}), not a sweep" in compared.stderr
    # compare --runs: both runs, best first
    value = {
        name: json.loads((tmp_path / name / "result.json").read_text())["val_bpb"] for name in runs
    }
    proc = run_cli(["--runs", *at], tmp_path, module="sweeper.compare")
    assert proc.returncode == 0, proc.stderr
    title, header, *rows = proc.stdout.strip().splitlines()
    assert title.startswith("the latest 2 single runs, sorted by val_bpb")
    # what differs: the LR; not the checkpointing, which says how a run ran, not what
    assert header.split() == [
        "run",
        "started",
        "commit",
        "status",
        "val_bpb",
        "tokens",
        "GiB",
        "optimizer.matrix_lr",
    ]
    order = sorted(runs, key=value.get)
    assert [row.split()[0] for row in rows] == [f"run-{name}" for name in order]
    for row, name in zip(rows, order, strict=True):
        cells = row.split()
        assert (
            cells[5] == f"{value[name]:.4f}" and cells[-1] == {"low": "0.005", "run": "0.02"}[name]
        )
        # cells 1-2: the date and time it started; 3: the commit, * where it had changes
        assert cells[4] == "completed" and re.fullmatch(r"[0-9a-f]{7}\*?|unknown", cells[3])
    # the latest one only; a sweep's name beside --runs is refused
    latest = run_cli(["--runs", "--last", "1", *at], tmp_path, module="sweeper.compare")
    assert latest.stdout.splitlines()[0].startswith("the latest single run, sorted by val_bpb")
    assert len(latest.stdout.strip().splitlines()) == 3 and "run-run" in latest.stdout
    refused = run_cli(["--runs", "smoke", *at], tmp_path, module="sweeper.compare")
    assert refused.returncode == 2 and "--runs lists the single runs" in refused.stderr
    # --plot: their val_bpb curves on one axis, the points each run's history has
    plotted = run_cli(["--runs", "--plot", "runs.png", *at], tmp_path, module="sweeper.compare")
    assert plotted.returncode == 0, plotted.stderr
    assert plotted.stdout.strip().splitlines()[-1] == "val_bpb curves of 2 of them -> runs.png"
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = {name: single_run(client, tmp_path / name, "compared") for name in runs}
    axis, curves = run_curves(client, list(logged.values()))
    assert axis == "tokens"
    for name in runs:
        history = json.loads((tmp_path / name / "result.json").read_text())["history"]
        assert curves[logged[name].info.run_id] == [
            (h["tokens"], pytest.approx(h["val_bpb"])) for h in history
        ]
    for args, said in [
        (["--plot", "runs.png"], "--plot runs.png draws the single runs' curves: add --runs"),
        (["--runs", "--plot", "runs.svg"], "--plot runs.svg: name a .png file"),
        (["--runs", "--plot", "no/such/dir/r.png"], "--plot no/such/dir/r.png: cannot be written"),
    ]:
        proc = run_cli([*args, *at], tmp_path, module="sweeper.compare")
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {said}"), proc.stderr
        assert len(proc.stderr.splitlines()) == 1


# --- no secrets in outputs -------------------------------------------------------------------
def test_a_postgres_password_is_masked_in_a_runs_files(tmp_path):
    uri = "postgresql://sweeper:pg-Secret_1@db.internal:5432/mlflow"
    proc = run_cli(
        [*SINGLE, "mlflow.enabled=false", f"mlflow.tracking_uri={uri}", "hydra.run.dir=run"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    texts = every_text(tmp_path / "run")
    assert [p for p, text in texts.items() if "pg-Secret_1" in text] == []
    masked = "postgresql://sweeper:***@db.internal:5432/mlflow"
    assert masked in texts[tmp_path / "run" / ".hydra" / "overrides.yaml"]


@pytest.mark.parametrize(
    "text, masked",
    [
        ("postgresql://me:pw@host:5432/db", "postgresql://me:***@host:5432/db"),
        ("mysql+pymysql://u:p%40ss@h/db", "mysql+pymysql://u:***@h/db"),
        ("https://:tok@host", "https://:***@host"),
        ("http://host:5000/path", "http://host:5000/path"),  # a port is no password
        ("http://me@host", "http://me@host"),
        ("https://h/db?user=a&password=pw&x=1", "https://h/db?user=a&password=***&x=1"),
        ("https://h/?token=abc", "https://h/?token=***"),
        (
            "mlflow.tracking_uri=postgresql://a:b@c/d x=1",
            "mlflow.tracking_uri=postgresql://a:***@c/d x=1",
        ),
    ],
)
def test_mask_secrets(text, masked):
    from sweeper.text import mask_secrets

    assert mask_secrets(text) == masked
