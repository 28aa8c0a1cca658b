"""Data: the embedded corpus split and the token-shard loader."""

import numpy as np
import pytest
import torch

from sweeper.config.errors import ConfigError
from sweeper.config.schema import DataConfig
from sweeper.train.data import SHARD_MAGIC, is_val_file, load_shards, load_stdlib, read_shard


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


@pytest.mark.parametrize("spelling", ["relative", "dot", "symlink"])
def test_a_validation_shard_is_never_trained_on_however_its_path_is_spelt(
    tmp_path, monkeypatch, spelling
):
    from sweeper.train.data import shard_splits

    folder = tmp_path / "sh"
    folder.mkdir()
    for name, offset in (("a", 0), ("b", 1), ("val", 2)):
        _write_shard(folder / f"{name}.bin", (np.arange(3000) + offset) % 64)
    monkeypatch.chdir(tmp_path)
    if spelling == "symlink":  # the validation file under another name
        (tmp_path / "held.bin").symlink_to(folder / "val.bin")
    val_path = {"relative": "sh/val.bin", "dot": "./sh/val.bin", "symlink": "held.bin"}[spelling]
    train, val = shard_splits(str(folder / "*.bin"), val_path, vocab_size=64, min_tokens=65)
    assert (train.size, val.size) == (6000, 3000)


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


def test_an_empty_shard_with_a_header_is_refused_beside_good_ones(tmp_path):
    from sweeper.train.data import shard_splits

    _write_shard(tmp_path / "a.bin", np.arange(5000) % 500)
    _write_shard(tmp_path / "b.bin", [])  # 1024 bytes: a header that says 0 tokens
    with pytest.raises(ConfigError, match="b.bin holds no tokens"):
        shard_splits(str(tmp_path / "*.bin"), None, vocab_size=512, min_tokens=65)


def test_a_version_2_shard_says_what_it_holds(tmp_path):
    h = np.zeros(256, dtype=np.int32)
    h[:3] = [SHARD_MAGIC, 2, 100]  # llm.c's uint32 (Llama 3) shards
    (tmp_path / "l3.bin").write_bytes(h.tobytes() + np.arange(100, dtype=np.uint32).tobytes())
    with pytest.raises(ConfigError, match=r"l3.bin is version 2 \(uint32 ids\)"):
        read_shard(str(tmp_path / "l3.bin"))


def test_token_ids_beyond_vocab_are_refused(tmp_path):
    from sweeper.train.data import shard_splits

    tokens = np.arange(5000) % 500
    tokens[4000] = 900
    _write_shard(tmp_path / "t.bin", tokens)
    path = str(tmp_path / "t.bin")
    with pytest.raises(ConfigError, match="t.bin holds token id 900 >= data.vocab_size 512"):
        shard_splits(path, None, vocab_size=512, min_tokens=65)  # the driver's full scan
    # a trial does not scan again: the window that holds the id is refused when it is read
    data = load_shards(DataConfig(name="shards", path=path, vocab_size=512), min_tokens=65)
    assert (data.train[3900:3999] == tokens[3900:3999]).all()
    with pytest.raises(ConfigError, match="t.bin holds token id 900"):
        data.train[3990:4010]


def test_many_shards_are_read_as_one_array_without_a_copy(tmp_path):
    import tracemalloc

    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 50_000, size, dtype=np.uint16) for size in (300_000, 7, 200_000)]
    for i, tokens in enumerate(shards):
        _write_shard(tmp_path / f"train_{i}.bin", tokens, header=i != 1)
    _write_shard(tmp_path / "val.bin", shards[0][:1000])
    cfg = DataConfig(
        name="shards",
        path=str(tmp_path / "train_*.bin"),
        val_path=str(tmp_path / "val.bin"),
        vocab_size=50_304,
    )
    tracemalloc.start()
    data = load_shards(cfg, min_tokens=65)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 100_000  # 1 MB of tokens on disk; np.concatenate would copy all of it
    whole = np.concatenate(shards)
    assert data.train.size == whole.size
    # windows inside a shard, across one boundary, across a shard shorter than the window
    for start, stop in [(0, 257), (299_900, 300_157), (299_999, 300_010), (500_000, 500_007)]:
        assert (data.train[start:stop] == whole[start:stop]).all()
    assert data.train[whole.size - 3 :].tolist() == whole[-3:].tolist()
    # the batches equal those the concatenated array gives
    from sweeper.train.data import BatchSampler

    ours = BatchSampler(data.train, 4, 64, seed=1).step_batches(5, 2, "cpu")
    concatenated = BatchSampler(whole, 4, 64, seed=1).step_batches(5, 2, "cpu")
    for (x, y), (x_ref, y_ref) in zip(ours, concatenated, strict=True):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_the_drivers_check_reads_the_corpus_once_for_many_jobs(tmp_path):
    from sweeper.train.data import _check_shards_once, check_shards

    _write_shard(tmp_path / "a.bin", np.arange(10000) % 50)
    cfg = DataConfig(name="shards", path=str(tmp_path / "*.bin"), vocab_size=64)
    _check_shards_once.cache_clear()
    for _ in range(3):  # a multirun's jobs, e.g. model.depth=2,4,6
        check_shards(cfg, seq_len=64)
    assert _check_shards_once.cache_info().misses == 1
    _write_shard(tmp_path / "v.bin", np.full(500, 70))  # a validation id over the vocabulary
    with pytest.raises(ConfigError, match="token id 70 >= data.vocab_size 64"):
        check_shards(DataConfig(**{**vars(cfg), "val_path": str(tmp_path / "v.bin")}), seq_len=64)


def test_token_counts_in_chunks_equal_one_bincount(tmp_path):
    from sweeper.train.data import token_counts

    tokens = np.random.default_rng(2).integers(0, 300, 10_007).astype(np.uint16)
    for i, part in enumerate(np.split(tokens, [4000, 4001])):
        _write_shard(tmp_path / f"s{i}.bin", part)
    cfg = DataConfig(name="shards", path=str(tmp_path / "s*.bin"), vocab_size=300)
    data = load_shards(cfg, min_tokens=65)
    expected = np.bincount(tokens[: data.train.size], minlength=300)
    assert (token_counts(data.train, 300, chunk=999) == expected).all()
    assert (
        token_counts(data.train, 300, limit=5000, chunk=64)
        == np.bincount(tokens[:5000], minlength=300)
    ).all()


def test_a_long_id_check_says_what_it_is_doing(tmp_path, monkeypatch, capsys):
    import sweeper.train.data
    from sweeper.train.data import shard_splits

    _write_shard(tmp_path / "a.bin", np.arange(10000) % 50)
    _write_shard(tmp_path / "b.bin", np.arange(10000) % 50)
    path = str(tmp_path / "*.bin")
    shard_splits(path, None, vocab_size=64, min_tokens=65)
    assert capsys.readouterr().out == ""  # 40 kB: over before anyone could wonder
    monkeypatch.setattr(sweeper.train.data, "SCAN_NOTICE_BYTES", 30_000)
    shard_splits(path, None, vocab_size=64, min_tokens=65)
    assert capsys.readouterr().out == (
        "checking the token ids of 2 shards (0.0 GB) before anything is written\n"
    )


def test_a_run_says_when_its_evaluation_is_short_of_its_ask_or_in_bits_per_token(tmp_path):
    from sweeper.config.schema import load_run_config
    from sweeper.train.evaluation import data_notes

    _write_shard(tmp_path / "train_000.bin", np.arange(20_000) % 500 + 1)
    _write_shard(tmp_path / "val.bin", np.arange(300) % 500 + 1)
    path, val = str(tmp_path / "train_*.bin"), str(tmp_path / "val.bin")
    shards = {"name": "shards", "path": path, "val_path": val, "vocab_size": 512}
    shards["bytes_per_token"] = None  # as conf/data/shards.yaml has it
    cfg = load_run_config({"model": {"seq_len": 256}, "data": shards})
    data = load_shards(cfg.data, min_tokens=257)
    assert "300 val tokens" in data.description and "1 train file (" in data.description
    assert data_notes(data, cfg) == [
        f"each evaluation scores 256 tokens, not trainer.eval_tokens="
        f"{cfg.trainer.eval_tokens:,}: the validation split holds 300",
        "val bpb here is bits per token (data.bytes_per_token=null); set it to the corpus's "
        "average bytes per token for bits per byte",
    ]
    # the default corpus: bytes, and a split far larger than an evaluation
    stdlib = load_run_config({})
    assert data_notes(load_stdlib(stdlib.data.val_every_n_files), stdlib) == []
