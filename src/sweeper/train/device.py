"""Where and how a run executes: device, precision, distributed rank, peak FLOPs."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
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
# oneDNN's fp32 matmul must beat torch's own (MKL's sgemm) by this much to be taken: a
# margin over timing noise, so that a machine does not switch kernels on a close call
ONEDNN_MIN_SPEEDUP = 1.2
# what measure_cpu_matmuls records, in ms (None: not timed on this CPU)
_TIMINGS = ("bf16_ms", "fp32_ms", "fp32_onednn_ms")
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


def onednn_fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in fp32 by oneDNN's matmul (torch's own fp32 matmul on CPU is MKL's).
    A private op of torch's (Inductor's CPU linear), so it is looked up where it is used:
    a torch without it raises AttributeError, and measure_cpu_matmuls then records None."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def measure_cpu_matmuls(bf16: bool = True) -> dict:
    """Median time (ms) of the probe matmul at torch's thread count: in fp32 as torch runs
    it (`fp32_ms`), in fp32 by oneDNN (`fp32_onednn_ms`, None where torch has no oneDNN)
    and in bf16 (`bf16_ms`, None unless asked: timing emulated bf16 tells nothing)."""
    import time

    m, k, n = _PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    kernels = {"fp32_ms": lambda: a @ b.T}
    if torch.backends.mkldnn.is_available():
        kernels["fp32_onednn_ms"] = lambda: onednn_fp32_linear(a, b)
    if bf16:
        a16, b16 = a.bfloat16(), b.bfloat16()
        kernels["bf16_ms"] = lambda: a16 @ b16.T
    for name, kernel in list(kernels.items()):
        try:
            kernel()  # also the first warm-up of oneDNN's kernels
        except (AttributeError, RuntimeError):  # no such op in this torch build
            del kernels[name]
    times = {name: [] for name in kernels}
    for rep in range(6):  # alternating, so a noisy neighbour slows all alike
        for name, kernel in kernels.items():
            started = time.perf_counter()
            kernel()
            if rep >= 1:
                times[name].append(time.perf_counter() - started)
    timing = dict.fromkeys(_TIMINGS)
    for name, elapsed in times.items():
        timing[name] = round(sorted(elapsed)[len(elapsed) // 2] * 1e3, 3)
    return timing


def bf16_beats_fp32(timing: dict) -> bool:
    """bf16 against the faster of the fp32 kernels (the one fp32 training would use)."""
    if timing["bf16_ms"] is None:
        return False
    fp32_ms = min(t for t in (timing["fp32_ms"], timing["fp32_onednn_ms"]) if t is not None)
    return fp32_ms >= BF16_MIN_SPEEDUP * timing["bf16_ms"]


def onednn_beats_fp32(timing: dict) -> bool:
    return (
        timing["fp32_onednn_ms"] is not None
        and timing["fp32_ms"] >= ONEDNN_MIN_SPEEDUP * timing["fp32_onednn_ms"]
    )


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
    # cpu_matmul-: a record of the three timings (the older cpu_bf16- held two)
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


@functools.lru_cache(maxsize=1)
def cpu_fp32_matmul_by_onednn() -> bool:
    """Whether fp32 linear layers on this CPU should run on oneDNN's matmul rather than
    torch's (MKL's sgemm). MKL picks its kernels by CPU vendor and gives AMD CPUs its AVX2
    path, where oneDNN uses AVX-512 (figures in BENCHMARKS.md); the timed probe decides
    (recorded_cpu_timing)."""
    return onednn_beats_fp32(recorded_cpu_timing())


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def keep_freed_memory_for_reuse() -> bool:
    """Stop glibc's malloc from giving freed activations back to the kernel between steps.

    PyTorch's CPU allocator is plain malloc. By default glibc serves large blocks with
    mmap and trims the heap top as soon as it is free, so every training step faults its
    activations' pages in again: measured 25,000 page faults and ~10% of a step for the
    `small` model on 2 cores. A fixed mmap threshold at glibc's 64-bit maximum (32 MiB) and
    a 1 GiB trim threshold keep that memory in the process for the next step; the cost is
    that a run's memory stays at its peak until release_freed_memory(). PyTorch's CPU-tuning
    guide gets the same effect by preloading jemalloc or tcmalloc, which this needs no
    system package for. A no-op (False) where the C library has no mallopt (musl, macOS,
    Windows).
    """
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's <malloc.h>
    return bool(mallopt(m_trim_threshold, 1 << 30) and mallopt(m_mmap_threshold, 32 << 20))


def release_freed_memory() -> None:
    """Hand back to the kernel what earlier runs in this process freed: glibc's malloc_trim
    over every arena, after a collection of the runs' garbage cycles.

    Why: each thread allocates from its own malloc arena, and Tune runs every trial of a
    reused worker in a new thread. With the trim threshold above, each arena keeps its
    trial's peak: four `small` runs in new threads grew a process from 0.94 to 1.43 GB
    without this, and stay at 0.87-0.89 GB with it. A larger peak multiplies that: when an
    evaluation briefly kept its autograd graph (3.5 GB peaks), lr_bs's workers reached
    11-15 GB and Ray's memory monitor killed one. Costs 0.12-0.17 s at a run's start
    (mostly the collection): under 0.5% of a 30-100 s CPU trial. No-op without glibc.
    """
    import gc

    gc.collect()
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)


def reset_peak_memory(device: torch.device) -> None:
    """Start counting a run's peak memory from now (see peak_memory_bytes)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets the process's peak resident set (VmHWM) to its current size
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int | None:
    """The most memory the run has held since reset_peak_memory: on a GPU, what torch's
    allocator handed to tensors (the figure nanochat and autoresearch log); on a CPU, the
    process's peak resident set, which also counts Python, torch's libraries and the corpus
    (~0.5 GB before any model). What a larger batch or model adds shows on top of that.
    None where the system does not say (a CPU off Linux).

    Written here: torch keeps a peak only for its CUDA allocator; on a CPU the kernel's
    VmHWM is the one figure that counts every allocation, torch's and numpy's alike."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
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
