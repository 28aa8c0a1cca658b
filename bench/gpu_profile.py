"""Where a d12 training step's GPU time goes: forward+backward per micro-batch and the
optimizer step, timed with CUDA events, for sweeper's GPT and the plain GPT of
bench_train.py, both compiled; then the top kernels of sweeper's micro-batch.

    python bench/gpu_profile.py data.path=SHARD [overrides...]
"""

from __future__ import annotations

import statistics
import sys

import torch
from bench_train import PlainGPT

from sweeper.config.compose import compose
from sweeper.config.schema import load_run_config
from sweeper.train.data import BatchSampler, load_data
from sweeper.train.device import autocast_context
from sweeper.train.model import GPT, GPTShape
from sweeper.train.optim import build_optimizer


def timed(fn, repeats: int = 5) -> float:
    """Median milliseconds of fn() over CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    composed = compose(["model=d12", "trainer=gpu", "data=shards", *sys.argv[1:]])
    cfg = load_run_config(composed)
    m, t = cfg.model, cfg.trainer
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    data = load_data(cfg.data, m.seq_len)
    x, y = next(
        BatchSampler(data.train, t.device_batch_size, m.seq_len, 0).step_batches(0, 1, device)
    )
    flops = GPT(GPTShape.from_config(m)).flops_per_token() * x.numel()

    models = {
        "sweeper": GPT(GPTShape.from_config(m)).to(device),
        "plain": PlainGPT(m.vocab_size, m.width, m.depth, m.width // m.head_dim, m.seq_len).to(
            device
        ),
    }
    for name, model in models.items():
        print(profile(name, model, cfg, x, y, flops), flush=True)
        torch.cuda.empty_cache()


def profile(name, model, cfg, x, y, flops: int) -> str:
    device, dtype = x.device, torch.bfloat16
    compiled = torch.compile(model, dynamic=False)

    def micro():
        with autocast_context(device, dtype):
            loss = compiled(x, y)
        loss.backward()

    ms = timed(micro)
    line = f"{name:8s} fwd+bwd {ms:7.1f} ms/micro-batch  ({flops / ms / 1e9:6.1f} TFLOP/s)"
    if name == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return line + f" | AdamW step {timed(opt.step):6.1f} ms"
    opt = build_optimizer(model, cfg.optimizer)
    line += f" | optimizer step {timed(opt.step):6.1f} ms"
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    line += f" | clip {timed(clip):5.1f} ms"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        micro()
        torch.cuda.synchronize()
    return line + "\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)


if __name__ == "__main__":
    main()
