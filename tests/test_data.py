"""Data: the embedded corpus split and the token-shard loader."""

import numpy as np
import pytest

from sweeper.config import ConfigError, DataConfig
from sweeper.data import SHARD_MAGIC, is_val_file, load_shards, load_stdlib, read_shard


def test_stdlib_corpus_is_real_and_split_by_file():
    data = load_stdlib()
    assert data.train.size > 5_000_000 and data.val.size > 50_000
    assert data.train.dtype == np.uint8
    text = bytes(data.val[:20000]).decode("utf-8", errors="replace")
    assert "def " in text
    # the split is a function of the path alone
    assert is_val_file("json/decoder.py", 50) == is_val_file("json/decoder.py", 50)
    assert 0.005 < data.val.size / data.train.size < 0.06


def _write_shard(path, tokens, header=True, lie=0):
    with open(path, "wb") as f:
        if header:
            h = np.zeros(256, dtype=np.int32)
            h[:3] = [SHARD_MAGIC, 1, len(tokens) + lie]
            f.write(h.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


@pytest.mark.parametrize("header", [True, False])
def test_shards_with_and_without_header(tmp_path, header):
    tokens = np.arange(5000) % 1000
    _write_shard(tmp_path / "train_000.bin", tokens, header)
    _write_shard(tmp_path / "val_000.bin", tokens[:800], header)
    assert (read_shard(str(tmp_path / "train_000.bin")) == tokens).all()
    cfg = DataConfig(
        name="shards",
        path=str(tmp_path / "train_*.bin"),
        val_path=str(tmp_path / "val_*.bin"),
        vocab_size=1024,
    )
    data = load_shards(cfg, min_tokens=65)
    assert data.train.size == 5000 and data.val.size == 800


def test_shards_without_val_files_hold_out_a_tail(tmp_path):
    _write_shard(tmp_path / "a.bin", np.arange(10000) % 50)
    cfg = DataConfig(name="shards", path=str(tmp_path / "*.bin"), vocab_size=64)
    data = load_shards(cfg, min_tokens=65)
    assert data.train.size + data.val.size == 10000 and data.val.size >= 100


def test_corrupt_shards_are_named(tmp_path):
    _write_shard(tmp_path / "bad.bin", np.arange(100), lie=7)
    with pytest.raises(ConfigError, match="bad.bin"):
        read_shard(str(tmp_path / "bad.bin"))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="odd.bin"):
        read_shard(str(tmp_path / "odd.bin"))


def test_token_ids_beyond_vocab_are_refused(tmp_path):
    _write_shard(tmp_path / "t.bin", np.full(5000, 900))
    cfg = DataConfig(name="shards", path=str(tmp_path / "t.bin"), vocab_size=512)
    with pytest.raises(ConfigError, match="vocab_size"):
        load_shards(cfg, min_tokens=65)


def test_the_drivers_check_reads_the_corpus_once_for_many_jobs(tmp_path):
    from sweeper.data import _check_shards_once, check_shards

    _write_shard(tmp_path / "a.bin", np.arange(10000) % 50)
    cfg = DataConfig(name="shards", path=str(tmp_path / "*.bin"), vocab_size=64)
    _check_shards_once.cache_clear()
    for _ in range(3):  # a multirun's jobs, e.g. model.depth=2,4,6
        check_shards(cfg, seq_len=64)
    assert _check_shards_once.cache_info().misses == 1
    _write_shard(tmp_path / "v.bin", np.full(500, 70))  # a validation id over the vocabulary
    with pytest.raises(ConfigError, match="token id 70 >= data.vocab_size 64"):
        check_shards(DataConfig(**{**vars(cfg), "val_path": str(tmp_path / "v.bin")}), seq_len=64)
