"""``this-host``: this machine as a cluster of CPU ranks, from measurements rather than a datasheet.

Four figures, each from its own microbenchmark (none from a training run): the comm cost model of
``meshtrain bench comm --calibrate`` (the library default without one), the matmul peak
(``device_peak``), the element-wise bandwidth (an eager ``torch.add`` over 4 MB tensors, the size
of a small model's activations, with every core), and the resident memory of a process that has
imported what a training worker imports. The two timings keep the highest figure seen in
``$MESHTRAIN_CACHE_DIR`` (a busy moment reads low); the memory is measured once per interpreter and
torch version.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..comm.select import DEFAULTS, CostModel, cache_path
from .clusters import GiB, Cluster, Level

BANDWIDTH_ELEMENTS = 1 << 20
"""float32 elements per operand of the bandwidth benchmark (4 MB: cache-resident, like the test models')."""


def _cache_file(name: str) -> Path:
    from ..train.tokenizer import cache_dir  # $MESHTRAIN_CACHE_DIR, else ~/.cache/meshtrain

    return cache_dir() / name


def _cached(name: str, key: str) -> float:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        data = json.loads(_cache_file(name).read_text())
        if data.get("key") == key:
            return float(data["value"])
    return 0.0


def _store(name: str, key: str, value: float) -> None:
    from ..bench.report import write_json_atomic

    with contextlib.suppress(OSError):  # a read-only home only costs a re-measurement next time
        write_json_atomic(str(_cache_file(name)), {"key": key, "value": value})


def _key() -> str:
    import torch

    return f"{os.cpu_count()}-{torch.__version__}-{sys.version_info[:2]}"


def measure_bandwidth(repeats: int = 30) -> float:
    """Bytes/s an eager element-wise op moves with every core (``torch.add(a, b, out=c)``: two reads and
    a write), the best of ``repeats``; cached, keeping the highest figure seen."""
    import torch

    key = _key()
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        a, b, c = (torch.randn(BANDWIDTH_ELEMENTS) for _ in range(3))
        torch.add(a, b, out=c)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            torch.add(a, b, out=c)
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    rate = 3 * 4 * BANDWIDTH_ELEMENTS / best
    cached = _cached("host_bandwidth.json", key)
    if rate <= cached:
        return cached
    _store("host_bandwidth.json", key, rate)
    return rate


def measure_base_memory() -> float:
    """Resident bytes of a fresh interpreter that has imported meshtrain's trainer (and so torch):
    what every training process holds before its first tensor. Cached per interpreter and torch."""
    key = _key()
    cached = _cached("base_memory.json", key)
    if cached:
        return cached
    # the trainer's own measure (VmHWM: ru_maxrss would carry over this process's peak through the fork)
    code = "import meshtrain.train.trainer; from meshtrain.train.metrics import resident_peak_bytes as r; print(r())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    value = float(out.stdout.split()[-1])
    _store("base_memory.json", key, value)
    return value


def cached_cost_model() -> CostModel:
    """The shm transport's model from ``meshtrain bench comm --calibrate``'s cache, else the default."""
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        data = {}
    for key, value in sorted(data.items()):
        if key.startswith("shm"):
            return CostModel(**value)
    return DEFAULTS["shm"]


def this_host(peak: float | None = None, bandwidth: float | None = None, base_memory: float | None = None) -> Cluster:
    """This machine as one node of CPU ranks: the calibrated cost model (or the default) for both link
    levels, and the measured matmul peak, element-wise bandwidth and per-process base memory (each
    may be given instead, for tests). The ranks split the cores, the bandwidth and the RAM."""
    import torch

    from ..train.metrics import device_peak

    model = cached_cost_model()
    host_peak = peak if peak is not None else device_peak(torch.device("cpu"))
    rate = bandwidth if bandwidth is not None else measure_bandwidth()
    base = base_memory if base_memory is not None else measure_base_memory()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    level = Level(model.alpha, 1.0 / model.beta)
    # one node holding every rank: 720720 = lcm(1..16), so any degree up to 16 divides it.
    # The efficiencies were set before any comparison with training runs (matmuls of the test models'
    # shapes reach about 0.9 of the 1024^3 peak here, 0.8 leaves room for the backward's transposed
    # ones); the bandwidth is measured with an eager op already, so hbm_efficiency is 1.
    return Cluster(name="this-host", gpus_per_node=720720, memory_bytes=float(ram), peak_flops=host_peak,
                   fp32_flops=host_peak, hbm_bandwidth=rate, intra=level, inter=level,
                   matmul_efficiency=0.8, attention_efficiency=0.3, hbm_efficiency=1.0,
                   eager_elementwise_passes=3.0, reserved_bytes=1 * GiB, backend="host",
                   memory_shared=True, profile_compute=True, cores=os.cpu_count() or 1, reduce_gamma=model.gamma,
                   base_memory_bytes=base, notes=f"this host, cost model {model.source}")
