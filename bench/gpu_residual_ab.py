"""d12 in the real loop (`train()`, bf16 + compile) with the residual stream in bf16
(`sweeper.train.model.residual_dtype_for`, now) and in fp32 (autocast's default, before),
alternating, tokens/s and MFU of each. Same model and loop; only the dtype of the
activations between the matmuls differs.

    python bench/gpu_residual_ab.py data.path=SHARD [--pairs 3] [--steps 8] [overrides...]

With --quality, each variant instead trains the run the overrides describe to its end, and
the final val_bpb and train loss of each are printed: the numerics' cost, if any.
"""

from __future__ import annotations

import statistics
import time

from bench_train import alternate_in_loop, d12_gpu_run, in_loop_ab_arguments, run_copy

import sweeper.train.loop
from sweeper.train.model import residual_dtype_for


def main() -> None:
    parser = in_loop_ab_arguments(__doc__.splitlines()[0], pairs=3, deadline_s=300)
    parser.add_argument("--quality", action="store_true", help="train to the end, compare losses")
    args = parser.parse_args()
    began = time.perf_counter()
    _, cfg = d12_gpu_run(args.overrides)
    rules = {"fp32 residual": lambda device, dtype: None, "bf16 residual": residual_dtype_for}
    variants = {
        name: (lambda rule=rule: setattr(sweeper.train.loop, "residual_dtype_for", rule))
        for name, rule in rules.items()
    }
    if args.quality:
        for name, setup in variants.items():
            setup()
            result = sweeper.train.train(run_copy(cfg), verbose=False)
            tail = statistics.mean(result["loss_trace"][-20:])
            print(
                f"{name}: val_bpb {result['val_bpb']:.4f} | train loss (last 20 steps) "
                f"{tail:.4f} | {result['steps']} steps | {result['tokens_per_s']:,.0f} tok/s",
                flush=True,
            )
        return
    alternate_in_loop(cfg, variants, args.pairs, args.steps, began + args.deadline_s)


if __name__ == "__main__":
    main()
