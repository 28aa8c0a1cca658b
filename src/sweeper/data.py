"""Training data: the embedded stdlib corpus and memory-mapped token shards.

Both become a pair of 1-D token arrays (train, val). Training batches are random windows
drawn with a seeded generator whose state is part of a checkpoint, so a resumed run sees
exactly the batches it would have seen; validation uses fixed, contiguous windows so every
evaluation (and every trial of a sweep) scores the same tokens.
"""

from __future__ import annotations

import functools
import glob
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sweeper.config import ConfigError, DataConfig

SHARD_MAGIC = 20240520  # modded-nanogpt / llm.c header: 256 int32, [magic, version, n_tokens]
SHARD_HEADER_INTS = 256
# folders of the stdlib that are test suites or vendored packages, not library source
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class TokenData:
    train: np.ndarray  # 1-D integer tokens (uint8 or uint16; memmap for shards)
    val: np.ndarray
    vocab_size: int
    bytes_per_token: float | None
    description: str


# --- the stdlib corpus ------------------------------------------------------------------
def stdlib_files(root: str | None = None) -> list[Path]:
    """The standard library's own .py files, sorted by path: a deterministic corpus."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return sorted(files)


def is_val_file(relative_path: str, every_n: int) -> bool:
    # a hash of the path, not the position in the list: adding one file to the stdlib
    # (a new Python version) moves no other file between the splits
    return zlib.crc32(relative_path.encode()) % every_n == 0


@functools.lru_cache(maxsize=2)
def load_stdlib(every_n: int = 50, root: str | None = None) -> TokenData:
    base = Path(root or sysconfig.get_paths()["stdlib"])
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for path in stdlib_files(root):
        # a NUL byte never occurs in source: it marks the file boundary for the model
        parts[is_val_file(path.relative_to(base).as_posix(), every_n)].append(
            path.read_bytes() + b"\0"
        )
    train, val = (np.frombuffer(b"".join(parts[v]), dtype=np.uint8) for v in (False, True))
    n_files = len(parts[False]) + len(parts[True])
    return TokenData(
        train,
        val,
        256,
        1.0,
        f"stdlib corpus: {n_files} files, {train.size / 1e6:.1f}M train / {val.size / 1e6:.2f}M val bytes",
    )


# --- token shards -----------------------------------------------------------------------
def read_shard(path: str) -> np.ndarray:
    """Memory-map a uint16 token shard, with or without the 256-int32 header."""
    if not os.path.isfile(path):
        raise ConfigError(f"token shard {path} is not a file (a directory? use a glob: dir/*.bin)")
    size = os.path.getsize(path)
    header = np.fromfile(path, dtype=np.int32, count=SHARD_HEADER_INTS) if size >= 1024 else None
    if header is not None and header[0] == SHARD_MAGIC:
        n_tokens = int(header[2])
        if header[1] != 1 or size != 1024 + 2 * n_tokens:
            raise ConfigError(
                f"corrupt token shard {path}: header says {n_tokens} tokens (version "
                f"{header[1]}), file has {(size - 1024) // 2}"
            )
        return np.memmap(path, dtype=np.uint16, mode="r", offset=1024, shape=(n_tokens,))
    if size == 0 or size % 2:
        raise ConfigError(f"corrupt token shard {path}: {size} bytes is not a uint16 array")
    return np.memmap(path, dtype=np.uint16, mode="r")


def check_shards(cfg: DataConfig, seq_len: int) -> None:
    """Every check `load_shards` makes (headers, the held-out tail, token ids below the
    vocabulary), run by the driver before Hydra makes the run dir. Memory-mapped and one
    file at a time, so it costs one read of the corpus and no copy; once per process for
    the same files (a multirun checks up to 64 jobs)."""
    _check_shards_once(cfg.path, cfg.val_path, cfg.vocab_size, seq_len + 1)


@functools.lru_cache(maxsize=16)
def _check_shards_once(path: str, val_path: str | None, vocab_size: int, min_tokens: int) -> None:
    shard_splits(path, val_path, vocab_size, min_tokens)


def shard_splits(
    path: str, val_path: str | None, vocab_size: int, min_tokens: int
) -> tuple[list[str], list[np.ndarray], np.ndarray]:
    """The training files, their token arrays and the validation tokens, checked."""
    train_files = sorted(glob.glob(path))
    val_files = sorted(glob.glob(val_path)) if val_path else []
    train_files = [f for f in train_files if f not in val_files]
    if not train_files:
        raise ConfigError(f"data.path matches no training shard: {path}")
    trains = [read_shard(f) for f in train_files]
    if val_files:
        vals = [read_shard(f) for f in val_files]
    else:
        # no validation files: hold out the tail of the last shard (never trained on)
        last = trains[-1]
        hold = max(min_tokens, last.size // 100)
        if last.size <= 2 * hold:
            raise ConfigError(f"token shard {train_files[-1]} is too small to hold out validation")
        trains[-1], vals = last[:-hold], [last[-hold:]]
    top = max(int(tokens.max()) for tokens in trains + vals)
    if top >= vocab_size:
        raise ConfigError(f"token shards hold token id {top} >= data.vocab_size {vocab_size}")
    val = vals[0] if len(vals) == 1 else np.concatenate(vals)
    return train_files, trains, val


def load_shards(cfg: DataConfig, min_tokens: int) -> TokenData:
    train_files, trains, val = shard_splits(cfg.path, cfg.val_path, cfg.vocab_size, min_tokens)
    train = trains[0] if len(trains) == 1 else np.concatenate(trains)
    return TokenData(
        train,
        val,
        cfg.vocab_size,
        cfg.bytes_per_token,
        f"token shards: {len(train_files)} train files ({train.size / 1e6:.1f}M tokens), "
        f"{val.size / 1e6:.2f}M val tokens",
    )


def load_data(cfg: DataConfig, seq_len: int) -> TokenData:
    if cfg.name == "stdlib":
        return load_stdlib(cfg.val_every_n_files)
    return load_shards(cfg, min_tokens=seq_len + 1)


def unigram_bpb(data: TokenData) -> float:
    """Bits per byte of the best context-free guess: the validation split scored with the
    training split's token frequencies (add-one smoothed). A model must beat this."""
    counts = np.bincount(np.asarray(data.train[:50_000_000]), minlength=data.vocab_size) + 1.0
    log2_p = np.log2(counts / counts.sum())
    val_counts = np.bincount(np.asarray(data.val), minlength=data.vocab_size)
    bits_per_token = -(val_counts * log2_p).sum() / val_counts.sum()
    return float(bits_per_token / (data.bytes_per_token or 1.0))


# --- batches ----------------------------------------------------------------------------
class BatchSampler:
    """Random (B, T) windows of the training tokens, a pure function of (seed, step).

    Each optimizer step draws its `world * accum` micro-batches from a generator seeded
    with (seed, step); rank r takes micro-batches r, r + world, ... So a resumed run needs
    no sampler state (the step is the data position), a checkpoint restores on any world
    size, and 2 ranks x 1 micro-batch see exactly the windows of 1 rank x 2 micro-batches.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
    ):
        if tokens.size <= seq_len + 1:
            raise ConfigError(
                f"training data has {tokens.size} tokens, fewer than model.seq_len + 1"
            )
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.rank, self.world = seed, rank, world

    def step_batches(self, step: int, accum: int, device):
        """This rank's `accum` micro-batches (x, y) of optimizer step `step`."""
        rng = np.random.default_rng([self.seed, step])
        high = self.tokens.size - self.seq_len - 1
        starts = rng.integers(0, high, size=(accum * self.world, self.batch_size))
        for micro in range(accum):
            yield self._batch(starts[micro * self.world + self.rank], device)

    def _batch(self, starts: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
        windows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        batch = torch.from_numpy(windows)  # (B, T+1)
        if torch.device(device).type == "cuda":
            # a copy from pageable memory first waits for the GPU's queue to drain; a pinned
            # one overlaps it (for d12 on an H100 the gain was within the noise)
            batch = batch.pin_memory()
        batch = batch.to(device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]


def val_windows(tokens: np.ndarray, seq_len: int, n_tokens: int, batch_size: int):
    """Fixed windows spread evenly over the validation split (every file type is scored,
    not only the first files), in batches."""
    n_windows = max(1, min(n_tokens // seq_len, (tokens.size - 1) // seq_len))
    starts = np.linspace(0, tokens.size - seq_len - 1, n_windows).astype(np.int64)
    for first in range(0, n_windows, batch_size):
        chunk = starts[first : first + batch_size]
        windows = np.stack([tokens[s : s + seq_len + 1] for s in chunk])
        batch = torch.from_numpy(windows.astype(np.int64))
        yield batch[:, :-1], batch[:, 1:]
