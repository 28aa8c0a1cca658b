"""Where and how a run executes: device, precision, distributed rank, peak FLOPs."""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable

import torch

from sweeper.config.errors import ConfigError

# dense bf16 tensor-core peaks (no sparsity), for MFU; add a GPU here to get its MFU
# matched in this order, the first name the device's contains: a variant before its family
# ("H100 PCIe" before "H100", "L40S" and "L40" before "L4")
GPU_PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
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
        # float32 matmuls on tensor cores (TF32), as peak_flops assumes for a float32 run;
        # bf16 autocast is unaffected
        torch.set_float32_matmul_precision("high")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# bf16 autocast must beat fp32 by this much in a matmul to pay for its casts
BF16_MIN_SPEEDUP = 1.25
# what measure_cpu_matmuls records, in ms (None: not timed on this CPU)
_TIMINGS = ("bf16_ms", "fp32_ms")
# the `small` model's widest matmul (a micro-batch of 16 x 256 tokens into its MLP)
_PROBE_SHAPE = (4096, 256, 1024)


def _cpu_identity() -> tuple[str, str]:
    """(the first processor's vendor, family, model, name, stepping and flags lines of
    /proc/cpuinfo, its flags line); empty strings off Linux. Its clock (cpu MHz) varies."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        return "", ""
    fields = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")
    lines = [ln for ln in first.splitlines() if ln.split(":")[0].strip() in fields]
    flags = next((ln for ln in lines if ln.startswith("flags")), "")
    return "\n".join(lines), flags


def cpu_has_bf16_units() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively; elsewhere they are emulated, slower
    than fp32."""
    flags = _cpu_identity()[1].split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def measure_cpu_matmuls(bf16: bool = True) -> dict:
    """Median time (ms) of the probe matmul at torch's thread count: in fp32 (`fp32_ms`)
    and in bf16 (`bf16_ms`, None unless asked: timing emulated bf16 tells nothing)."""
    import time

    m, k, n = _PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    kernels = {"fp32_ms": lambda: a @ b.T}
    if bf16:
        a16, b16 = a.bfloat16(), b.bfloat16()
        kernels["bf16_ms"] = lambda: a16 @ b16.T
    for kernel in kernels.values():
        kernel()  # the first call also warms up oneDNN's kernels
    times = {name: [] for name in kernels}
    for rep in range(6):  # alternating, so a noisy neighbour slows all alike
        for name, kernel in kernels.items():
            started = time.perf_counter()
            kernel()
            if rep >= 1:
                times[name].append(time.perf_counter() - started)
    medians = {name: round(sorted(t)[len(t) // 2] * 1e3, 3) for name, t in times.items()}
    return dict.fromkeys(_TIMINGS) | medians


def bf16_beats_fp32(timing: dict) -> bool:
    if timing["bf16_ms"] is None:
        return False
    return timing["fp32_ms"] >= BF16_MIN_SPEEDUP * timing["bf16_ms"]


def cache_dir() -> str:
    """$SWEEPER_CACHE_DIR, else $XDG_CACHE_HOME/sweeper, else ~/.cache/sweeper."""
    if os.environ.get("SWEEPER_CACHE_DIR"):
        return os.environ["SWEEPER_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sweeper")


def _recorded_timing(path: str) -> dict | None:
    import json

    try:
        with open(path) as f:
            recorded = json.load(f)
        timing = {name: recorded[name] for name in _TIMINGS}
        if timing["fp32_ms"] is None:
            return None
        return {name: None if ms is None else float(ms) for name, ms in timing.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _measure_this_cpu() -> dict:
    return measure_cpu_matmuls(bf16=cpu_has_bf16_units())


def recorded_cpu_timing(measure: Callable[[], dict] = _measure_this_cpu) -> dict:
    """This CPU's matmul timings (measure_cpu_matmuls), measured once per CPU and torch
    version and kept in cache_dir(): every later process on the machine reads the same
    answer, so trials of one sweep never train in different precisions or kernels because
    one timing was noisy. The first process to write it wins; one that cannot write uses
    its own measurement."""
    import hashlib
    import json

    identity, _ = _cpu_identity()
    key = hashlib.sha1(f"{identity}\n{torch.__version__}".encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"cpu_matmul-{key}.json")
    if recorded := _recorded_timing(path):
        return recorded
    timing = measure()
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        model = next((ln for ln in identity.splitlines() if ln.startswith("model name")), "")
        record = {**timing, "cpu": model.partition(":")[2].strip(), "torch": torch.__version__}
        written = f"{path}.{os.getpid()}.tmp"
        with open(written, "w") as f:
            json.dump(record, f)
        try:
            os.link(written, path)  # whole or not at all; fails where another process wrote first
        except FileExistsError:
            timing = _recorded_timing(path) or timing
        finally:
            os.unlink(written)
    return timing


@functools.lru_cache(maxsize=1)
def cpu_bf16_is_fast() -> bool:
    """Whether bf16 autocast beats fp32 on this CPU. Having bf16 units is not enough: some
    CPUs with AVX512-BF16 and no AMX run oneDNN's bf16 matmul slower than fp32 (figures in
    BENCHMARKS.md), so where the units exist one timed matmul decides (recorded_cpu_timing)."""
    return cpu_has_bf16_units() and bf16_beats_fp32(recorded_cpu_timing())


def reset_peak_memory(device: torch.device) -> None:
    """Start counting a run's peak memory from now (see peak_memory_bytes)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: resets the process's peak resident set (VmHWM) to its current size


def peak_memory_bytes(device: torch.device) -> int | None:
    """The most memory the run has held since reset_peak_memory: on a GPU, what torch's
    allocator handed to tensors (the figure nanochat logs); on a CPU, the process's peak
    resident set (VmHWM: torch keeps no CPU peak, and only the kernel's counts every
    allocation, numpy's too), which includes ~0.5 GB of Python, torch and the corpus before
    any model. None where the system does not say (a CPU off Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # in kB
    return None


def out_of_memory(error: BaseException) -> str | None:
    """How much the failed allocation asked for ("24.4 GiB"), where `error` is one: torch's
    OutOfMemoryError (CUDA), the CPU allocator's RuntimeError or a MemoryError (numpy's,
    for a batch of indices); else None."""
    text = str(error)
    if isinstance(error, MemoryError):  # numpy's (_ArrayMemoryError): "allocate 8.00 TiB"
        found = re.search(r"[Uu]nable to allocate ([\d.]+ \w+)", text)
        return found[1] if found else "unknown size"
    if not (isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in text):
        return None
    if found := re.search(r"allocate (\d+) bytes", text):  # the CPU allocator counts bytes
        return f"{int(found[1]) / 2**30:.1f} GiB"
    found = re.search(r"[Tt]ried to allocate ([\d.]+ \w+)", text)
    return found[1] if found else "unknown size"


def bf16_is_fast(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and cpu_bf16_is_fast())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if bf16_is_fast(device) else torch.float32
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


def utilization(
    flops_per_token: float, tokens_per_s: float, peak: float | None, devices: int
) -> float | None:
    """MFU: the model FLOPs trained a second over the peak of every device that trained
    them. `tokens_per_s` counts all ranks' tokens (a DDP step's whole batch), and `peak`
    is one device's."""
    if not peak:
        return None
    return flops_per_token * tokens_per_s / (peak * devices)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of the device for MFU; None on CPU or an unknown GPU (MFU is then null)."""
    if device.type != "cuda":
        return None
    bf16 = peak_bf16_flops(torch.cuda.get_device_name(device))
    if bf16 is None:
        return None
    return bf16 if dtype == torch.bfloat16 else bf16 / 2  # TF32 is half bf16 peak


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (torch.cuda.get_device_name)."""
    return next((f for key, f in GPU_PEAK_BF16_FLOPS.items() if key in device_name), None)
