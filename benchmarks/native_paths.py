"""Back-to-back time per call of torch's own collective against meshtrain's `native` path (the same
op through meshtrain's front end, its metadata check and its wait) in its wait modes, and against
meshtrain's own algorithms, in interleaved rounds (docs/benchmarks.md, session 30).

    python benchmarks/native_paths.py BYTES WORLD [ROUNDS] [CALLS] [OP] [VARIANTS]
    python benchmarks/native_paths.py 1048576 4 5 60 all_reduce torch,mc,mc-look,mc-park,mc-park-nocheck,ring

Variants: ``torch`` (torch.distributed's op called directly: the peer), ``mc`` (meshtrain's native
as configured: the wait mode learned, ``comm/algorithms/native_wait.py``), ``mc-look`` / ``mc-park``
(the wait mode fixed), a ``-nocheck`` suffix (the metadata check off), or an algorithm name
(``ring``, ``direct``, ...); for reduce_scatter an ``-ownrs`` suffix runs gloo's own reduce-scatter
behind meshtrain's native path, not its all-reduce staged in scratch (``dispatch.RS_OVER_ALL_REDUCE_MAX``
set to 0). Ranks are processes on the torch transport (gloo). Prints each
variant's median over the rounds of the slowest rank's mean time per call, torch's time over it,
and the CPU time the calling thread spent a call (``time.thread_time``; gloo's own threads not
counted): with the wait parked, that is the front end and the check alone.
``NATIVE_PATHS_PROFILE=VARIANT`` also prints rank 0's profile of that variant's first round (which the
profiler slows: the median over the rounds leaves it out).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Any

import torch


def rank_main(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank: per round, per variant, a few untimed calls, a barrier, ``calls`` timed ones; the
    times, and the wait mode ``mc`` learned for the size."""
    import meshtrain.comm as mc
    from meshtrain.bench.comm import float32_inputs, mc_call, torch_call
    from meshtrain.comm.algorithms import dispatch, native_wait

    torch.set_num_threads(1)
    p = mc.get_world_size()
    op = cfg["op"]
    inp, out, _ = float32_inputs(op, cfg["bytes"], p, rank)
    comm = mc.current()
    staged_max = dispatch.RS_OVER_ALL_REDUCE_MAX

    def setup(variant: str) -> Any:
        name, _, rest = variant.partition("-")
        comm.check = "nocheck" not in rest
        dispatch.RS_OVER_ALL_REDUCE_MAX = 0 if "ownrs" in rest else staged_max
        mode = "-".join(w for w in rest.split("-") if w not in ("nocheck", "ownrs"))
        native_wait.set_mode((mode or "learn") if name == "mc" else "learn")
        if name == "torch":
            return lambda: torch_call(op, inp, out)
        return lambda: mc_call(op, "native" if name == "mc" else name, inp, out, p)

    res: dict[str, list[float]] = {v: [] for v in cfg["variants"]}
    cpu: dict[str, list[float]] = {v: [] for v in cfg["variants"]}
    profile = None
    for r in range(cfg["rounds"]):
        for v in cfg["variants"]:
            call = setup(v)
            for _ in range(5):
                call()
            mc.barrier()
            prof = cProfile.Profile() if rank == 0 and r == 0 and v == cfg["profile"] else None
            if prof is not None:
                prof.enable()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(cfg["calls"]):
                call()
            cpu[v].append((time.thread_time() - c0) / cfg["calls"] * 1e6)
            res[v].append((time.perf_counter() - t0) / cfg["calls"] * 1e6)
            if prof is not None:
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
                profile = text.getvalue()
    kept = native_wait.kept(cfg["bytes"])
    return {"times": res, "cpu": cpu, "kept": {None: "exploring", True: "look", False: "park"}[kept], "profile": profile}


def main(argv: list[str]) -> int:
    """Run and print the table; returns the exit code."""
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    from meshtrain.comm.launch import spawn

    nbytes, world = int(argv[0]), int(argv[1])
    rounds = int(argv[2]) if len(argv) > 2 else 5
    calls = int(argv[3]) if len(argv) > 3 else 50
    op = argv[4] if len(argv) > 4 else "all_reduce"
    variants = (argv[5] if len(argv) > 5 else "torch,mc,mc-look,mc-park,mc-park-nocheck,ring").split(",")
    cfg = dict(op=op, bytes=nbytes, rounds=rounds, calls=calls, variants=variants,
               profile=os.environ.get("NATIVE_PATHS_PROFILE"))
    out = spawn(world, rank_main, cfg, transport="torch", timeout=600)
    base = None
    for v in variants:
        per_round = [max(o["times"][v][i] for o in out) for i in range(rounds)]
        # the CPU the caller's own thread spent a call (front end, check, wait; not gloo's threads):
        # the median over ranks and rounds, steadier than the time on a shared VM
        cpu_us = statistics.median(c for o in out for c in o["cpu"][v])
        med = statistics.median(per_round)
        base = base if base is not None else med
        print(f"{op} {nbytes} p={world} {v:18s} median {med:8.0f} us  torch/this {base / med:.2f}  "
              f"rounds {[round(x) for x in per_round]}  calling thread's CPU {cpu_us:.1f} us a call")
    print(f"# the wait mode mc learned, per rank: {[o['kept'] for o in out]}")
    if out[0]["profile"]:
        print(f"# rank 0's first round of {cfg['profile']}, by time inside each function:\n{out[0]['profile']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
