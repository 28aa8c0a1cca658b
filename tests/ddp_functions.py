"""Per-rank loops that misbehave, for the DDP failure tests (run inside Ray Train workers)."""

import os
import time


def rank1_hangs(config: dict) -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)  # never joins the all-reduce below
    dist.all_reduce(torch.ones(1))


def rank1_dies(config: dict) -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(1)
    dist.all_reduce(torch.ones(1))
