"""Where a whole d12 training step's wall time goes, inside sweeper's real loop: the
profiler runs over optimizer steps 3-4 of `train()` and prints GPU busy time against wall
time, and the host-side calls that took longest (synchronisations, copies, launches).

    python bench/gpu_step_profile.py data.path=SHARD [overrides...]
"""

from __future__ import annotations

import sys
import time

import torch
from omegaconf import OmegaConf

import sweeper.train.loop
from sweeper.config.compose import compose

PROFILED = (3, 5)  # profile from the end of optimizer step 2 to the end of step 4


def main() -> None:
    composed = compose(["model=d12", "trainer=gpu", "data=shards", *sys.argv[1:]])
    cfg = OmegaConf.to_container(composed, resolve=True)
    cfg["trainer"].update(max_steps=PROFILED[1], eval_every=10**6, log_every=1)
    cfg["trainer"].update(budget_tokens=None, budget_flops=None, tokens_per_param=None)
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    )
    build = sweeper.train.loop.build_optimizer
    clock = {}

    def build_with_hook(model, opt_cfg):
        optimizer = build(model, opt_cfg)
        step = optimizer.step
        count = [0]

        def hooked_step():
            step()
            count[0] += 1
            if count[0] == PROFILED[0] - 1:
                torch.cuda.synchronize()
                prof.start()
                clock["start"] = time.perf_counter()
            elif count[0] == PROFILED[1] - 1:
                torch.cuda.synchronize()
                clock["wall"] = time.perf_counter() - clock["start"]
                prof.stop()

        optimizer.step = hooked_step
        return optimizer

    sweeper.train.loop.build_optimizer = build_with_hook
    sweeper.train.train(cfg, verbose=True)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    wall_us = clock["wall"] * 1e6
    print(
        f"wall {wall_us / 1e3:.1f} ms over 2 steps | GPU busy {gpu_us / 1e3:.1f} ms "
        f"({100 * gpu_us / wall_us:.1f}%)"
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))
    print(events.table(sort_by="self_device_time_total", row_limit=30))


if __name__ == "__main__":
    main()
