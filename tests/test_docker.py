"""Static checks of the cluster deployment in docker/: no Docker engine needed. The compose
file, the Dockerfile, the KubeRay and cluster-launcher configs and the commands of
docker/README.md must agree with each other and with the project (Makefile, pyproject)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from .conftest import REPO

DOCKER = REPO / "docker"
IMAGE = "sweeper:latest"  # compose's default image name; the cluster configs use the same


def load_compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def default(value: str) -> str:
    """A compose value with its ${VAR:-default} interpolations resolved to the defaults."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def dockerfile() -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments) of docker/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    out, stage = [], None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            stage = args.split()[-1] if " AS " in args.upper() else args
        out.append((stage, instruction, " ".join(args.split())))
    return out


def stage_of(name: str) -> list[tuple[str, str]]:
    return [(i, a) for s, i, a in dockerfile() if s == name]


def makefile_torch() -> str:
    match = re.search(r"^TORCH \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert match, "the Makefile's TORCH pin moved"
    return match.group(1)


# --- compose.yaml ---------------------------------------------------------------------------


def test_compose_has_the_head_gpu_workers_mlflow_and_postgres():
    services = load_compose()["services"]
    assert set(services) == {"ray-head", "ray-worker", "mlflow", "postgres"}

    head = services["ray-head"]
    published = {tuple(default(p).rsplit(":", 2)[-2:]) for p in map(str, head["ports"])}
    assert {("8265", "8265"), ("10001", "10001")} <= published
    command = " ".join(head["command"])
    assert "ray start --head --port=6379" in command and "--block" in command
    assert "--dashboard-host=0.0.0.0" in command and "--ray-client-server-port=10001" in command

    worker = services["ray-worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "replicas" in worker["deploy"]  # --scale ray-worker=N sets it
    assert "ray start --address=ray-head:6379" in " ".join(worker["command"])
    assert worker["depends_on"]["ray-head"]["condition"] == "service_healthy"

    mlflow = " ".join(services["mlflow"]["command"])
    assert re.search(r'--backend-store-uri="?postgresql://mlflow:.+?@postgres:5432/', mlflow)
    assert "--artifacts-destination=/mlartifacts" in mlflow and "--serve-artifacts" in mlflow
    assert "mlflow" in mlflow.split("--allowed-hosts=")[1]  # answers Host: mlflow:5000
    assert any(v.endswith(":/mlartifacts") for v in services["mlflow"]["volumes"])
    assert services["mlflow"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["postgres"]["image"].startswith("postgres:")


def test_the_database_password_has_no_default_and_is_a_secret_file_kept_out_of_git():
    compose = load_compose()
    text = (REPO / "docker" / "compose.yaml").read_text()
    assert "POSTGRES_PASSWORD:" not in text and ":-mlflow}" not in text  # no default
    postgres, mlflow = compose["services"]["postgres"], compose["services"]["mlflow"]
    assert postgres["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    assert postgres["secrets"] == mlflow["secrets"] == ["postgres_password"]
    assert "$$(cat /run/secrets/postgres_password)" in " ".join(mlflow["command"])
    secret_file = compose["secrets"]["postgres_password"]["file"]
    assert default(secret_file) == "./postgres_password"
    assert "docker/postgres_password" in (REPO / ".gitignore").read_text().splitlines()
    # the build context leaves docker/ out: the password never goes into an image
    assert "docker" in (REPO / "docker" / "Dockerfile.dockerignore").read_text().splitlines()


def test_every_ray_container_shares_one_storage_path_and_the_cluster_wiring():
    compose = load_compose()
    ray_services = {k: v for k, v in compose["services"].items() if k.startswith("ray-")}
    mounts = {name: set(service["volumes"]) for name, service in ray_services.items()}
    shared = set.intersection(*mounts.values())
    assert shared, f"no volume mounted at the same path in every Ray container: {mounts}"
    volume, _, path = next(iter(shared)).partition(":")
    assert volume in compose["volumes"]  # a named volume, not a container's own directory
    for name, service in ray_services.items():
        # sweeps run in the shared dir: the run dir (Ray Tune's storage path) is shared too
        assert service["working_dir"].startswith(path), name
        env = service["environment"]
        assert env["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" in env, name
        assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000", name
        assert default(service["image"]) == IMAGE, name
    for name in ("mlflow", "postgres"):
        for volume in compose["services"][name]["volumes"]:
            assert volume.split(":")[0] in compose["volumes"], (name, volume)


def test_compose_builds_from_files_that_exist():
    compose = load_compose()
    stages = {s for s, i, _ in dockerfile() if i == "FROM"}
    built = [s for s in compose["services"].values() if "build" in s]
    assert len(built) == 3
    for service in built:
        context = (DOCKER / service["build"]["context"]).resolve()
        assert context == REPO
        assert (context / service["build"]["dockerfile"]).is_file()
        assert service["build"]["target"] in {s.split()[-1] for s in stages}


# --- Dockerfile -----------------------------------------------------------------------------


def test_the_images_pin_the_ray_and_mlflow_the_cluster_configs_name():
    from importlib.metadata import version

    from packaging.requirements import Requirement

    pins = {
        a.split("=", 1)[0]: Requirement(a.split("=", 1)[1].strip('"'))
        for s, i, a in dockerfile()
        if s is None and i == "ARG" and a.startswith(("RAY=", "MLFLOW="))
    }
    ray, mlflow = pins["RAY"], pins["MLFLOW"]
    (ray_pin,), (mlflow_pin,) = ray.specifier, mlflow.specifier
    assert ray_pin.operator == mlflow_pin.operator == "=="
    # the releases the tests here run on, and inside pyproject.toml's ranges
    assert ray_pin.version == version("ray") and mlflow_pin.version == version("mlflow")
    documents = yaml.safe_load_all((DOCKER / "kuberay-raycluster.yaml").read_text())
    (cluster,) = [d for d in documents if d and d.get("kind") == "RayCluster"]
    assert cluster["spec"]["rayVersion"] == ray_pin.version
    readme = (DOCKER / "README.md").read_text()
    assert f'"ray[default]=={ray_pin.version}"' in readme
    assert ray.extras == {"tune", "train", "default"}
    runs = " ".join(a for i, a in stage_of("gpu") if i == "RUN")
    assert re.search(r'pip install --quiet -e \. "\$\{RAY\}" "\$\{MLFLOW\}"', runs)
    assert any(i == "RUN" and '"${MLFLOW}"' in a for i, a in stage_of("mlflow"))
    assert ("ARG", "RAY") in stage_of("gpu") and ("ARG", "MLFLOW") in stage_of("mlflow")


def test_dockerfile_installs_the_project_as_the_makefile_does():
    gpu = stage_of("gpu")
    assert gpu, "no stage named gpu"
    assert dockerfile()[-1][0] == "gpu"  # the default target of `docker build`
    base = next(a for _, i, a in dockerfile() if i == "ARG" and a.startswith("CUDA_IMAGE="))
    assert base.startswith("CUDA_IMAGE=nvidia/cuda:")
    args = dict(a.split("=", 1) for i, a in gpu if i == "ARG" and "=" in a)
    torch = makefile_torch()
    assert args["TORCH"] == torch  # the same pin as `make setup`
    torch_range = re.search(r'"(torch[<>=~!][^"]*)"', (REPO / "pyproject.toml").read_text())[1]
    from packaging.requirements import Requirement

    (pin,) = Requirement(torch).specifier
    assert pin.operator == "==", torch
    version = pin.version
    assert Requirement(torch_range).specifier.contains(version)  # pip keeps it
    runs = " ".join(a for i, a in gpu if i == "RUN")
    assert re.search(r'pip install --quiet (\$\{TORCH_INDEX_URL:\+[^}]*\} )?"\$\{TORCH\}"', runs)
    assert re.search(r"pip install --quiet -e \.(\s|$)", runs)  # make setup's -e ".[dev]"
    assert runs.index('"${TORCH}"') < runs.index("-e .")  # torch first, as the Makefile
    makefile = (REPO / "Makefile").read_text()
    assert '-m pip install --quiet "$(TORCH)"' in makefile
    assert '-m pip install --quiet -e ".[dev]"' in makefile
    assert torch in (REPO / "README.md").read_text()


def test_dockerfile_runs_as_a_non_root_user_and_carries_the_config_trees():
    for stage in ("gpu", "mlflow"):
        users = [a for i, a in stage_of(stage) if i == "USER"]
        assert users and users[-1].split(":")[0] not in ("root", "0"), stage
    copied = {a.split()[-2].rstrip("/") for i, a in stage_of("gpu") if i == "COPY"}
    copied |= {
        src.rstrip("/") for i, a in stage_of("gpu") if i == "COPY" for src in a.split()[1:-1]
    }
    assert {"pyproject.toml", "README.md", "src", "conf", "sweeps"} <= copied
    for path in ("pyproject.toml", "README.md", "src", "conf", "sweeps"):
        assert (REPO / path).exists(), path
    ignored = [
        line.strip()
        for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not {"pyproject.toml", "README.md", "src", "conf", "sweeps"} & set(ignored)
    assert ".venv" in ignored
    cmd = [a for i, a in stage_of("gpu") if i == "CMD"][-1]
    assert cmd == '["python", "-m", "sweeper"]'


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed")
def test_hadolint_finds_nothing():
    proc = subprocess.run(
        ["hadolint", str(DOCKER / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- KubeRay and the cluster launcher ---------------------------------------------------------


def test_kuberay_manifest_uses_the_image_shared_storage_and_gpu_workers():
    import ray

    docs = list(yaml.safe_load_all((DOCKER / "kuberay-raycluster.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"PersistentVolumeClaim", "RayCluster"}
    claim, cluster = kinds["PersistentVolumeClaim"], kinds["RayCluster"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    spec = cluster["spec"]
    assert cluster["apiVersion"] == "ray.io/v1" and spec["rayVersion"] == ray.__version__
    assert spec["authOptions"]["mode"] == "token"
    head = spec["headGroupSpec"]["template"]["spec"]
    groups = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    ports = {p["containerPort"] for p in head["containers"][0]["ports"]}
    assert {6379, 8265, 10001} <= ports
    for group in groups:
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == IMAGE
        assert pod["securityContext"]["runAsNonRoot"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        claim_name = volumes[mounts["/shared"]]["persistentVolumeClaim"]["claimName"]
        assert claim_name == claim["metadata"]["name"]
        assert container["workingDir"] == "/shared"
    gpus = [g["template"]["spec"]["containers"][0]["resources"] for g in spec["workerGroupSpecs"]]
    assert all(r["limits"]["nvidia.com/gpu"] >= 1 for r in gpus)


def test_cluster_launcher_config_is_valid_and_uses_the_image():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DOCKER / "ray-cluster.yaml").read_text())
    assert config["docker"]["image"].rsplit("/", 1)[-1] == IMAGE
    validate_config(prepare_config(config))  # Ray's own schema of `ray up` configs
    options = " ".join(config["docker"]["run_options"])
    assert ":/shared" in options and "RAY_AUTH_MODE=token" in options
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}


# --- docker/README.md -------------------------------------------------------------------------


def readme_commands() -> list[str]:
    text = (DOCKER / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = re.sub(r"\\\n\s*", "", "\n".join(blocks)).splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_readme_commands_name_files_that_exist():
    text = (DOCKER / "README.md").read_text()
    commands = readme_commands()
    assert any(
        c.startswith("docker build -f docker/Dockerfile -t sweeper:latest") for c in commands
    )
    assert any("docker/compose.yaml up" in c and "--scale ray-worker=" in c for c in commands)
    assert any("kubectl apply -f -" in c for c in commands)
    assert any(c.startswith("ray up") for c in commands)
    paths = set(re.findall(r"\bdocker/[\w.\-/]+", "\n".join(commands)))
    paths |= {f"docker/{link}" for link in re.findall(r"\]\(([\w.\-]+)\)", text)}
    paths |= set(re.findall(r"`(tests/[\w.]+)`", text))
    paths -= set(re.findall(r">\s*(docker/[\w.\-/]+)", "\n".join(commands)))  # made by them
    assert len(paths) >= 5
    for path in paths:
        assert (REPO / path).exists(), path
    for command in commands:
        words = shlex.split(command.replace("$(", "(").replace(")", " "))
        for flag, value in zip(words, words[1:]):
            if flag == "-f" and value != "-":
                assert (REPO / value).is_file(), command


def test_readme_sweeps_are_valid_overrides():
    from sweeper.config.compose import compose
    from sweeper.config.schema import load_run_config
    from sweeper.sweep.preflight import build_plan

    sweeps = [c.split("python -m sweeper ", 1)[1] for c in readme_commands() if "-m sweeper +" in c]
    assert len(sweeps) >= 4
    for line in sweeps:
        overrides = shlex.split(line.rstrip('"'))
        cfg = compose(overrides)
        load_run_config(cfg)
        build_plan(cfg)
        assert cfg.ray.address in ("auto", "ray://127.0.0.1:10001"), line
