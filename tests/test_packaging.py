"""An installed wheel (not only a checkout) carries conf/ and sweeps/ and runs from them."""

import os
import subprocess
import sys
import zipfile

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


def test_wheel_carries_the_config_tree_and_composes_a_sweep_from_it(tmp_path):
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(tmp_path.glob("sweeper-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for sweep in ("lr", "lr_bs", "full", "smoke", "scaling", "lr_scaling", "lr_bs_scaling"):
        assert f"sweeper/_configs/conf/sweep/{sweep}.yaml" in names
    assert "sweeper/_configs/conf/config.yaml" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "from sweeper.config.paths import config_dir; from sweeper.config.compose import compose;"
        "print(config_dir()); print(compose(['+sweep=lr_bs']).sweep.name)"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, name = proc.stdout.split()
    assert where.startswith(str(site)) and name == "lr_bs"
