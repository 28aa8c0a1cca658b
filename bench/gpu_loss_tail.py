"""The loss tail of a d12 training step on a GPU: unembedding matmul + soft-cap +
cross-entropy over 50,304 logits, forward and backward, compiled, at the shape of one
micro-batch (32 x 2048 tokens). The fifth session's profile put it at ~9% of the step.

1. Times each way of writing the tail (CUDA events, median) and checks that the exact
   ones give main's loss and gradients.
2. If an exact variant beats main's, trains d12 through the real loop (`train()`) with it
   and with main's, alternating, and prints tokens/s and MFU of each.

    python bench/gpu_loss_tail.py data.path=SHARD [--pairs 2] [--steps 8] [overrides...]

The variants are mathematically one loss: softmax ignores a constant shift, and
cap * tanh(l / cap) = 2 cap * sigmoid(2 l / cap) - cap.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from bench_train import alternate_in_loop, d12_gpu_run, in_loop_ab_arguments

import sweeper.train.model

MAIN = sweeper.train.model.capped_cross_entropy


def sigmoid_form(logits, targets, cap, reduction="mean"):
    z = (2 * cap) * torch.sigmoid(logits * (2 / cap))
    return F.cross_entropy(z.view(-1, z.size(-1)), targets.reshape(-1), reduction=reduction)


def lse_form(cap_fn):
    """logsumexp of the capped logits minus the capped target logit, gathered first."""

    def loss(logits, targets, cap, reduction="mean"):
        flat, t = logits.view(-1, logits.size(-1)), targets.reshape(-1, 1)
        per_token = torch.logsumexp(cap_fn(flat, cap), -1) - cap_fn(flat.gather(-1, t), cap)[:, 0]
        return reduce(per_token.view(targets.shape), reduction)

    return loss


def bounded_form(logits, targets, cap, reduction="mean"):
    """One pass over the logits: capped, they lie in (-cap, cap), so exp() cannot overflow
    and logsumexp needs no running maximum; the target's logit is summed in the same pass
    (a where, not a gather: its backward is pointwise, where a gather's is a scatter)."""
    z = sweeper.train.model.soft_cap(logits, cap)
    vocab = torch.arange(z.size(-1), device=z.device)
    picked = torch.where(vocab == targets[..., None], z, 0.0).sum(-1)
    per_token = (torch.log(torch.exp(z).sum(-1)) - picked).reshape(-1)
    return reduce(per_token, reduction)


def reduce(per_token: torch.Tensor, reduction: str) -> torch.Tensor:
    """F.cross_entropy's reductions (evaluation sums)."""
    if reduction == "mean":
        return per_token.mean()
    return per_token.sum() if reduction == "sum" else per_token


tanh_cap = sweeper.train.model.soft_cap
sigmoid_cap = lambda x, cap: (2 * cap) * torch.sigmoid(x * (2 / cap))  # noqa: E731

EXACT = {
    "tanh + F.cross_entropy (main)": MAIN,
    "sigmoid + F.cross_entropy": sigmoid_form,
    "tanh + logsumexp - gather": lse_form(tanh_cap),
    "sigmoid + logsumexp - gather": lse_form(sigmoid_cap),
    "tanh, one pass (no max, where)": bounded_form,
}


def no_cap(logits, targets, cap, reduction="mean"):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


INFO = {"no cap (the plain GPT's tail)": no_cap}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int = 10) -> float:
    """Median milliseconds of fn() after three warm-up calls (GPU work included)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def tail_times(rows: int, d_model: int, vocab: int, cap: float, device: str) -> dict[str, float]:
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, d_model, device=device, generator=g).bfloat16().requires_grad_()
    w = (0.05 * torch.randn(vocab, d_model, device=device, generator=g)).requires_grad_()
    y = torch.randint(0, vocab, (rows,), device=device, generator=g)
    reference = None
    times = {}
    for name, loss_fn in {**EXACT, **INFO}.items():

        def tail(h, w, y, loss_fn=loss_fn):
            with torch.autocast(device, torch.bfloat16):
                logits = F.linear(h, w)
            return loss_fn(logits.float()[None], y[None], cap)

        compiled = torch.compile(tail, dynamic=False)

        def step(compiled=compiled):
            h.grad = w.grad = None
            compiled(h, w, y).backward()

        start = time.perf_counter()
        step()
        sync(device)
        compile_s = time.perf_counter() - start
        times[name] = timed(step, device)
        h.grad = w.grad = None
        loss = compiled(h, w, y)
        loss.backward()
        check = ""
        if reference is None:
            reference = loss.item(), h.grad.float().clone(), w.grad.clone()
        elif name in EXACT:
            dh = (h.grad.float() - reference[1]).norm() / reference[1].norm()
            dw = (w.grad - reference[2]).norm() / reference[2].norm()
            check = f"| loss {loss.item() - reference[0]:+.1e} vs main, grads rel {dh:.1e} {dw:.1e}"
        print(
            f"{name:34s} {times[name]:7.2f} ms fwd+bwd (compile {compile_s:5.1f} s) {check}",
            flush=True,
        )
    return times


def main() -> None:
    parser = in_loop_ab_arguments(__doc__.splitlines()[0], pairs=2, deadline_s=420)
    parser.add_argument("--rows", type=int, help="tail rows (default: one micro-batch)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of part 1 only")
    parser.add_argument("--tail-only", action="store_true", help="part 1 only")
    args = parser.parse_args()
    began = time.perf_counter()
    composed, cfg = d12_gpu_run(args.overrides)
    m, t = composed.model, composed.trainer
    width = m.depth * m.aspect_ratio if m.d_model is None else m.d_model
    vocab = composed.data.vocab_size
    rows = args.rows or t.device_batch_size * m.seq_len
    print(f"== 1. the loss tail alone: {rows} rows x {width} -> {vocab} on {args.device}")
    times = tail_times(rows, width, vocab, m.softcap, args.device)
    best = min(EXACT, key=times.get)
    if args.device != "cuda" or args.tail_only:
        return
    if EXACT[best] is MAIN:
        print("main's tail is the fastest exact form: nothing to train")
        return
    print(f"== 2. d12 in the real loop, main vs '{best}' ({args.steps} timed steps per run)")
    patch = lambda fn: lambda: setattr(sweeper.train.model, "capped_cross_entropy", fn)  # noqa: E731
    variants = {"main": patch(MAIN), best: patch(EXACT[best])}
    alternate_in_loop(cfg, variants, args.pairs, args.steps, began + args.deadline_s)


if __name__ == "__main__":
    main()
