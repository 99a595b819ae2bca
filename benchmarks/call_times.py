"""Per-call times of collectives in a loop of back-to-back calls, as a histogram (docs/benchmarks.md,
session 23): what a median hides and a loop pays.

    python benchmarks/call_times.py OP BYTES ALGORITHMS [CALLS] [WORLD]
    python benchmarks/call_times.py all_reduce 4096 native,mc:native,mc:recursive_doubling 400

``native`` is torch.distributed's own op called directly; ``mc:NAME`` is meshtrain.comm with
``algorithm=NAME`` (``mc:native`` is torch's op through meshtrain's front end and check). Ranks are
processes on the torch transport (gloo). Prints, per rank and algorithm, the mean and median
microseconds and the count of calls in each bucket.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

EDGES_US = (0, 100, 200, 400, 800, 1600, 3200, 6400, float("inf"))


def rank_main(rank: int, cfg: dict[str, Any]) -> dict[str, list[float]]:
    """One rank: ``cfg["calls"]`` timed calls of each algorithm after 10 untimed ones."""
    import meshtrain.comm as mc
    from meshtrain.bench.comm import _call, float32_inputs, mc_call

    torch.set_num_threads(1)
    p = mc.get_world_size()
    op = cfg["op"]
    inp, out, _ = float32_inputs(op, cfg["bytes"], p, rank)

    def call(algo: str) -> None:
        if algo.startswith("mc:"):
            mc_call(op, algo[3:], inp, out, p)
        else:
            _call(op, algo, inp, out, p)

    times: dict[str, list[float]] = {}
    for algo in cfg["algorithms"]:
        for _ in range(10):
            call(algo)
        mc.barrier()
        ts = times[algo] = []
        for _ in range(cfg["calls"]):
            t0 = time.perf_counter()
            call(algo)
            ts.append((time.perf_counter() - t0) * 1e6)
    return times


def main(argv: list[str]) -> int:
    """Run and print the histograms; returns the exit code."""
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    from meshtrain.comm.launch import spawn

    cfg = {"op": argv[0], "bytes": int(argv[1]), "algorithms": argv[2].split(","),
           "calls": int(argv[3]) if len(argv) > 3 else 400}
    world = int(argv[4]) if len(argv) > 4 else 2
    out = spawn(world, rank_main, cfg, timeout=900)
    labels = ", ".join(f"<{int(hi)}" if hi != float("inf") else f">={int(lo)}"
                       for lo, hi in zip(EDGES_US, EDGES_US[1:]))
    print(f"# {cfg['op']} {cfg['bytes']} B, {world} ranks, {cfg['calls']} calls; µs buckets: {labels}")
    for rank, times in enumerate(out):
        for algo, ts in times.items():
            counts = [sum(lo <= t < hi for t in ts) for lo, hi in zip(EDGES_US, EDGES_US[1:])]
            print(f"rank {rank} {algo:<24} mean {statistics.mean(ts):7.0f}  median {statistics.median(ts):7.0f}  {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
