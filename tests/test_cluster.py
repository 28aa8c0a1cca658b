"""Sweeps on Ray clusters of several nodes, all on this machine: a head plus two worker
nodes (`ray.cluster_utils.Cluster`), a cluster started with `ray start` that a sweep joins
through `ray.address`, and an address where no cluster answers."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sweeper.config.compose import compose
from sweeper.config.errors import ConfigError
from sweeper.sweep.preflight import build_plan
from sweeper.sweep.runner import run_sweep

from .conftest import REPO, local_ray, run_cli
from .test_sweep import TINY_SWEEP

pytestmark = pytest.mark.slow

# worker nodes get their own loopback addresses, so Ray Tune's `node_ip` of each trial says
# which node ran it, as on a cluster of several machines (Linux routes all of 127/8 to lo)
WORKER_IPS = ("127.0.0.2", "127.0.0.3")
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with {process.returncode}")
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout}s")


def trial_results(run_dir: Path) -> dict[str, list[dict]]:
    """Every trial's reports (Ray Tune's result.json), by trial dir, from the run dir."""
    return {
        str(path.parent.relative_to(run_dir / "ray")): [
            json.loads(line) for line in path.read_text().splitlines() if line.strip()
        ]
        for path in sorted((run_dir / "ray").glob("stage*/*/result.json"))
    }


@pytest.fixture(scope="module")
def three_nodes():
    """A head and two worker nodes, one CPU each: three trials at once need all three."""
    if not sys.platform.startswith("linux"):
        pytest.skip("worker nodes on 127.0.0.2/3 need Linux's loopback")
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    # Cluster writes its address where `ray.init(address="auto")` looks: put back what was there
    marker = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    saved = marker.read_text() if marker.is_file() else None
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "src")]))
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "include_dashboard": False,
                "dashboard_port": free_port(),
                "dashboard_agent_listen_port": free_port(),
            },
        )
        try:
            for ip in WORKER_IPS:
                cluster.add_node(num_cpus=1, node_ip_address=ip)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
            if saved is not None:
                marker.write_text(saved)


def start_node(temp: str, log: Path, *args: str) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [
                RAY,
                "start",
                "--num-cpus=1",
                "--disable-usage-stats",
                f"--temp-dir={temp}",
                # every port of this cluster its own, beside other Ray clusters of the machine
                f"--dashboard-agent-listen-port={free_port()}",
                *args,
                "--block",  # ends, with every process it started, at SIGTERM
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_node(node: subprocess.Popen) -> None:
    node.send_signal(signal.SIGTERM)
    try:
        node.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()


# one sweep proves both: it joins a cluster started with `ray start` (a head and two worker
# nodes, one CPU each: three trials at once need all three), and its trials run on several
# nodes and write to one run dir
def test_a_sweep_joins_a_ray_start_cluster_and_its_trials_run_on_several_nodes_into_one_run_dir(
    tmp_path, monkeypatch
):
    if not sys.platform.startswith("linux"):
        pytest.skip("worker nodes on 127.0.0.2/3 need Linux's loopback")
    port = free_port()
    # Ray's unix sockets live under the temp dir: it must be short (pytest's tmp_path is not)
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    # `ray start` clusters use token auth; the driver joins with RAY_AUTH_MODE + RAY_AUTH_TOKEN
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    nodes = [
        start_node(
            temp,
            tmp_path / "ray_start.log",
            "--head",
            f"--port={port}",
            "--include-dashboard=false",
            f"--dashboard-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        )
    ]
    try:
        wait_for_port(port, 60, nodes[0])
        for ip in WORKER_IPS:  # one at a time: a node not up in 30 s fails (a loaded machine)
            log = tmp_path / f"ray_start_{ip}.log"
            nodes.append(
                start_node(temp, log, f"--address=127.0.0.1:{port}", f"--node-ip-address={ip}")
            )
            deadline = time.monotonic() + 60
            while "Ray runtime started" not in log.read_text():
                up = nodes[-1].poll() is None and time.monotonic() < deadline
                assert up, log.read_text()[-3000:]
                time.sleep(0.2)
        run_dir = tmp_path / "run"
        proc = run_cli(
            [
                *TINY_SWEEP,
                "sweep.baseline=false",
                "sweep.stages.0.num_samples=4",
                "sweep.stages.0.scheduler=fifo",  # every trial runs its whole budget
                "sweep.concurrency=3",
                # not the LR stage's batch (512), whose point would replay that run, untrained
                "sweep.stages.1.params.trainer.total_batch_size.grid=[2048]",
                "ray.address=auto",  # found through RAY_ADDRESS, as `ray start` says
                "mlflow.enabled=false",
                f"hydra.run.dir={run_dir}",
            ],
            cwd=tmp_path,
            timeout=150,
            env={"RAY_ADDRESS": f"127.0.0.1:{port}"},
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        # auto joins whichever cluster Ray finds: the line names it, with all three nodes' CPUs
        # (at the node's own IP, which Ray's GCS listens on)
        joined = re.search(rf"ray: joined auto \(at ([\d.]+):{port}\) with 3 CPUs", proc.stdout)
        assert joined, proc.stdout[-2000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert [stage["trials"] for stage in summary["stages"]] == [4, 1]
        results = trial_results(run_dir)
        assert len(results) == 5  # every trial of both stages, wherever it ran, in this run dir
        where = {trial: reports[-1]["node_ip"] for trial, reports in results.items()}
        lr_nodes = {ip for trial, ip in where.items() if trial.startswith("stage0_lr/")}
        print(f"trial -> node: {where}")
        assert set(where.values()) <= {joined.group(1), *WORKER_IPS}, where
        assert len(lr_nodes) >= 2 and lr_nodes & set(WORKER_IPS), where
        # the trials' processes were workers of that cluster: their logs are in its temp dir
        logs = {p.name for p in Path(temp).glob("session_*/logs/worker-*")}
        for trial, reports in results.items():
            assert reports[-1]["status"] == "completed", trial
            # the checkpoints a trial wrote on its node are in the shared run dir as well
            assert list((run_dir / "ray" / trial).glob("checkpoint_*")), trial
            pid = reports[-1]["pid"]
            assert any(name.endswith(f"-{pid}.out") for name in logs), (trial, pid)
        # and the driver did not start a cluster of its own
        assert len(list(Path(temp).glob("session_2*"))) == 1
    finally:
        for node in reversed(nodes):
            stop_node(node)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_an_address_where_no_cluster_answers_fails_in_one_line(tmp_path, scheme):
    address = f"{scheme}127.0.0.1:{free_port()}"  # closed again: nothing listens there
    started = time.monotonic()
    proc = run_cli(
        ["+sweep=smoke", f"ray.address={address}", "mlflow.enabled=false"], cwd=tmp_path, timeout=60
    )
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert f"ray.address={address}" in lines[0] and "Traceback" not in proc.stdout
    assert elapsed < 30, f"{elapsed:.1f}s"


def test_the_probe_refuses_closed_ports_and_leaves_other_addresses_to_ray():
    from sweeper.sweep.cluster import endpoint, probe

    assert endpoint("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert endpoint("ray://head:10001") == ("head", 10001)
    assert endpoint("[::1]:6379") == ("::1", 6379)
    assert endpoint("auto") is None and endpoint("local") is None
    with pytest.raises(ConfigError, match=r"ray.address=127.0.0.1:\d+: no Ray cluster answers"):
        probe(f"127.0.0.1:{free_port()}", timeout=2)


def test_auto_is_looked_up_as_ray_would_and_probed_before_anything_runs(monkeypatch):
    from sweeper.sweep.cluster import probe

    # RAY_ADDRESS is the first place ray.init(address="auto") looks
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")
    with pytest.raises(ConfigError, match=r"ray.address=auto \(found [\d.]+:\d+\): no Ray"):
        probe("auto", timeout=2)
    grpc_port = free_port()
    with grpc_server(grpc_port):  # a gRPC server answers there, as a GCS does: accepted
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{grpc_port}")
        probe("auto", timeout=2)


@contextlib.contextmanager
def grpc_server(port: int):
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    server.add_insecure_port(f"0.0.0.0:{port}")  # Ray names this host by its node IP
    server.start()
    try:
        yield
    finally:
        server.stop(None)


def test_a_port_that_answers_but_not_as_ray_does_is_refused_in_seconds(tmp_path):
    """ray.address at the dashboard's port (what the sweep's first line prints) or any
    other server that is not Ray's: ray.init would retry for minutes; the probe asks for
    the gRPC handshake Ray's GCS answers, and says what is wrong before anything runs."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, 30, server)
        started = time.monotonic()
        proc = run_cli(
            ["+sweep=smoke", f"ray.address=127.0.0.1:{port}", "hydra.run.dir=sweep"],
            cwd=tmp_path,
            timeout=60,
        )
        elapsed = time.monotonic() - started
    finally:
        server.kill()
        server.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        proc.stderr.startswith(
            f"error: ray.address=127.0.0.1:{port}: 127.0.0.1:{port} answers, but not as Ray does"
        )
        and proc.stderr.count("\n") == 1
    ), proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run dir, no MLflow store
    assert elapsed < 30, f"{elapsed:.1f}s"


def test_the_local_gpu_count_is_the_one_ray_registers(monkeypatch):
    import torch

    from sweeper.sweep.cluster import detected_gpus, local_cluster_size

    assert detected_gpus() == torch.cuda.device_count()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # none visible: Ray registers none
    assert detected_gpus() == 0
    assert local_cluster_size({"num_cpus": 3, "num_gpus": None}) == (3.0, 0.0)
    assert local_cluster_size({"num_cpus": 3, "num_gpus": 2}) == (3.0, 2.0)


def test_validating_a_users_function_sweep_leaves_torch_unimported(tmp_path):
    """The driver of a user's own function never needs torch (1.5 s of start-up)."""
    code = (
        "import sys; from sweeper.command import check as validate; "
        "validate(['+sweep=smoke', 'trainable._target_=tests.user_functions.noisy_bowl', "
        "'sweep.gpus_per_trial=0']); print('torch' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_a_trial_process_imports_no_scipy(tmp_path):
    """A trial's module and its helpers leave scipy out (scipy.stats: 1.1 s of every trial
    process's start-up); the stage tables' seed statistics import it where they need it."""
    code = "import sys, sweeper.sweep.trainable; print(any(m.startswith('scipy') for m in sys.modules))"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_a_local_cluster_is_its_own_and_its_dashboard_takes_the_token_its_line_names(tmp_path):
    """ray.address=null starts a cluster of its own, even where `ray start` left the address
    of one behind (ray.init's default would join that). Ray turns token auth on for a new
    local cluster: the dashboard's page asks for the token. The line that gives the
    dashboard's URL says where it is, that token signs in (without it the dashboard's API
    answers 401), and Ray's warning about it is not shown. Listening on every interface
    (0.0.0.0), a second line says so once, and what guards it."""
    import urllib.error
    import urllib.request

    port = free_port()
    code = (
        "import sys; from sweeper.sweep.cluster import start_ray; "
        f"start_ray({{'num_cpus': 1, 'dashboard_port': {port}, 'dashboard_host': '0.0.0.0'}}); "
        "sys.stdout.flush(); "
        "sys.stdin.read()"  # the cluster lives until the test closes stdin
    )
    # Ray's sockets live under its temp dir: it must be short (pytest's tmp_path is not)
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    (temp / "ray").mkdir()
    # what `ray start` leaves for ray.init() to join: here a cluster that is gone
    (temp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    # a home of its own: Ray writes a new local cluster's token to ~/.ray/auth_token
    env = dict(os.environ, HOME=str(tmp_path), PYTHONPATH=str(REPO / "src"), RAY_TMPDIR=str(temp))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        env.pop(name, None)
    stderr = (tmp_path / "stderr.log").open("w+")
    driver = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )

    def status(url: str, token: str | None) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10):
                return 200
        except urllib.error.HTTPError as error:
            return error.code

    try:
        line = driver.stdout.readline()
        stderr.seek(0)  # the driver's writes moved the file's shared offset
        assert line.startswith("ray: local cluster with 1 CPUs"), line + stderr.read()[-3000:]
        url, hint = line.split("dashboard: ")[1].split(" ", 1)
        assert re.fullmatch(rf"http://[\d.]+:{port}", url)  # the node's address
        assert hint.strip() == "(sign in with the token in ~/.ray/auth_token)"
        assert driver.stdout.readline() == (
            f"ray: the dashboard at {url} is reachable from other machines; Ray's token auth "
            "guards it: whoever holds the token can run code here, so keep it secret, or set "
            "ray.dashboard_host=127.0.0.1 (docs/cluster-and-docker.md)\n"
        )
        token = (tmp_path / ".ray" / "auth_token").read_text().strip()
        api = f"{url}/api/jobs/"
        assert status(api, None) == 401
        assert status(api, "0" * len(token)) in (401, 403)
        assert status(api, token) == 200
        assert list(temp.glob("ray/session_2*")), "the cluster was not started in RAY_TMPDIR"
    finally:
        driver.stdin.close()
        driver.wait(60)
        shutil.rmtree(temp, ignore_errors=True)
    stderr.seek(0)
    assert "Token authentication is enabled" not in stderr.read()


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.0.0.5", False),
        ("::", False),
        ("myhost", False),
    ],
)
def test_only_a_loopback_dashboard_goes_without_the_exposure_line(host, loopback):
    from sweeper.sweep.cluster import exposure_note, is_loopback

    assert is_loopback(host) == loopback
    assert "nothing guards it: anyone who reaches it" in exposure_note("h:1", token_auth=False)


STATE_API_FROM_A_WORKER = """
import ray
from sweeper.sweep.cluster import start_local

start_local({"num_cpus": 1}, "127.0.0.1", {"log_to_driver": False})


@ray.remote(num_cpus=0)
def nodes_seen_by_a_worker():
    from ray.util.state import list_nodes

    return len(list_nodes())


print(ray.get(nodes_seen_by_a_worker.remote()))
"""


def test_a_worker_reaches_its_own_clusters_state_api_beside_another_cluster():
    """Ray Train's placement-group cleaner asks Ray's state API from a worker; with a second
    Ray instance on the machine (the test process's own, here) Ray's lookup of the address
    finds two and raises, unless the cluster told its workers where its dashboard is."""
    import ray

    with contextlib.nullcontext() if ray.is_initialized() else local_ray():
        worker_reaches_its_own_clusters_state_api()


def worker_reaches_its_own_clusters_state_api():
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_API_SERVER_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", STATE_API_FROM_A_WORKER],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "1"


@pytest.mark.parametrize("gpus", ["1", "0.5"])
def test_a_sweep_that_needs_gpus_on_a_cluster_without_one_is_refused_before_any_trial(
    three_nodes, tmp_path, capsys, gpus
):
    import ray

    ray.shutdown()  # the sweep joins the cluster itself, as a new driver does
    asks = [f"sweep.gpus_per_trial={gpus}", "trainer.device=cuda"]
    cfg = compose(
        [*TINY_SWEEP, *asks, f"ray.address={three_nodes.address}", "mlflow.enabled=false"]
    )
    with pytest.raises(ConfigError) as error:
        run_sweep(build_plan(cfg), str(tmp_path))
    assert str(error.value) == (
        f"{asks[0]} but the cluster at ray.address={three_nodes.address} has no GPU; "
        "join one with GPUs, or train on CPU"
    )
    assert not (tmp_path / "ray").exists()  # no trial started
    # it had joined the cluster at the address given, all three nodes of it
    assert f"ray: joined {three_nodes.address} with 3 CPUs" in capsys.readouterr().out
    nodes = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
    assert len(nodes) == 3 and set(WORKER_IPS) <= nodes
