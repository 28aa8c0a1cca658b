"""d12 in the real loop (`train()`, bf16 + compile) with the compiled RoPE as it is
(`sweeper.train.model.rotate_real`: x * cos2 + swap(x) * sin2, the pair swapped by a flip) and
as it was before the thirty-second session (each (even, odd) pair unbound, the rotated
halves stacked back: a `cat` kernel among the step's largest elementwise ones),
alternating, tokens/s and MFU of each. The same maths; only the kernels differ.

    python bench/gpu_rope_ab.py data.path=SHARD [--pairs 2] [--steps 8] [overrides...]
"""

from __future__ import annotations

import time

import torch
from bench_train import alternate_in_loop, d12_gpu_run, in_loop_ab_arguments

import sweeper.train.model

FORMS = {"flip": sweeper.train.model.rotate_real}


def rotate_by_stack(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    x_re, x_im = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = rotary.unbind(-1)
    return torch.stack([x_re * cos - x_im * sin, x_re * sin + x_im * cos], dim=-1).flatten(-2)


FORMS["stack"] = rotate_by_stack


def main() -> None:
    args = in_loop_ab_arguments(__doc__.splitlines()[0], pairs=2, deadline_s=300).parse_args()
    began = time.perf_counter()
    _, cfg = d12_gpu_run(args.overrides)
    patch = lambda fn: lambda: setattr(sweeper.train.model, "rotate_real", fn)  # noqa: E731
    variants = {name: patch(rotate) for name, rotate in FORMS.items()}
    alternate_in_loop(cfg, variants, args.pairs, args.steps, began + args.deadline_s)


if __name__ == "__main__":
    main()
