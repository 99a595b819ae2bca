"""``this-host``: this machine as a cluster of CPU ranks, from measurements rather than a datasheet.

Four figures, each from its own measurement: the comm cost model of ``meshtrain bench comm
--calibrate`` (the library default without one), the matmul peak (``device_peak``), the
element-wise bandwidth (an eager ``torch.add`` over 4 MB tensors, the size of a small model's
activations, with every core), and the runtime memory of a training process, from a run of a model
too small to matter (none of them from a run of the model being planned). The two timings keep the
highest figure seen in ``$MESHTRAIN_CACHE_DIR`` (a busy moment reads low); the memory is measured
once per interpreter and torch version.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

from ..comm.select import CostModel, cache_path, default_model
from ..config.model import PRESETS
from ..files import cache_dir, write_json_atomic
from .architectures import from_llama_config
from .clusters import GiB, Cluster, Level

BANDWIDTH_ELEMENTS = 1 << 20
"""float32 elements per operand of the bandwidth benchmark (4 MB: cache-resident, like the test models')."""


def _cache_file(name: str) -> Path:
    return cache_dir() / name


def _cached(name: str, key: str) -> float:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        data = json.loads(_cache_file(name).read_text())
        if data.get("key") == key:
            return float(data["value"])
    return 0.0


def _store(name: str, key: str, value: float) -> None:
    with contextlib.suppress(OSError):  # a read-only home only costs a re-measurement next time
        write_json_atomic(_cache_file(name), {"key": key, "value": value})


def _key() -> str:
    import torch

    return f"{os.cpu_count()}-{torch.__version__}-{sys.version_info[:2]}"


def measure_bandwidth(repeats: int = 30) -> float:
    """Bytes/s an eager element-wise op moves with every core (``torch.add(a, b, out=c)``: two reads and
    a write), the best of ``repeats``; cached, keeping the highest figure seen."""
    import torch

    from .profile import intra_op_threads

    key = _key()
    with intra_op_threads(os.cpu_count() or 1):
        a, b, c = (torch.randn(BANDWIDTH_ELEMENTS) for _ in range(3))
        torch.add(a, b, out=c)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            torch.add(a, b, out=c)
            best = min(best, time.perf_counter() - t)
    rate = 3 * 4 * BANDWIDTH_ELEMENTS / best
    cached = _cached("host_bandwidth.json", key)
    if rate <= cached:
        return cached
    _store("host_bandwidth.json", key, rate)
    return rate


RUNTIME_FOOTPRINT = 3
"""Part of the runtime memory's cache key: raise it when what a worker holds changes, so a cached figure is
measured anew (2: figures cached before session 21 were about 50 MiB above what its workers hold; 3: measured
on the ``test`` preset instead of a dim-16 shrink of it, about 13 MiB more)."""


def _runtime_key() -> str:
    return f"{_key()}-f{RUNTIME_FOOTPRINT}"


def measure_runtime_memory() -> float:
    """Bytes a training process holds besides its model: the peak resident set of a one-rank
    ``meshtrain train`` of the ``test`` preset (the interpreter and torch, the library code its
    kernels page in, the tokenizer and data, metrics and logging), less what the planner predicts that
    model's weights, gradients, optimizer state and activations take. Cached per interpreter, torch and
    ``RUNTIME_FOOTPRINT``.

    The smallest real preset, not a shrink of it: what a process holds beyond the planner's count grows
    with the model it runs (here, one rank: 277 MiB from a dim-16 model, 290 from ``test``, 298 from
    ``5m``; docs/benchmarks.md, session 29), so a base measured on a model that runs none of a real
    model's kernel sizes priced every this-host layout low (14-40 MiB, the HSDP pair beyond 10 %)."""
    key = _runtime_key()
    cached = _cached("runtime_memory.json", key)
    if cached:
        return cached
    from .bench import GLOBAL_BATCH, SEQ, VOCAB, measure  # bench imports this module
    from .layout import parse_layout
    from .memory import memory_per_rank

    try:
        with tempfile.TemporaryDirectory(prefix="meshtrain-runtime-") as tmp:
            got = measure("test", "dp=1", 4, GLOBAL_BATCH, SEQ, Path(tmp), timeout=300)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        warnings.warn(f"this-host: the one-rank training run that measures a process's runtime memory "
                      f"failed ({str(exc)[-300:]}); using the resident set after the imports instead, "
                      f"which leaves out about 40 MiB per rank (not cached: measured again next time)",
                      RuntimeWarning, stacklevel=2)
        return import_memory()
    test = replace(PRESETS["test"], vocab_size=VOCAB, tie_embeddings=False)
    held = memory_per_rank(from_llama_config("test", test), parse_layout("dp=1", precision="fp32"), GLOBAL_BATCH, SEQ)
    value = got["peak_mem_bytes"] - held.total
    _store("runtime_memory.json", key, value)
    return value


def import_memory() -> float:
    """Peak resident bytes of a fresh interpreter that has imported meshtrain's trainer (and torch):
    the floor of ``measure_runtime_memory``, used when its training run cannot be made."""
    code = "import meshtrain.train.trainer; from meshtrain.hardware import resident_peak_bytes as r; print(r())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.split()[-1])


def cached_cost_model() -> CostModel:
    """The shm transport's model from ``meshtrain bench comm --calibrate``'s cache, else the default."""
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        data = {}
    for key, value in sorted(data.items()):
        if key.startswith("shm"):
            return CostModel(**value)
    return default_model("shm")


def this_host(peak: float | None = None, bandwidth: float | None = None, base_memory: float | None = None) -> Cluster:
    """This machine as one node of CPU ranks: the calibrated cost model (or the default) for both link
    levels, and the measured matmul peak, element-wise bandwidth and per-process runtime memory (each
    may be given instead, for tests). The ranks split the cores, the bandwidth and the RAM."""
    import torch

    from ..hardware import device_peak

    model = cached_cost_model()
    host_peak = peak if peak is not None else device_peak(torch.device("cpu"))
    rate = bandwidth if bandwidth is not None else measure_bandwidth()
    base = base_memory if base_memory is not None else measure_runtime_memory()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    level = Level(model.alpha, 1.0 / model.beta)
    # one node holding every rank: 720720 = lcm(1..16), so any degree up to 16 divides it.
    # The efficiencies were set before any comparison with training runs (matmuls of the test models'
    # shapes reach about 0.9 of the 1024^3 peak here, 0.8 leaves room for the backward's transposed
    # ones); the bandwidth is measured with an eager op already, so hbm_efficiency is 1.
    return Cluster(name="this-host", gpus_per_node=720720, memory_bytes=float(ram), peak_flops=host_peak,
                   fp32_flops=host_peak, hbm_bandwidth=rate, intra=level, inter=level,
                   matmul_efficiency=0.8, attention_efficiency=0.3, attention_bwd_efficiency=0.3,
                   hbm_efficiency=1.0, eager_elementwise_passes=1.0, reserved_bytes=1 * GiB, backend="host",
                   memory_shared=True, profile_compute=True, cores=os.cpu_count() or 1, reduce_gamma=model.gamma,
                   base_memory_bytes=base, notes=f"this host, cost model {model.source}")


def cached_this_host() -> Cluster | None:
    """``this_host`` from the figures a calibration cached (the matmul peak, the element-wise
    bandwidth, the runtime memory; the comm cost model or its default), measuring nothing: None if
    one is missing. Blocks are priced by the roofline (``profile_compute`` off), since profiling
    them is a measurement of its own (seconds). For a training run's check of the planner, which
    must not hold the run up."""
    from ..hardware import cached_cpu_peak

    key = _key()
    peak, rate, base = (cached_cpu_peak(), _cached("host_bandwidth.json", key),
                        _cached("runtime_memory.json", _runtime_key()))
    if not (peak and rate and base):
        return None
    return replace(this_host(peak=peak, bandwidth=rate, base_memory=base), profile_compute=False)
