"""The token-shard loader on a corpus of several files (synthetic GPT-2-sized ids).

    python bench/bench_data.py [--files 4] [--tokens-per-file 50000000] [--runs 5]

Writes the shards to a temporary folder, then reports, each a median of --runs:
- the memory a trial's `load_shards` adds (anonymous RSS: a copy, not mapped file pages);
- the time to draw one micro-batch (d12's 32 x 2048 windows, and the CPU preset's
  16 x 256) from the shards read as one stream, against the same windows from their
  concatenation in memory (the reference: what the loader did before, copying the corpus);
- the driver's id check, reading every token (from the page cache, and from disk after
  the file's pages are dropped with posix_fadvise where the kernel honours it);
- the unigram baseline computed at the end of every run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from sweeper.config.schema import DataConfig
from sweeper.train.data import (
    SHARD_MAGIC,
    BatchSampler,
    check_token_ids,
    load_shards,
    read_shard,
    unigram_bpb,
)

VOCAB = 50304


def anonymous_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 1024
    return float("nan")


def write_shards(folder: Path, files: int, tokens: int) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(files):
        header = np.zeros(256, dtype=np.int32)
        header[:3] = [SHARD_MAGIC, 1, tokens]
        path = folder / f"train_{i:03d}.bin"
        with open(path, "wb") as f:
            f.write(header.tobytes())
            f.write(rng.integers(0, 50257, tokens, dtype=np.uint16).tobytes())
        paths.append(str(path))
    return paths


def drop_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def time_batches(tokens, batch: int, seq_len: int, steps: int = 50) -> float:
    sampler = BatchSampler(tokens, batch, seq_len, seed=0)
    for step in range(3):  # touch the pages first: this times the loader, not the disk
        list(sampler.step_batches(step, 1, "cpu"))
    start = time.perf_counter()
    for step in range(steps):
        list(sampler.step_batches(step % 3, 1, "cpu"))
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--tokens-per-file", type=int, default=50_000_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        paths = write_shards(Path(tmp), args.files, args.tokens_per_file)
        cfg = DataConfig(name="shards", path=f"{tmp}/train_*.bin", vocab_size=VOCAB)
        size_gb = sum(os.path.getsize(p) for p in paths) / 1e9
        print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
        print(f"corpus: {args.files} files, {size_gb:.2f} GB\n")

        before = anonymous_mb()
        data = load_shards(cfg, min_tokens=2049)
        print(f"load_shards: +{anonymous_mb() - before:.0f} MB of anonymous memory")

        copied = np.concatenate([read_shard(path) for path in paths])  # the reference
        for batch, seq_len in ((32, 2048), (16, 256)):
            ours = [time_batches(data.train, batch, seq_len) for _ in range(args.runs)]
            plain = [time_batches(copied, batch, seq_len) for _ in range(args.runs)]
            o, p = statistics.median(ours), statistics.median(plain)
            print(
                f"micro-batch {batch} x {seq_len}: the shards as one stream {o:.3f} ms, "
                f"the copy in memory {p:.3f} ms, ratio {p / o:.2f}x"
            )

        def scan() -> float:
            start = time.perf_counter()
            for path in paths:
                check_token_ids(path, read_shard(path), VOCAB)
            return time.perf_counter() - start

        warm = statistics.median(scan() for _ in range(args.runs))
        cold = []
        for _ in range(args.runs):
            drop_page_cache(paths)
            cold.append(scan())
        cold_s = statistics.median(cold)
        print(
            f"driver's id check: {size_gb / warm:.1f} GB/s from the page cache, "
            f"{size_gb / cold_s:.1f} GB/s after dropping it ({cold_s:.2f} s)"
        )
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            unigram_bpb(data)
            times.append(time.perf_counter() - start)
        print(f"unigram baseline at a run's end: {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main()
