"""Training data: the embedded stdlib corpus and memory-mapped token shards.

Both become a pair of 1-D token arrays (train, val). Training batches are random windows
drawn with a seeded generator whose state is part of a checkpoint, so a resumed run sees
exactly the batches it would have seen; validation uses fixed, contiguous windows so every
evaluation (and every trial of a sweep) scores the same tokens.
"""

from __future__ import annotations

import bisect
import functools
import glob
import itertools
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sweeper.config.errors import ConfigError
from sweeper.config.schema import DataConfig

SHARD_MAGIC = 20240520  # modded-nanogpt / llm.c header: 256 int32, [magic, version, n_tokens]
SHARD_HEADER_INTS = 256
# the driver's id check says what it is doing above this size: it reads at ~10 GB/s from the
# page cache and 1-2 GB/s from this machine's disk, so FineWeb-10B's 20 GB take a while
SCAN_NOTICE_BYTES = 2 * 10**9
# folders of the stdlib that are test suites or vendored packages, not library source
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class TokenData:
    train: np.ndarray | ShardedTokens  # 1-D integer tokens: uint8, or uint16 shards
    val: np.ndarray | ShardedTokens
    vocab_size: int
    bytes_per_token: float | None
    description: str


# --- the stdlib corpus ------------------------------------------------------------------
def is_val_file(relative_path: str, every_n: int) -> bool:
    # a hash of the path, not the position in the list: adding one file to the stdlib
    # (a new Python version) moves no other file between the splits
    return zlib.crc32(relative_path.encode()) % every_n == 0


def stdlib_split(every_n: int, root: str | None = None):
    """(path, whether it is held out for validation) of the standard library's own .py
    files, sorted by path: a deterministic corpus."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    for path in sorted(files):
        yield path, is_val_file(path.relative_to(base).as_posix(), every_n)


@functools.lru_cache(maxsize=2)
def load_stdlib(every_n: int = 50, root: str | None = None) -> TokenData:
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for path, held_out in stdlib_split(every_n, root):
        # a NUL byte never occurs in source: it marks the file boundary for the model
        parts[held_out].append(path.read_bytes() + b"\0")
    train, val = (np.frombuffer(b"".join(parts[v]), dtype=np.uint8) for v in (False, True))
    n_files = len(parts[False]) + len(parts[True])
    return TokenData(
        train,
        val,
        256,
        1.0,
        f"stdlib corpus: {n_files} files, {train.size / 1e6:.1f}M train / {val.size / 1e6:.2f}M val bytes",
    )


@functools.lru_cache(maxsize=4)
def check_stdlib_split(every_n: int, seq_len: int, root: str | None = None) -> None:
    """Both sides of the stdlib split hold a window of seq_len + 1 bytes, from the files'
    sizes (no read): data.val_every_n_files=1 leaves nothing to train on, a huge value
    nothing to validate on, and val_bpb would be NaN."""
    sizes = {False: 0, True: 0}
    for path, held_out in stdlib_split(every_n, root):
        sizes[held_out] += path.stat().st_size + 1
    for held_out, side in ((True, "validation"), (False, "training")):
        if sizes[held_out] < seq_len + 1:
            raise ConfigError(
                f"data.val_every_n_files={every_n} leaves {sizes[held_out]} bytes for {side}, "
                f"fewer than model.seq_len + 1 = {seq_len + 1} (the default is 50)"
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
        if header[1] != 1:  # llm.c's version 2 holds uint32 ids (its Llama 3 shards)
            raise ConfigError(
                f"token shard {path} is version {header[1]} (uint32 ids); sweeper reads "
                "version 1, uint16 ids"
            )
        if n_tokens == 0:
            raise ConfigError(f"token shard {path} holds no tokens (its header says 0)")
        if size != 1024 + 2 * n_tokens:
            raise ConfigError(
                f"corrupt token shard {path}: header says {n_tokens} tokens, file has "
                f"{(size - 1024) // 2}"
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


class ShardedTokens:
    """Token shards read as one 1-D array, without copying them into memory.

    A corpus prepared elsewhere comes in many files (FineWeb-10B: 100 shards, 20 GB);
    `np.concatenate` of their memmaps would copy all of it into every trial's memory. Reads
    are windows; one that crosses a shard boundary is joined from both, so the windows
    equal those of the concatenation. What is read is checked against the vocabulary (one
    max per batch), which lets a trial skip the full scan the driver already made.
    """

    def __init__(self, files: list[str], shards: list[np.ndarray], vocab_size: int):
        # plain ndarray views of the memmaps: slicing a memmap runs Python code per window
        self.files, self.vocab_size = files, vocab_size
        self.shards = [np.asarray(shard) for shard in shards]
        self.offsets = list(itertools.accumulate((shard.size for shard in shards), initial=0))
        self.size = self.offsets[-1]

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("ShardedTokens reads contiguous slices only")
        start, stop, _ = key.indices(self.size)
        return self._checked(self._window(start, max(0, stop - start)))

    def windows(self, starts, length: int) -> np.ndarray:
        """The (len(starts), length) batch of windows at these offsets."""
        return self._checked(np.stack([self._window(int(s), length) for s in starts]))

    def _window(self, start: int, length: int) -> np.ndarray:
        index = bisect.bisect_right(self.offsets, start) - 1
        begin = start - self.offsets[index]
        window = self.shards[index][begin : begin + length]
        while window.size < length and index + 1 < len(self.shards):
            index += 1
            window = np.concatenate([window, self.shards[index][: length - window.size]])
        return window

    def _checked(self, tokens: np.ndarray) -> np.ndarray:
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            # the file is found only on the error path, so a clean read pays one max
            for name, shard in zip(self.files, self.shards):
                check_token_ids(name, shard, self.vocab_size)
        return tokens


# tokens looked at for a file of wider ints: a real uint16 corpus puts no id 0 at every
# odd place of its first 64k tokens, while int32 (or int64) ids below 65536 always do
WIDTH_SAMPLE = 1 << 16


def check_token_ids(name: str, tokens: np.ndarray, vocab_size: int) -> None:
    head = tokens[:WIDTH_SAMPLE]
    if head.size >= 64 and not head[1::2].any() and head[0::2].any():
        # read as uint16, every such id is itself and a 0: it would train, on garbage
        raise ConfigError(
            f"token shard {name} looks like 32-bit ints (every second 16-bit word is 0); "
            "shards hold uint16 ids: write them with np.asarray(ids, dtype=np.uint16).tofile()"
        )
    top = int(tokens.max())
    if top >= vocab_size:
        raise ConfigError(
            f"token shard {name} holds token id {top} >= data.vocab_size {vocab_size}"
        )


def read_windows(tokens: np.ndarray | ShardedTokens, starts, length: int) -> np.ndarray:
    if isinstance(tokens, ShardedTokens):
        return tokens.windows(starts, length)
    return np.stack([tokens[s : s + length] for s in starts])


def shard_splits(
    path: str, val_path: str | None, vocab_size: int, min_tokens: int, scan_ids: bool = True
) -> tuple[ShardedTokens, ShardedTokens]:
    """The training and validation tokens, checked. `scan_ids` reads every token once
    (the driver's check); without it, ids are checked as windows are read."""
    train_files = sorted(glob.glob(path))
    val_files = sorted(glob.glob(val_path)) if val_path else []
    # the same file spelt another way (./, absolute, a symlink) is still the same file:
    # left in the training set, val_bpb would score text the model trained on
    held_out = {os.path.realpath(f) for f in val_files}
    train_files = [f for f in train_files if os.path.realpath(f) not in held_out]
    if not train_files:
        raise ConfigError(f"data.path matches no training shard: {path}")
    trains = [read_shard(f) for f in train_files]
    if val_files:
        vals = [read_shard(f) for f in val_files]
        if sum(v.size for v in vals) < min_tokens:  # not one window to evaluate
            raise ConfigError(
                f"data.val_path={val_path} holds {sum(v.size for v in vals)} tokens, fewer "
                f"than model.seq_len + 1 = {min_tokens}"
            )
    else:
        # no validation files: hold out the tail of the last shard (never trained on)
        val_files = train_files[-1:]
        last = trains[-1]
        hold = max(min_tokens, last.size // 100)
        if last.size <= 2 * hold:
            raise ConfigError(f"token shard {train_files[-1]} is too small to hold out validation")
        trains[-1], vals = last[:-hold], [last[-hold:]]
    if scan_ids:
        size = sum(tokens.nbytes for tokens in trains + vals)
        if size > SCAN_NOTICE_BYTES:  # seconds from the page cache, minutes from a slow disk
            print(
                f"checking the token ids of {len(set(train_files + val_files))} shards "
                f"({size / 1e9:.1f} GB) before anything is written",
                flush=True,
            )
        for name, tokens in zip(train_files + val_files, trains + vals):
            check_token_ids(name, tokens, vocab_size)
    return ShardedTokens(train_files, trains, vocab_size), ShardedTokens(
        val_files, vals, vocab_size
    )


def load_shards(cfg: DataConfig, min_tokens: int) -> TokenData:
    # the driver's `check_shards` has scanned every id before the run started; the reads
    # check the windows they return, so a trial does not scan the whole corpus again
    train, val = shard_splits(cfg.path, cfg.val_path, cfg.vocab_size, min_tokens, scan_ids=False)
    return TokenData(
        train,
        val,
        cfg.vocab_size,
        cfg.bytes_per_token,
        f"token shards: {len(train.files)} train file{'s' * (len(train.files) != 1)} "
        f"({train.size / 1e6:.1f}M tokens), {token_count_text(val.size)} val tokens",
    )


def token_count_text(count: int) -> str:
    """12.3M, or 300 (a small validation file's count would show as 0.00M)."""
    return f"{count / 1e6:.1f}M" if count >= 100_000 else f"{count:,}"


def load_data(cfg: DataConfig, seq_len: int) -> TokenData:
    if cfg.name == "stdlib":
        return load_stdlib(cfg.val_every_n_files)
    return load_shards(cfg, min_tokens=seq_len + 1)


def unigram_bpb(data: TokenData) -> float:
    """Bits per byte of the best context-free guess: the validation split scored with the
    training split's token frequencies (add-one smoothed). A model must beat this."""
    counts = token_counts(data.train, data.vocab_size, limit=50_000_000) + 1.0
    log2_p = np.log2(counts / counts.sum())
    val_counts = token_counts(data.val, data.vocab_size)
    bits_per_token = -(val_counts * log2_p).sum() / val_counts.sum()
    return float(bits_per_token / (data.bytes_per_token or 1.0))


def token_counts(tokens, vocab_size: int, limit: int | None = None, chunk: int = 1 << 22):
    # in chunks: bincount widens uint16 to int64, 400 MB for 50M tokens at a trial's end
    end = min(tokens.size, limit or tokens.size)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, end, chunk):
        counts += np.bincount(tokens[start : min(end, start + chunk)], minlength=vocab_size)
    return counts


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
        windows = read_windows(self.tokens, starts, self.seq_len + 1).astype(np.int64)
        batch = torch.from_numpy(windows)  # (B, T+1)
        if torch.device(device).type == "cuda":
            # a copy from pageable memory first waits for the GPU's queue to drain; a pinned
            # one overlaps it (for d12 on an H100 the gain was within the noise)
            batch = batch.pin_memory()
        batch = batch.to(device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]


def val_window_count(val_size: int, seq_len: int, n_tokens: int) -> int:
    """Windows an evaluation scores: n_tokens' worth, as many as the split holds."""
    return max(1, min(n_tokens // seq_len, (val_size - 1) // seq_len))


def val_windows(tokens: np.ndarray, seq_len: int, n_tokens: int, batch_size: int):
    """Fixed windows spread evenly over the validation split (every file type is scored,
    not only the first files), in batches."""
    n_windows = val_window_count(tokens.size, seq_len, n_tokens)
    starts = np.linspace(0, tokens.size - seq_len - 1, n_windows).astype(np.int64)
    for first in range(0, n_windows, batch_size):
        chunk = starts[first : first + batch_size]
        windows = read_windows(tokens, chunk, seq_len + 1)
        batch = torch.from_numpy(windows.astype(np.int64))
        yield batch[:, :-1], batch[:, 1:]
