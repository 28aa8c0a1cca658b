"""Where and how a run executes: device, precision, distributed rank, peak FLOPs."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from sweeper.config import ConfigError

# dense bf16 tensor-core peaks (no sparsity), for MFU; add a GPU here to get its MFU
GPU_PEAK_BF16_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
}


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: there bf16 autocast beats fp32 (2.6x measured on a 3M GPT);
    elsewhere bf16 is emulated and slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        fast_bf16 = device.type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def autocast_context(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def distributed_info() -> tuple[int, int, int]:
    """(rank, world size, local rank); (0, 1, 0) outside torch.distributed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        return rank, world, int(os.environ.get("LOCAL_RANK", rank))
    return 0, 1, 0


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of the device for MFU; None on CPU or an unknown GPU (MFU is then null)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in GPU_PEAK_BF16_FLOPS.items():
        if key in name:
            return flops if dtype == torch.bfloat16 else flops / 2  # TF32 is half bf16 peak
    return None
