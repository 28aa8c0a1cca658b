"""One causal-attention layer's backward on CPU: SDPA's flash kernel against sweeper's
hand-written bf16 backward (src/sweeper/train/cpu_fast.py), and the hand-written one at other
block sizes. Rounds alternate so machine noise hits every variant.

    python bench/bench_attention.py [--rounds 15] [--shape 16,4,256,64]

Prints the median milliseconds of each and, for the default blocks, the ratio to SDPA.
The whole training step's figure is bench_train.py's; this one says where it comes from.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import sweeper.train.cpu_fast as attention
from sweeper.train.cpu_fast import keep_freed_memory_for_reuse


def backward_ms(fn, q, k, v, grad) -> float:
    out = fn(q, k, v)
    start = time.perf_counter()
    out.backward(grad)
    elapsed = time.perf_counter() - start
    q.grad = k.grad = v.grad = None
    return 1e3 * elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--shape", default="16,4,256,64", help="B,heads,T,head_dim")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory_for_reuse()  # as the training loop sets the allocator
    B, H, T, D = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(B, H, T, D).bfloat16().requires_grad_() for _ in range(3))
    grad = torch.randn(B, H, T, D).bfloat16()

    default = attention.BLOCK_BYTES
    variants = {
        "sdpa": (None, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    }
    for mib in (0.5, 1, 2, 4):
        block = int(mib * 2**20)
        name = f"by hand, {mib:g} MiB blocks" + (" (default)" if block == default else "")
        variants[name] = (block, attention._CausalAttentionCPU.apply)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds + 2):  # two warm-up rounds
        for name, (block, fn) in variants.items():
            attention.BLOCK_BYTES = block or default
            ms = backward_ms(fn, q, k, v, grad)
            if round_ >= 2:
                times[name].append(ms)
    attention.BLOCK_BYTES = default
    medians = {name: statistics.median(ms) for name, ms in times.items()}
    for name, ms in medians.items():
        print(f"{name:32s} {ms:7.2f} ms")
    ours = next(ms for name, ms in medians.items() if "(default)" in name)
    print(
        f"shape {args.shape} bf16, threads {args.threads}: by hand / SDPA = "
        f"{ours / medians['sdpa']:.2f}"
    )


if __name__ == "__main__":
    main()
