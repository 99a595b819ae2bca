"""Per-call cost of the small, frequent torch.distributed calls a 4D trainer makes, on
torch.distributed (gloo) and on meshtrain.comm after ``init_process_group`` (shared memory on one
host), in the same run, trials interleaved:

    python benchmarks/compat_calls.py WORLD ITERS [hosts]

``hosts``: the ranks are split over two host ids, so meshtrain routes the other half over gloo.
Prints, per call, the median over 3 trials of rank 0's mean time per call (docs/benchmarks.md).
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from typing import Any, Callable

import torch

from meshtrain.comm.launch import spawn

# transport None: spawn initialises torch.distributed only (pure torch; meshtrain via init_process_group)
MODES = {"torch": ("torch.distributed", None), "meshtrain": ("meshtrain.comm", None)}


def worker(rank: int, module: str, n_iter: int, across: bool) -> dict[str, float]:
    """Time each call ``n_iter`` times after 20 untimed; µs per call by name. ``across``: the p2p
    pair is a rank on the other host (else the neighbour, rank ^ 1)."""
    torch.set_num_threads(1)
    dist: Any = importlib.import_module(module)
    if module == "meshtrain.comm" and not dist.is_initialized():
        dist.init_process_group("gloo")  # as a program that switched its import does
    world = dist.get_world_size()
    res: dict[str, float] = {}

    def timeit(name: str, fn: Callable[[], Any]) -> None:
        for _ in range(20):
            fn()
        t0 = time.perf_counter()
        for _ in range(n_iter):
            fn()
        res[name] = (time.perf_counter() - t0) / n_iter * 1e6

    x, y = torch.randn(1024), torch.randn(64 * 1024)
    out = torch.empty(world * 1024)
    timeit("all_reduce 4K", lambda: dist.all_reduce(x))
    timeit("all_reduce 256K", lambda: dist.all_reduce(y))
    timeit("all_gather_into_tensor 4K", lambda: dist.all_gather_into_tensor(out, x))
    peer = (rank + world // 2) % world if across else rank ^ 1
    a, b = torch.randn(1024), torch.empty(1024)

    def pair() -> None:
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.irecv, b, peer)]):
            w.wait()

    timeit("batch_isend_irecv 4K", pair)

    def objects() -> None:
        dist.broadcast_object_list([{"a": 1}] if rank == 0 else [None], src=0)

    timeit("broadcast_object_list", objects)
    timeit("barrier", lambda: dist.barrier())
    return res


def main(argv: list[str]) -> None:
    """Interleave 3 trials of each mode; print the medians and their ratio."""
    world, n_iter = int(argv[0]), int(argv[1])
    host_ids = ["a"] * (world // 2) + ["b"] * (world - world // 2) if len(argv) > 2 else None
    per: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(3):
        for mode, (module, transport) in MODES.items():
            per[mode].append(spawn(world, worker, module, n_iter, host_ids is not None, transport=transport, timeout=300,
                                   host_ids=host_ids)[0])
    for name in per["torch"][0]:
        t = statistics.median(p[name] for p in per["torch"])
        m = statistics.median(p[name] for p in per["meshtrain"])
        print(f"{name:28s} torch {t:8.1f} us  meshtrain {m:8.1f} us  ratio {m / t:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
