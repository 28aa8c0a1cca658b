"""Per-rank loops that misbehave, for the DDP failure tests (run inside Ray Train workers)."""

import os
import time
from pathlib import Path


def started(config: dict) -> None:
    """Notes when this rank began its loop, as a file rank<N> in config's run_dir: the
    test times the failure from there, not from Ray Train's start-up of the ranks."""
    import torch.distributed as dist

    if config.get("run_dir"):
        Path(config["run_dir"], f"rank{dist.get_rank()}").write_text(str(time.time()))


def rank1_hangs(config: dict) -> None:
    import torch
    import torch.distributed as dist

    started(config)
    if dist.get_rank() == 1:
        time.sleep(600)  # never joins the all-reduce below
    dist.all_reduce(torch.ones(1))


def rank1_dies(config: dict) -> None:
    import torch
    import torch.distributed as dist

    started(config)
    if dist.get_rank() == 1:
        os._exit(1)
    dist.all_reduce(torch.ones(1))


def rank0_saves_slowly(config: dict) -> None:
    """The real rank loop, with rank 0's checkpoint saves taking longer than the process
    group's timeout (a big model written to network storage)."""
    import torch.distributed as dist

    import sweeper.train.run_checkpoint as run_checkpoint
    from sweeper.train.distributed import _worker_loop

    save_state = run_checkpoint.save_state

    def slow_save(folder, state, *name):
        if dist.get_rank() == 0:
            time.sleep(config["run"]["trainer"]["dist_timeout_s"] + 4)
        return save_state(folder, state, *name)

    run_checkpoint.save_state = slow_save
    _worker_loop(config)
