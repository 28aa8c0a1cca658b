"""The config tree composes in every combination; bad input is one line, exit 2, no files."""

import json

import pytest

from sweeper.cli import compose
from sweeper.config import ConfigError, load_run_config
from sweeper.paths import config_dir

from .conftest import run_cli

GROUPS = ["model", "optimizer", "scheduler", "data", "trainer"]


def _options(group):
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "override", [f"{g}={o}" for g in GROUPS for o in _options(g) if (g, o) != ("data", "shards")]
)
def test_every_group_option_composes_and_validates(override):
    # the GPU-sized models come with the GPU trainer (their sequences exceed the CPU batch)
    extra = ["trainer=gpu"] if override in ("model=d12", "model=d20") else []
    cfg = load_run_config(compose([override, *extra]))
    assert cfg.model.vocab_size == 256


def test_shards_option_composes_with_a_path(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\0\0" * 100)
    cfg = load_run_config(compose(["data=shards", f"data.path={tmp_path}/*.bin"]))
    assert cfg.data.name == "shards" and cfg.model.vocab_size == 50304


def test_every_yaml_key_is_commented_for_a_first_time_reader():
    for path in config_dir().rglob("*.yaml"):
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        assert lines[0].startswith("#"), f"{path} has no header comment"


def test_defaults_match_the_schema_defaults():
    # the dataclass defaults document the same run as conf/: drift would mislead readers
    from sweeper.config import RunConfig

    composed = load_run_config(compose([])).to_dict()
    schema = RunConfig().to_dict()
    for section in ("optimizer", "scheduler", "trainer"):
        assert composed[section] == schema[section], section


BAD_INPUTS = [
    (["model.depth=0"], "model.depth"),
    (["model.depth=abc"], "model.depth"),
    (["model.seq_len=1.5"], "model.seq_len"),
    (["optimizer.matrix_lr=0"], "optimizer.matrix_lr"),
    (["optimizer.embedding_lr=-1"], "optimizer.embedding_lr"),
    (["optimizer=adamw", "optimizer.lr=0"], "optimizer.lr"),
    (["trainer.total_batch_size=1000"], "trainer.total_batch_size"),
    (["trainer.device_batch_size=0"], "trainer.device_batch_size"),
    (["data.name=wikipedia"], "data.name"),
    (["data=wikipedia"], "data"),
    (["data=shards", "data.path=/nonexistent/*.bin"], "data.path"),
    (["trainer.device=tpu"], "trainer.device"),
    (["trainer.dtype=fp8"], "trainer.dtype"),
    (["foo.bar=1"], "foo"),
    (["+model.foo=1"], "foo"),
    (["trainer.budget_tokens=null"], "trainer.max_steps"),
    (["trainer.max_steps=5"], "exactly one"),
    (["scheduler.warmup_ratio=1.5"], "scheduler.warmup_ratio"),
    (["model.head_dim=48"], "model.head_dim"),
]


@pytest.mark.parametrize("args, names", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, names):
    proc = run_cli(args, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert names in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert list(tmp_path.iterdir()) == [], "bad input must write nothing"


def test_config_error_names_key_in_process():
    with pytest.raises(ConfigError, match="model.depth"):
        load_run_config({"model": {"depth": 0}})


def test_single_run_writes_result_json(tmp_path):
    args = [
        "model=tiny",
        "trainer.max_steps=4",
        "trainer.budget_tokens=null",
        "trainer.total_batch_size=512",
        "trainer.device_batch_size=8",
        "trainer.eval_every=2",
        "trainer.eval_tokens=1024",
        f"hydra.run.dir={tmp_path}/run",
    ]
    proc = run_cli(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "completed" and result["steps"] == 4
    assert result["mfu"] is None and result["device"] == "cpu" and result["workers"] == 1
    assert "val bpb" in proc.stdout  # progress was printed
