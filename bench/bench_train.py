"""Training throughput: sweeper's GPT through its real training loop vs a plain minimal
PyTorch GPT (nanoGPT-style: learned positions, LayerNorm, GELU, AdamW) of the same shape,
same batch, same precision, in one process. Runs alternate so machine noise hits both.

    python bench/bench_train.py [--repeats 5] [--steps 20] [--model small]
    python bench/bench_train.py --breakdown    # where a step's time goes, piece by piece
    python bench/bench_train.py --ablate       # what each CPU fast path (cpu_fast.py) earns

Prints the median tokens/s of each and the ratio (target: >= 1.0 on CPU). On a GPU machine
it also prints MFU (the d12 target is >= 45% with bf16 + compile). `optimizer=adamw` as an
override gives sweeper's GPT the plain one's optimizer: the model and loop alone.
`--ablate` trains sweeper's GPT with all of cpu_fast's ops, with none (torch's own), and
with each one in turn put back to torch's, alternating.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf

import sweeper.train.loop
from sweeper.config.compose import compose
from sweeper.config.schema import load_run_config
from sweeper.train.cpu_fast import CPU_OPS, ops_for
from sweeper.train.data import BatchSampler, load_data
from sweeper.train.device import autocast_context, resolve_device, resolve_dtype
from sweeper.train.loop import train
from sweeper.train.model import GPT, PLAIN_OPS, GPTShape
from sweeper.train.optim import build_optimizer


class PlainBlock(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.n_heads = n_heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, d: int, depth: int, n_heads: int, seq_len: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.Sequential(*[PlainBlock(d, n_heads) for _ in range(depth)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.blocks(self.wte(idx) + self.wpe(pos))
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def plain_tokens_per_s(cfg, steps: int, compile_model: bool) -> float:
    device = resolve_device(cfg.trainer.device)
    dtype = resolve_dtype(cfg.trainer.dtype, device)
    m, t = cfg.model, cfg.trainer
    torch.manual_seed(0)
    model = PlainGPT(m.vocab_size, m.width, m.depth, m.width // m.head_dim, m.seq_len).to(device)
    if compile_model:
        model = torch.compile(model, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=None)
    sampler = BatchSampler(load_data(cfg.data, m.seq_len).train, t.device_batch_size, m.seq_len, 0)
    accum = cfg.grad_accum_steps
    start = None
    for step in range(steps + 1):  # the first step (compilation, warm-up) is not timed
        if step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        for x, y in sampler.step_batches(step, accum, device):
            with autocast_context(device, dtype):
                loss = model(x, y)
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the same per-step sync as sweeper's loop
    return steps * t.total_batch_size / (time.perf_counter() - start)


def sweeper_tokens_per_s(cfg_dict: dict, steps: int) -> tuple[float, float | None]:
    trainer = cfg_dict["trainer"]
    # the loop's own tokens/s leaves out its first step (compilation, warm-up)
    trainer.update(max_steps=steps + 1, eval_every=10**6, log_every=10**6)
    trainer.update(budget_tokens=None, budget_flops=None, tokens_per_param=None)
    result = train(cfg_dict, verbose=False)
    return result["tokens_per_s"], result["mfu"]


def alternate_in_loop(
    cfg_dict: dict,
    variants: dict[str, Callable[[], None]],
    pairs: int,
    steps: int,
    deadline: float = math.inf,
) -> None:
    """Train the run config once per variant per round, alternating, after each variant's
    setup call (a monkeypatch of the model's code, say), and print every run's tokens/s and
    MFU and then the medians. No new round starts once time.perf_counter() > deadline."""
    results: dict[str, list[tuple[float, float | None]]] = {name: [] for name in variants}
    width = max(map(len, variants))
    for round_ in range(pairs):
        if round_ and time.perf_counter() > deadline:
            print(f"deadline: {round_} round(s) run")
            break
        for name, setup in variants.items():
            setup()
            results[name].append(sweeper_tokens_per_s(run_copy(cfg_dict), steps))
            print(f"round {round_ + 1} {name:{width}s} {_figures(results[name][-1:])}", flush=True)
    for name, runs in results.items():
        print(f"median  {name:{width}s} {_figures(runs)}  ({len(runs)} runs)")


def run_copy(cfg_dict: dict) -> dict:
    """A run config whose sections a run may update without touching the original."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in cfg_dict.items()}


def in_loop_ab_arguments(
    description: str, pairs: int, deadline_s: float
) -> argparse.ArgumentParser:
    """The arguments every GPU A/B script over alternate_in_loop takes (add more, then
    parse): --pairs, --steps, --deadline-s, and Hydra overrides of the d12 GPU run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--pairs", type=int, default=pairs)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--deadline-s", type=float, default=deadline_s, help="no new pair after this"
    )
    parser.add_argument("overrides", nargs="*")
    return parser


def d12_gpu_run(overrides: list[str]):
    """The d12 preset on a GPU over token shards, with the overrides: (composed, plain dict)."""
    composed = compose(["model=d12", "trainer=gpu", "data=shards", *overrides])
    return composed, OmegaConf.to_container(composed, resolve=True)


def _figures(runs: list[tuple[float, float | None]]) -> str:
    tok_s = statistics.median(r[0] for r in runs)
    mfus = [r[1] for r in runs if r[1] is not None]
    return f"{tok_s:10,.0f} tok/s" + (f"  MFU {100 * statistics.median(mfus):.1f}%" if mfus else "")


def step_breakdown(cfg, repeats: int) -> dict[str, float]:
    """Median milliseconds of each piece of a training step, outside the loop: forward +
    backward of one micro-batch for each model, and each optimizer's step (sweeper's
    Muon + AdamW as configured, the plain GPT's AdamW). Rounds alternate between the pieces
    so machine noise hits all of them."""
    m, t = cfg.model, cfg.trainer
    device = resolve_device(t.device)
    dtype = resolve_dtype(t.dtype, device)
    torch.manual_seed(0)
    ours = GPT(GPTShape.from_config(m), ops=ops_for(device, compiled=False)).to(device)
    plain = PlainGPT(m.vocab_size, m.width, m.depth, m.width // m.head_dim, m.seq_len).to(device)
    ours_opt = build_optimizer(ours, cfg.optimizer)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sampler = BatchSampler(load_data(cfg.data, m.seq_len).train, t.device_batch_size, m.seq_len, 0)
    x, y = next(iter(sampler.step_batches(0, 1, device)))

    def forward_backward(model):
        with autocast_context(device, dtype):
            loss = model(x, y)
        loss.backward()

    pieces = {
        "sweeper forward+backward (one micro-batch)": lambda: forward_backward(ours),
        "plain forward+backward (one micro-batch)": lambda: forward_backward(plain),
        "sweeper optimizer step (all groups)": ours_opt.step,
        "sweeper Muon step alone": ours_opt.optimizers[0].step,
        "plain optimizer step (AdamW)": plain_opt.step,
    }
    for piece in pieces.values():  # warm-up; gradients now exist for the optimizer steps
        piece()
    times: dict[str, list[float]] = {name: [] for name in pieces}
    for _ in range(repeats):
        for name, piece in pieces.items():
            start = time.perf_counter()
            piece()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(ms) for name, ms in times.items()}


def ablations() -> dict[str, Callable[[], None]]:
    """Setups for alternate_in_loop: the loop's model on every fast op, on none, and on all
    but one."""

    def on(ops):
        return lambda: setattr(sweeper.train.loop, "ops_for", lambda device, compiled: ops)

    variants = {"cpu_fast": on(CPU_OPS), "plain ops": on(PLAIN_OPS)}
    for name in CPU_OPS._fields:
        variants[f"without {name}"] = on(CPU_OPS._replace(**{name: getattr(PLAIN_OPS, name)}))
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="small")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument(
        "--breakdown", action="store_true", help="time each piece of a step instead (eager)"
    )
    parser.add_argument(
        "--ablate", action="store_true", help="sweeper's GPT with and without each fast path"
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (trainer=gpu ...)")
    args = parser.parse_args()
    extra = ["trainer.compile=true"] if args.compile else ["trainer.compile=false"]
    composed = compose([f"model={args.model}", *extra, *args.overrides])
    cfg = load_run_config(composed)
    from omegaconf import OmegaConf

    if args.breakdown:
        ms = step_breakdown(cfg, max(args.repeats, 10))
        for name, value in ms.items():
            print(f"{name:45s} {value:8.1f} ms")
        accum = cfg.grad_accum_steps
        ours_step = accum * ms["sweeper forward+backward (one micro-batch)"]
        plain_step = accum * ms["plain forward+backward (one micro-batch)"]
        ours_step += ms["sweeper optimizer step (all groups)"]
        plain_step += ms["plain optimizer step (AdamW)"]
        print(
            f"per step ({accum} micro-batches + optimizer): sweeper {ours_step:.0f} ms, "
            f"plain {plain_step:.0f} ms, ratio {plain_step / ours_step:.2f}x"
        )
        return
    if args.ablate:
        run = OmegaConf.to_container(composed, resolve=True)
        alternate_in_loop(run, ablations(), args.repeats, args.steps)
        return
    ours, plain, mfus = [], [], []
    for i in range(args.repeats):
        tok_s, mfu = sweeper_tokens_per_s(
            OmegaConf.to_container(composed, resolve=True), args.steps
        )
        ours.append(tok_s)
        mfus.append(mfu)
        plain.append(
            plain_tokens_per_s(
                cfg,
                args.steps,
                args.compile or cfg.trainer.compile == "true",
            )
        )
        print(f"run {i + 1}: sweeper {ours[-1]:,.0f} tok/s | plain {plain[-1]:,.0f} tok/s")
    med_ours, med_plain = statistics.median(ours), statistics.median(plain)
    print(f"model={args.model} threads={torch.get_num_threads()} device={cfg.trainer.device}")
    print(
        f"median sweeper: {med_ours:,.0f} tok/s | median plain: {med_plain:,.0f} tok/s | "
        f"ratio {med_ours / med_plain:.2f}x"
    )
    if mfus[0] is not None:
        print(f"median MFU: {100 * statistics.median(mfus):.1f}%")


if __name__ == "__main__":
    main()
