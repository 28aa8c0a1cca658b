"""Start (or join) the Ray cluster and print where its dashboard is."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading

from sweeper.config.errors import ConfigError
from sweeper.signals import stop_on_sigterm_as_on_ctrl_c

# persist the experiment state at most once a second rather than Tune's >= 10 s: a killed
# driver then re-runs only trials that finished in its last second (every step costs more:
# BENCHMARKS.md, orchestration overhead)
os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# with a checkpoint per report, Tune warns at every forced state snapshot: that is by design
os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
# Tune's default per-trial loggers write every result three times (JSON, CSV, TensorBoard):
# MLflow is the sweep's tracker and stage.py adds back the JSON log Tune's results need;
# TensorBoard's costs driver CPU per result and seconds of start-up (it imports torch).
os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
# Tune's new output engine prints a box per stage even at verbose=0, which the engine's own
# stage line already says in the sweep's words; the legacy engine honours verbose=0.
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")

# how long a "host:port" address may take to accept a TCP connection before Ray is asked:
# ray.init retries an unreachable GCS for minutes (without end in Ray 2.60)
PROBE_TIMEOUT_S = 5.0


def endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of "host:port" or "ray://host:port"; None for "auto", "local" and the
    like, which Ray resolves itself."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Fail in seconds, in one line, when nothing listens at a "host:port" address, or
    when "auto" finds no cluster to join."""
    label = address
    if address == "auto":
        address = find_auto_address()
        label = f"auto (found {address})"
    target = endpoint(address)
    if target is None:
        if address in ("auto", "local") or "://" in address:  # Ray resolves these itself
            return
        raise ConfigError(
            f"ray.address={label} is not an address Ray can join: use auto, host:port or "
            "ray://host:port (or null to start a local cluster)"
        )
    try:
        socket.create_connection(target, timeout=timeout).close()
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        raise ConfigError(
            f"ray.address={label}: no Ray cluster answers at {target[0]}:{target[1]} "
            f"({reason}); start one (ray start --head) or fix the address"
        ) from None
    if not speaks_grpc(target, timeout):
        # ray.init would retry for minutes, printing a line every few seconds
        raise ConfigError(
            f"ray.address={label}: {target[0]}:{target[1]} answers, but not as Ray does "
            "(no gRPC server: the dashboard's port? a cluster's GCS is on 6379 unless "
            "`ray start --port` said otherwise, its Ray Client on ray://host:10001)"
        )


def speaks_grpc(target: tuple[str, int], timeout: float) -> bool:
    """Whether a gRPC server (what Ray's GCS and its Ray Client server are) answers at
    `target`: its HTTP/2 handshake, asked of grpc's own channel, in at most `timeout`."""
    import grpc

    host = f"[{target[0]}]" if ":" in target[0] else target[0]
    channel = grpc.insecure_channel(f"{host}:{target[1]}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def find_auto_address() -> str:
    """What ray.init(address="auto") would join: RAY_ADDRESS, the last `ray start` on this
    machine, or a running GCS. Asked before anything is written, since ray.init itself
    only fails once the sweep has made its run dir and its MLflow run."""
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die
    except ImportError:  # a Ray without this private helper: ray.init will say it later
        return "auto"
    try:
        return canonicalize_bootstrap_address_or_die("auto")
    except (ConnectionError, ValueError) as error:
        raise ConfigError(
            f"ray.address=auto: no Ray cluster to join ({one_sentence(error)}); start one "
            "(ray start --head), name it (ray.address=host:6379), or leave ray.address "
            "null for a local cluster"
        ) from None


def one_sentence(error: BaseException) -> str:
    return str(error).split(". ")[0].strip().rstrip(".")


def local_cluster_size(ray_cfg) -> tuple[float, float]:
    """(CPUs, GPUs) the local cluster will have: ray.num_cpus / ray.num_gpus, else what
    Ray itself detects (its CPU count honours container limits, os.cpu_count does not)."""
    cpus = ray_cfg.get("num_cpus")
    if cpus is None:
        try:
            from ray._private.utils import get_num_cpus

            cpus = get_num_cpus()
        except ImportError:
            cpus = len(os.sched_getaffinity(0))
    gpus = ray_cfg.get("num_gpus")
    if gpus is None:
        gpus = detected_gpus()
    return float(cpus), float(gpus)


# how far ray.num_cpus may overstate this machine's CPUs for a local cluster. Declaring more
# CPUs than there are runs more trials at once (each slower); past this it is a typo, and
# at ray.num_cpus=1e9 Ray itself never finished starting.
MAX_CPU_OVERSUBSCRIPTION = 64


def check_local_cluster(ray_cfg) -> None:
    """What a local cluster is started with, checked before anything is written: a declared
    CPU count far beyond the machine's, and a dashboard host nothing can listen on (Ray's
    own error is a traceback from its port probe, after the MLflow run is made)."""
    cpus = ray_cfg.get("num_cpus")
    have = len(os.sched_getaffinity(0))
    if cpus is not None and cpus > MAX_CPU_OVERSUBSCRIPTION * have:
        raise ConfigError(
            f"ray.num_cpus={cpus:g} for a local cluster on a machine with {have} CPUs; at "
            f"most {MAX_CPU_OVERSUBSCRIPTION * have} ({MAX_CPU_OVERSUBSCRIPTION}x), or join a "
            "bigger cluster with ray.address"
        )
    host = ray_cfg.get("dashboard_host") or "127.0.0.1"
    with socket.socket() as listener:
        try:
            listener.bind((host, 0))
        except OSError as error:
            reason = error.strerror or str(error)
            raise ConfigError(
                f"ray.dashboard_host={host}: cannot listen there ({reason}); use 127.0.0.1, "
                "or 0.0.0.0 for every interface"
            ) from None


def detected_gpus() -> int:
    """The GPUs a local Ray cluster started here will register: Ray's own NVML count,
    capped by CUDA_VISIBLE_DEVICES, as ray.init does. Asking torch would import it into
    the driver, which a user's own trainable never needs."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        manager = get_accelerator_manager_for_resource("GPU")
        count = manager.get_current_node_num_accelerators()
        visible = manager.get_current_process_visible_accelerator_ids()
    except (ImportError, AttributeError):  # Ray moved its private helpers: ask torch
        import torch

        return torch.cuda.device_count()
    return count if visible is None else min(count, len(visible))


def free_port(host: str, preferred: int, tries: int = 50) -> int:
    """`preferred` if nothing listens there, else the next free port: a second sweep on the
    same machine gets its own dashboard instead of failing."""
    for port in range(preferred, preferred + tries):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
                return port
            except OSError:
                continue
    return preferred


def wants_token(error: BaseException | None) -> bool:
    """Whether Ray's connection error (or one it was raised from) is a refused auth token."""
    while error is not None:
        if type(error).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def start_local(ray_cfg, host: str, common: dict):
    """A local cluster with its dashboard on the first free port from ray.dashboard_port.
    Another cluster starting at the same moment can take a port between the check and
    Ray's bind (Ray then raises a bare Exception): try the next ports, then go on
    without a dashboard rather than fail the sweep."""
    import ray

    # Ray Train's preemption watcher (one more actor per multi-rank run) watches for nodes
    # a cloud drains; a cluster of this machine has none, and its actor logged a core
    # worker error line on every two-rank run. Joined clusters keep it (their env, not ours).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    port = int(ray_cfg.get("dashboard_port") or 8265)
    for attempt in range(4):
        port = free_port(host, port)
        # Ray's state API, which Ray Train's placement-group cleaner calls from a worker,
        # finds its cluster by scanning this machine's processes and fails where several
        # clusters run; the dashboard serves it, and every worker inherits this address
        os.environ["RAY_API_SERVER_ADDRESS"] = f"http://{host}:{port}"
        if attempt == 3:
            del os.environ["RAY_API_SERVER_ADDRESS"]
        try:
            return ray.init(
                # "local": a cluster of its own. ray.init's default (None) would join one
                # that `ray start` left running on this machine, or fail on num_cpus there
                address="local",
                num_cpus=ray_cfg.get("num_cpus"),
                num_gpus=ray_cfg.get("num_gpus"),
                include_dashboard=attempt < 3,
                dashboard_host=host,
                dashboard_port=port,
                **common,
            )
        except Exception as error:
            if "dashboard" not in str(error) or attempt == 3:
                raise
            ray.shutdown()
            port += 1
    raise RuntimeError("unreachable")


class DropsTokenAuthNotice(logging.Filter):
    """Ray turns token auth on for every new local cluster (its dashboard then asks for the
    token, which the dashboard line says where to find) and warns at each start that it did;
    this drops that one warning, and Ray's auth stays as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
    DropsTokenAuthNotice()
)


class DropsSupersededStateUpload(logging.Filter):
    """Tune's forced save of a stage's state (on Ctrl+C, at a stage's end) renames a temp
    file into place while its previous background upload may still be copying it; that
    upload's traceback on the vanished temp file is noise, since the save uploads the whole
    state again ("the most recent state was saved"). Drops only an upload failed on a temp file."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, FileNotFoundError) and "-tmp-" in str(error))


logging.getLogger("ray.tune.execution.experiment_state").addFilter(DropsSupersededStateUpload())


class DropsTunesResumeAdvice(logging.Filter):
    """On Ctrl+C, Tune advises `Tuner.restore(...)`, Python a sweeper user never writes; the
    sweep prints its own resume command instead. Also drops Tune's warning of no results for
    trials stopped before their first report: sweeper keeps every report (reports.csv)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Resume experiment with: Tuner.restore" in message:
            return False
        if message.startswith("Failed to fetch metrics for"):
            lines = message.splitlines()[1:]
            return not all("result.json and progress.csv were not found" in x for x in lines)
        return True


logging.getLogger("ray.tune.tune").addFilter(DropsTunesResumeAdvice())

# the logger of Ray Train's controller that asks its autoscaling coordinator for the ranks
RAY_TRAIN_RESOURCE_REQUESTS = (
    "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"
)


class DropsResourceRequestRetries(logging.Filter):
    """Ray Train's controller warns, with a traceback, when its autoscaling coordinator takes
    over 5 s to answer (a busy machine): a request is sent again later and a cancelled one
    expires, a run of fixed size never waits on either, and Ray calls it safe to ignore."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("Failed to send resource", "Failed to cancel resource"))


def drop_resource_request_retries() -> None:
    """Ray's worker_process_setup_hook of a single DDP run, whose workers' output reaches the
    terminal: the controller's logger lives in a worker, not in this process."""
    logging.getLogger(RAY_TRAIN_RESOURCE_REQUESTS).addFilter(DropsResourceRequestRetries())


class DropsMissingMetricTraceback(logging.Filter):
    """A trial ended by trainable.MissingMetricError: the stage stops the sweep with one line
    naming what the function did report, which Tune's traceback of each trial would bury."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (error is not None and "MissingMetricError: " in str(error))


logging.getLogger("ray.tune.execution.tune_controller").addFilter(DropsMissingMetricTraceback())

# set while sweep.max_seconds stops a stage's Tune run (stage.time_cap)
TIME_CAP_STOP = threading.Event()


class DropsTimeCapStopNotices(logging.Filter):
    """The time cap stops Tune by its Ctrl+C signal, and the stage prints its own line on it:
    drops Tune's "Stop signal received" then. Drops "Trials did not complete: [...]" always:
    each failed trial had its own line with its reason (callbacks.ProgressCallback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Trials did not complete"):
            return False
        return not (TIME_CAP_STOP.is_set() and message.startswith("Stop signal received"))


logging.getLogger("ray.tune.tune").addFilter(DropsTimeCapStopNotices())
logging.getLogger("ray.tune.analysis.experiment_analysis").addFilter(DropsTunesResumeAdvice())


def start_ray(ray_cfg, log_to_driver: bool = False, gpus_for: str | None = None) -> None:
    """Sweeps keep the driver's output to their own progress lines (trial output stays in
    Ray's logs); a single DDP run shows rank 0's progress (log_to_driver=True). `gpus_for`:
    the setting that asks for GPUs, refused on a joined cluster that has none (a local
    one's GPUs were checked before it started)."""
    import ray

    if not ray.is_initialized():
        connect(ray_cfg, log_to_driver)
    if gpus_for and not ray.cluster_resources().get("GPU"):  # every trial would fail on CUDA
        raise ConfigError(
            f"{gpus_for} but the cluster at ray.address={ray_cfg.get('address')} has no GPU; "
            "join one with GPUs, or train on CPU"
        )


def connect(ray_cfg, log_to_driver: bool) -> None:
    """Join ray.address, or start a local cluster; one line says which, and where its
    dashboard is."""
    import ray

    common = dict(logging_level=logging.WARNING, log_to_driver=log_to_driver)
    if log_to_driver:
        hook = f"{__name__}.{drop_resource_request_retries.__name__}"
        common["runtime_env"] = {"worker_process_setup_hook": hook}
    address = ray_cfg.get("address")
    host = ray_cfg.get("dashboard_host") or "127.0.0.1"
    if address:
        probe(str(address))
    try:
        if address:
            context = ray.init(address=address, **common)
        else:
            context = start_local(ray_cfg, host, common)
    except (ConnectionError, RuntimeError, ValueError) as error:
        hint = ""
        if wants_token(error):
            # `ray start` clusters use token auth; an explicit address does not turn it on
            hint = "; the cluster wants a token: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN"
        raise ConfigError(
            f"ray.address={address}: cannot start or join Ray ({error}){hint}"
        ) from None
    stop_on_sigterm_as_on_ctrl_c()  # ray.init put its own SIGTERM handler in place
    resources = ray.cluster_resources()
    url = context.dashboard_url
    if address:
        # "auto" joins whichever cluster Ray finds (the latest of several): say which
        found = (getattr(context, "address_info", None) or {}).get("gcs_address")
        address += f" (at {found})" if found and found != address else ""
    print(
        f"ray: {'joined ' + address if address else 'local cluster'} with "
        f"{resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs | dashboard: "
        + (f"http://{url}{dashboard_sign_in()}" if url else "off")
    )
    if url and not address and not is_loopback(host):
        print(exposure_note(url, token_auth()))


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def exposure_note(url: str, token_auth: bool) -> str:
    """The one line a dashboard that listens beyond loopback gets: who can reach it, and
    what stands between them and running code on this machine."""
    guard = (
        "Ray's token auth guards it: whoever holds the token can run code here, so keep it secret"
        if token_auth
        else "nothing guards it: anyone who reaches it can run code here (set RAY_AUTH_MODE=token)"
    )
    return (
        f"ray: the dashboard at http://{url} is reachable from other machines; {guard}, or set "
        "ray.dashboard_host=127.0.0.1 (docs/cluster-and-docker.md)"
    )


def token_auth() -> bool:
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token auth
        return False
    return is_token_auth_enabled()


def dashboard_sign_in() -> str:
    """Where the token is that the dashboard's page asks for, when the cluster uses Ray's
    token auth; Ray's own lookup order: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, then
    ~/.ray/auth_token (which Ray writes for a new local cluster)."""
    if not token_auth():
        return ""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return " (sign in with the token in $RAY_AUTH_TOKEN)"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token"
    return f" (sign in with the token in {path})"
