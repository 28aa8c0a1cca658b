"""DDP per trial through Ray Train's TorchTrainer (gloo on CPU)."""

import json
import logging
import time

import pytest

from sweeper.config.compose import compose
from sweeper.sweep.cluster import RAY_TRAIN_RESOURCE_REQUESTS, drop_resource_request_retries
from sweeper.sweep.preflight import build_plan
from sweeper.sweep.runner import run_sweep
from sweeper.train.distributed import train_ddp
from sweeper.train.loop import train

from .conftest import local_ray, run_cli, tiny
from .ddp_functions import rank0_saves_slowly, rank1_dies, rank1_hangs

pytestmark = pytest.mark.slow


@pytest.fixture
def ray_cluster():
    """A fresh cluster per test: Ray Train's controller and Ray Data's helper actors of an
    earlier test can hold the 2 CPUs for minutes after its fit() returned."""
    with local_ray():
        yield


def test_two_ranks_match_one_rank_and_their_checkpoint_resumes_on_one_rank(ray_cluster, tmp_path):
    """Two ranks of one micro-batch each train as one rank of two micro-batches; rank 0
    saves the unwrapped model, so the 2-rank run's checkpoint at step 4 goes on on 1 rank
    exactly as an uninterrupted 1-rank run (constant LR: the schedule does not depend on
    the run length)."""
    from sweeper.config.schema import load_run_config
    from sweeper.train.checkpoint import load_latest_state

    common = {
        "total_batch_size": 1024,
        "device_batch_size": 8,
        "dtype": "float32",
        "eval_every": 2,
        "checkpoint_every_eval": True,
    }
    sections = {
        "optimizer": {"name": "adamw", "lr": 3e-3},
        "scheduler": {"name": "constant", "warmup_ratio": 0.0, "warmdown_ratio": 0.0},
    }
    two = load_run_config(tiny(**sections, trainer=common | {"max_steps": 4, "workers": 2}))
    result = train_ddp(
        two.to_dict(),
        cpus_per_worker=1,
        storage_path=str(tmp_path),
        name="two",
        inside_tune=False,
        result_path=str(tmp_path / "result.json"),
    )
    one = tiny(**sections, trainer=common | {"max_steps": 8})  # 2 micro-batches a step
    straight = train(one, verbose=False)
    two_ranks = json.loads((tmp_path / "result.json").read_text())
    assert (two_ranks["workers"], straight["workers"]) == (2, 1)
    assert two_ranks["loss_trace"] == pytest.approx(straight["loss_trace"][:4], rel=1e-4)
    at_4 = next(h["val_bpb"] for h in straight["history"] if h["step"] == 4)
    assert two_ranks["val_bpb"] == pytest.approx(at_4, rel=1e-4)

    with result.checkpoint.as_directory() as folder:
        state = load_latest_state(folder)
    assert state["step"] == 4
    resumed = train(one, resume_state=state, verbose=False)
    assert resumed["steps"] == 8 and len(resumed["loss_trace"]) == 8
    assert resumed["loss_trace"] == pytest.approx(straight["loss_trace"], rel=1e-4)
    assert resumed["val_bpb"] == pytest.approx(straight["val_bpb"], rel=1e-4)


def test_two_rank_trials_inside_a_sweep_report_to_asha_and_one_mlflow_run(ray_cluster, tmp_path):
    """Two DDP trials one after the other on a 2-CPU cluster: the first one's worker group
    must not outlive it (Tune kills a finished trial before Ray Train cleans up)."""
    from mlflow import MlflowClient

    db = f"sqlite:///{tmp_path}/mlflow.db"
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
            f"mlflow.tracking_uri={db}",
        ]
    )
    run_sweep(build_plan(cfg), str(tmp_path / "run"))
    state = json.loads((tmp_path / "run" / "sweep_state.json").read_text())
    for stage in state["stages"]:
        assert [r["status"] for r in stage["records"]] == ["completed"]
        steps = [r["step"] for r in stage["reports"]]
        assert steps == [2, 4, 6, 8]  # every evaluation of rank 0 reached Tune (and ASHA)
        assert stage["reports"][-1]["tokens"] == 8192
    client = MlflowClient(db)
    experiment = client.get_experiment_by_name("sweeper")
    runs = client.search_runs([experiment.experiment_id])
    trials = [r for r in runs if r.data.tags.get("role") == "trial"]
    assert len(trials) == 2 and {r.info.status for r in trials} == {"FINISHED"}
    for run in trials:
        history = client.get_metric_history(run.info.run_id, "val_bpb")
        assert sorted(m.step for m in history) == [2, 4, 6, 8]  # one run, each step once


def test_only_placement_groups_of_dead_actors_count_as_orphans(ray_cluster):
    import ray
    from ray.util.placement_group import placement_group

    from sweeper.train.distributed import orphaned_placement_groups

    @ray.remote(num_cpus=0)
    class Creator:  # stands in for Ray Train's controller, killed with its Tune trial
        def make(self):
            group = placement_group([{"CPU": 1}])
            ray.get(group.ready())
            return group.id.hex()

    creator = Creator.remote()
    orphan = ray.get(creator.make.remote())
    driver_group = placement_group([{"CPU": 1}])  # like Tune's trial groups: never touched
    ray.get(driver_group.ready())
    assert orphaned_placement_groups() == []  # its creator is alive
    ray.kill(creator)
    deadline = time.monotonic() + 30
    while not (found := orphaned_placement_groups()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [group.id.hex() for group in found] == [orphan]


@pytest.mark.parametrize("loop", [rank1_hangs, rank1_dies], ids=["hangs", "dies"])
def test_a_hung_or_dead_rank_fails_the_run_within_the_timeout(ray_cluster, tmp_path, loop):
    run = tiny(trainer={"workers": 2, "dist_timeout_s": 10, "total_batch_size": 1024})
    from sweeper.config.schema import load_run_config

    run = load_run_config(run).to_dict()
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    with pytest.raises(Exception):  # noqa: B017 - Ray Train's error type is an implementation detail
        train_ddp(
            run,
            cpus_per_worker=1,
            storage_path=str(tmp_path),
            name="bad",
            inside_tune=False,
            run_dir=str(ranks),  # where each rank notes when its loop began
            loop=loop,
        )
    failed = time.time()
    began = [float((ranks / f"rank{rank}").read_text()) for rank in (0, 1)]  # both ran
    # from the ranks' start: the 10 s timeout and teardown, ~18 s here. Ray Train's start
    # of the ranks before it took 10-150 s on a loaded machine, so it is not counted.
    # Without the short timeout a hung gloo rank waits out torch's 30-minute default.
    assert failed - max(began) < 10 + 60, failed - max(began)


def test_a_save_longer_than_the_timeout_does_not_fail_a_two_rank_run(ray_cluster, tmp_path):
    """Rank 0 writes a single run's checkpoint while rank 1 waits: a save longer than
    trainer.dist_timeout_s (there for hung ranks) must not end the run."""
    from sweeper.config.schema import load_run_config

    # 15 s, not less: on a loaded machine the two ranks reach DDP's first collective (the
    # check of the model's shapes) seconds apart, and a shorter timeout failed the run there
    trainer = {"workers": 2, "dist_timeout_s": 15, "total_batch_size": 1024, "max_steps": 2}
    run = load_run_config(tiny(trainer=trainer | {"eval_every": 2, "checkpoint_every_eval": True}))
    train_ddp(
        run.to_dict(),
        cpus_per_worker=1,
        storage_path=str(tmp_path / "ray"),
        name="slow_save",
        inside_tune=False,
        result_path=str(tmp_path / "result.json"),
        run_dir=str(tmp_path),
        loop=rank0_saves_slowly,
    )
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "completed"
    assert json.loads((tmp_path / "checkpoint" / "checkpoint.json").read_text())["step"] == 2


def test_ray_trains_warning_of_a_slow_resource_request_is_dropped_from_a_runs_output():
    # the warning (and traceback) a busy machine gets from Ray Train's controller, logged by
    # Ray's own client: fails when Ray renames the logger or rewords the message
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client

    logger = autoscaling_coordinator_client.logger
    assert logger.name == RAY_TRAIN_RESOURCE_REQUESTS
    client = autoscaling_coordinator_client.TrainAutoscalingCoordinatorClient("train-x")
    client.__dict__["_autoscaling_coordinator"] = None  # the request fails, as a timed-out one
    printed, filters = [], list(logger.filters)
    handler = logging.Handler()
    handler.emit = printed.append
    logger.addHandler(handler)
    try:
        client.send_resource_request(ScalingConfig(num_workers=2), 2)
        client.cancel_resource_request()
        assert [r.getMessage().split(".")[0] for r in printed] == [
            "Failed to send resource request for train-x",
            "Failed to cancel resource request for train-x",
        ]
        drop_resource_request_retries()  # what every worker of a single DDP run runs first
        client.send_resource_request(ScalingConfig(num_workers=2), 2)
        client.cancel_resource_request()
        assert len(printed) == 2
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = filters


def test_a_two_rank_run_out_of_memory_ends_with_one_line_naming_the_batch(tmp_path):
    # the command a user types (no cluster of the tests': it starts its own). Each rank's
    # embedding output is 73 GiB, over the 64 GiB of address space given to the command
    # and everything it starts, so both ranks' allocations fail whatever the machine
    batch = ["trainer.device_batch_size=300000", "trainer.total_batch_size=153600000"]
    batch += ["trainer.budget_tokens=153600000"]  # one step: less is refused up front
    args = ["trainer.workers=2", "trainer.threads=1", *batch, "hydra.run.dir=run"]
    proc = run_cli(args, cwd=tmp_path, timeout=300, memory_limit=64 * 2**30)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # a user's mistake, not a bug: no rank's traceback nor Ray Train's report of one
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: out of memory (asked for 73.2 GiB more): "), last
    assert "trainer.device_batch_size=300000" in last
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "failed" and "can't allocate memory" in result["error"]
    assert result["out_of_memory"] == "73.2 GiB"


def test_an_interrupted_two_rank_run_goes_on_from_rank_0s_checkpoint(tmp_path):
    """Rank 0 keeps a single run's checkpoint in its run dir (not in Ray's storage), and
    `trainer.resume=true` starts both ranks from it: the run's losses are those of one
    rank training the same global batch straight through. The resumed command's output is
    a two-rank run's as a user sees it: rank 0's lines once, none of Ray's noise."""
    from sweeper.config.schema import load_run_config

    from .test_run_resume import _interrupt_after_first_checkpoint

    steps = 120  # a checkpoint every 5: the interrupt lands well before the end
    args = ["model=tiny", "trainer.workers=2", "trainer.threads=1", f"trainer.max_steps={steps}"]
    args += ["trainer.total_batch_size=2048", "trainer.device_batch_size=16"]
    args += ["trainer.dtype=float32", "optimizer=adamw", "optimizer.lr=3e-3"]
    args += [
        "trainer.eval_every=5",
        "trainer.eval_tokens=1024",
        "trainer.checkpoint_every_eval=true",
    ]
    code, err = _interrupt_after_first_checkpoint([*args, "hydra.run.dir=run"], tmp_path)
    assert code == 130, err[-3000:]
    step = json.loads((tmp_path / "run" / "checkpoint" / "checkpoint.json").read_text())["step"]
    assert "; continue from step" in err and 5 <= step < steps
    assert not list((tmp_path / "run").glob("ray/**/checkpoint_*"))
    # rank 0's evaluations reached MLflow as they were taken: the interrupted run has
    # every one up to its checkpoint's (it sends an evaluation before saving)
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = json.loads((tmp_path / "run" / "mlflow_run.json").read_text())["run_id"]
    stopped = client.get_run(run_id)
    assert (stopped.info.status, stopped.data.tags["status"]) == ("KILLED", "interrupted")
    before = [m.step for m in client.get_metric_history(run_id, "val_bpb")]
    assert before[: step // 5] == list(range(5, step + 1, 5)), (before, step)

    proc = run_cli([*args, "hydra.run.dir=run", "trainer.resume=true"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert f"resumed at step {step}/{steps} from a checkpoint" in said, said[-3000:]
    # rank 0's lines reach the terminal once: Ray Train's print patch also logged each
    # one to stderr, and it logged every report's metrics dict there too
    run_line = f"run: {steps} steps x 2048 tokens (accum 1, workers 2)"
    for line in (run_line, f"step {steps:5d}/{steps} | val bpb"):
        assert said.count(line) == 1, said[-3000:]
    assert "Reporting training result" not in said and "Requesting resources" not in said
    # nor Ray's core worker's error about the preemption watcher a local cluster has no use for
    assert "core_worker.cc" not in said and "PreemptionWatcher" not in said, said[-3000:]
    resumed = json.loads((tmp_path / "run" / "result.json").read_text())
    assert resumed["status"] == "completed" and resumed["workers"] == 2
    # the larger rank's peak (an all-reduce at each report): a process with torch and a model
    peak, at_last_report = resumed["peak_memory_gib"], resumed["history"][-1]["peak_memory_gib"]
    assert 0.1 < at_last_report <= peak < 8  # the run's peak is read after its last report
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("completed: val_bpb ") and ", peak memory " in last, last
    assert last.endswith(", curves.png") and (tmp_path / "run" / "curves.png").is_file()
    one_rank = compose([*args, "trainer.workers=1", "trainer.budget_tokens=null"])
    straight = train(load_run_config(one_rank), verbose=False)
    assert resumed["loss_trace"] == pytest.approx(straight["loss_trace"], rel=1e-4)
    assert resumed["val_bpb"] == pytest.approx(straight["val_bpb"], rel=1e-4)
    # the same MLflow run goes on, every evaluation once
    assert client.get_run(run_id).info.status == "FINISHED"
    logged = sorted(m.step for m in client.get_metric_history(run_id, "val_bpb"))
    assert logged == [h["step"] for h in resumed["history"]] == list(range(5, steps + 1, 5))
