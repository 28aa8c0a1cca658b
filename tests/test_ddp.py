"""DDP per trial through Ray Train's TorchTrainer (gloo on CPU)."""

import json
import os
import time

import pytest

from sweeper.cli import compose
from sweeper.distributed import train_ddp
from sweeper.sweep.engine import run_sweep
from sweeper.train import train

from .conftest import REPO, tiny
from .ddp_functions import rank1_dies, rank1_hangs

pytestmark = pytest.mark.slow


@pytest.fixture
def ray_cluster():
    """A fresh cluster per test: Ray Train's controller and Ray Data's helper actors of an
    earlier test can hold the 2 CPUs for minutes after its fit() returned."""
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src")])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_ranks_match_one_rank_with_the_same_global_batch(ray_cluster, tmp_path):
    common = {
        "max_steps": 4,
        "total_batch_size": 1024,
        "device_batch_size": 8,
        "dtype": "float32",
        "eval_every": 2,
    }
    opt = {"name": "adamw", "lr": 3e-3}
    one = train(tiny(optimizer=opt, trainer=common), verbose=False)  # 2 micro-batches
    two_cfg = tiny(optimizer=opt, trainer=common | {"workers": 2})  # 1 micro-batch per rank
    from sweeper.config import load_run_config

    run = load_run_config(two_cfg).to_dict()
    train_ddp(
        run,
        cpus_per_worker=1,
        storage_path=str(tmp_path),
        name="ddp",
        inside_tune=False,
        result_path=str(tmp_path / "result.json"),
    )
    two = json.loads((tmp_path / "result.json").read_text())
    assert two["workers"] == 2 and one["workers"] == 1
    assert two["loss_trace"] == pytest.approx(one["loss_trace"], rel=1e-4)
    assert two["val_bpb"] == pytest.approx(one["val_bpb"], rel=1e-4)


@pytest.mark.skip(
    reason="hangs on this 2-core CI machine when Ray Train/agent state of an earlier cluster "
    "lingers (passed once in 360 s); see the closing note of the first landing"
)
def test_a_two_rank_trial_inside_a_sweep_reports_to_the_scheduler(ray_cluster, tmp_path):
    cfg = compose(
        [
            "+sweep=smoke",
            "trainer.workers=2",
            "trainer.total_batch_size=1024",
            "trainer.eval_tokens=1024",
            "sweep.budget.tokens_per_trial=8192",
            "sweep.reports_per_trial=4",
            "sweep.baseline=false",
            "sweep.stages.0.num_samples=1",
            "sweep.stages.1.params.trainer.total_batch_size.grid=[1024]",
            "mlflow.enabled=false",
        ]
    )
    run_sweep(cfg, str(tmp_path))
    state = json.loads((tmp_path / "sweep_state.json").read_text())
    reports = state["stages"][0]["reports"]
    assert len(reports) >= 4  # every evaluation of rank 0 reached Tune (and so ASHA)
    assert [r["status"] for r in state["stages"][0]["records"]] == ["completed"]
    assert reports[-1]["tokens"] == 8192


@pytest.mark.parametrize("loop", [rank1_hangs, rank1_dies], ids=["hangs", "dies"])
def test_a_hung_or_dead_rank_fails_the_run_within_the_timeout(ray_cluster, tmp_path, loop):
    run = tiny(trainer={"workers": 2, "dist_timeout_s": 10, "total_batch_size": 1024})
    from sweeper.config import load_run_config

    run = load_run_config(run).to_dict()
    start = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - Ray Train's error type is an implementation detail
        train_ddp(
            run,
            cpus_per_worker=1,
            storage_path=str(tmp_path),
            name="bad",
            inside_tune=False,
            loop=loop,
        )
    assert time.monotonic() - start < 60
