"""What this machine can do, as a run and the planner read it: a device's peak FLOP/s (a GPU's
datasheet figure, or the CPU's measured by a matmul microbenchmark and cached per host) and this
process's peak memory. Beside ``mesh``: it imports torch and ``files`` only, so the trainer, the
benchmarks and ``plan`` share it without importing each other."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import time
from pathlib import Path

import torch

from .files import cache_dir, write_json_atomic

# dense bf16 peaks (FLOP/s) of GPUs people train on; CPUs are measured
GPU_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def measure_cpu_peak(n: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of the best of several fp32 n×n matmuls with all of torch's threads (the best, so
    that a busy moment does not lower the peak and inflate MFU)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def _cpu_peak_cache() -> tuple[Path, str]:
    """Where the CPU peak is cached, and the key (cores, torch) a cached figure must have."""
    cache = cache_dir() / "cpu_peak.json"
    # the host's peak (every core), whatever this process's thread count: the launcher gives each
    # worker one thread, and the ranks of a host share its cores
    return cache, f"{os.cpu_count()}-{torch.__version__}"


def cached_cpu_peak() -> float:
    """The CPU peak FLOP/s ``device_peak`` cached for this host and torch; 0.0 if there is none."""
    cache, key = _cpu_peak_cache()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # no cache, or an unreadable one
        data = json.loads(cache.read_text())
        if data.get("key") == key:
            return float(data["flops"])
    return 0.0


def device_peak(device: torch.device, refresh: bool = True) -> float:
    """Peak FLOP/s of one device: a GPU's datasheet bf16 figure, or for the CPU a matmul
    microbenchmark cached in MESHTRAIN_CACHE_DIR or ~/.cache/meshtrain. The cache keeps the
    highest figure seen, because a measurement taken while the machine was busy reads low
    (and would inflate MFU). With ``refresh`` it measures again (about 0.3 s) and raises the
    cached figure if it can; without, a cached figure is used as it is (the workers: the launcher
    has just measured, and workers measuring at once would only compete for the cores)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK.items():
            if key in name:
                return peak
    cache, key = _cpu_peak_cache()
    cached = cached_cpu_peak()
    if cached and not refresh:
        return cached
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        flops = measure_cpu_peak()
    finally:
        torch.set_num_threads(threads)
    if flops <= cached:
        return cached
    with contextlib.suppress(OSError):  # a read-only home only costs a re-measurement next time
        write_json_atomic(cache, {"key": key, "flops": flops})
    return flops


def resident_peak_bytes() -> int:
    """This process's resident-set high-water mark: Linux's VmHWM, which (unlike ``ru_maxrss``) a
    process does not inherit from the parent that forked it; ``ru_maxrss`` elsewhere."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA's allocator peak, or the resident set's high-water mark."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resident_peak_bytes()
