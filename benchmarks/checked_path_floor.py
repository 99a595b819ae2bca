"""What a checked native all-gather costs, piece by piece (docs/benchmarks.md, session 34).

    python benchmarks/checked_path_floor.py BYTES ROUNDS CALLS [WAIT] [PATHS]
    python benchmarks/checked_path_floor.py 4096 11 300 look
    python benchmarks/checked_path_floor.py 4096 21 200 learn torch,auto,auto-look,auto-park

Two ranks on the torch transport (gloo) call a 4 KB (BYTES) all-gather back to back through:

* ``torch``: torch.distributed's own (the peer every bench compares with);
* ``bare``: the ProcessGroup's op itself, then its wait;
* ``board``: ``bare`` inside the check board's post, verdict, settle and compared;
* ``board-native``: the same through ``native.all_gather`` (meshtrain's wait, ``native_wait``);
* ``board-ahead``: as the runner does it, torch's op ahead of a late peer's post (``check_board.Ahead``);
* ``nocheck`` / ``checked``: meshtrain's whole path with the metadata check off / on;
* ``auto``: the whole path with ``algorithm="auto"`` (settled first: it has kept torch's own op), and
  ``auto-look`` / ``auto-park`` the same with meshtrain's wait fixed.

WAIT fixes meshtrain's wait (``look`` or ``park``, default ``park``; ``learn``: as shipped). PATHS, a
comma-separated list of the names above, runs only those (default: all; the ratios are to the first). Rounds interleave the paths;
each prints the median over rounds of the slower rank's wall time a call, and the median over ranks
and rounds of the calling thread's CPU time a call (gloo's own threads not counted).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch


def rank_main(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank: per round, each path's few untimed calls, a barrier, then ``calls`` timed ones."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import AllgatherOptions

    import meshtrain.comm as mc
    from meshtrain.bench.comm import _settle, float32_inputs, mc_call, torch_call
    from meshtrain.comm import check_board
    from meshtrain.comm.algorithms import native, native_wait
    from meshtrain.comm.call import resolve_group
    from meshtrain.comm.runner import board_of

    torch.set_num_threads(1)
    native_wait.set_mode(cfg["wait"])
    p = mc.get_world_size()
    inp, out, _ = float32_inputs("all_gather", cfg["bytes"], p, rank)
    g, comm = resolve_group(None), mc.current()
    mc_call("all_gather", "native", inp, out, p)  # builds the group's board
    board, pg = board_of(g), dist.group.WORLD
    flat, flat_in = out.view(-1), inp.view(-1)
    fp = 12345  # every rank posts the same fingerprint; the seq comes from the group, as a call's does

    def bare() -> None:
        native._PG_ALL_GATHER_SINGLE(pg, flat, flat_in, AllgatherOptions()).wait()

    def on_board(op, ahead: bool = False):
        def call() -> None:
            seq, deadline = g.next_seq(), time.monotonic() + 60
            board.post(seq, fp, deadline)
            everyone = board.verdict(seq, fp)[1]
            if ahead and not everyone:
                with native.guarded(check_board.Ahead(board, seq, fp, deadline, "bench")):
                    op()
            else:
                op()
            board.settle(seq, fp, deadline, "bench")
            board.compared(seq)
        return call

    def whole(check: bool, algo: str = "native", wait: str | None = None):
        def call() -> None:
            comm.check = check
            native_wait.set_mode(wait or cfg["wait"])
            mc_call("all_gather", algo, inp, out, p)
        return call

    def through_native() -> None:
        native.all_gather(pg, g.ranks, None, inp, flat)

    paths = {"torch": lambda: torch_call("all_gather", inp, out), "bare": bare, "board": on_board(bare),
             "board-native": on_board(through_native), "board-ahead": on_board(through_native, ahead=True),
             "nocheck": whole(False), "checked": whole(True),
             "auto": whole(True, "auto"), "auto-look": whole(True, "auto", "look"),
             "auto-park": whole(True, "auto", "park")}
    _settle("all_gather", inp.clone(), out.clone(), p)
    if cfg["paths"]:
        paths = {k: paths[k] for k in cfg["paths"]}
    wall: dict[str, list[float]] = {k: [] for k in paths}
    cpu: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(cfg["rounds"]):
        for name, call in paths.items():
            for _ in range(5):
                call()
            mc.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(cfg["calls"]):
                call()
            cpu[name].append((time.thread_time() - c0) / cfg["calls"] * 1e6)
            wall[name].append((time.perf_counter() - t0) / cfg["calls"] * 1e6)
    comm.check = True
    return {"wall": wall, "cpu": cpu}


def main(argv: list[str]) -> int:
    """Run and print the table; returns the exit code."""
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    from meshtrain.comm.launch import spawn

    cfg = dict(bytes=int(argv[0]), rounds=int(argv[1]), calls=int(argv[2]), wait=argv[3] if len(argv) > 3 else "park",
               paths=argv[4].split(",") if len(argv) > 4 else [])
    out = spawn(2, rank_main, cfg, transport="torch", timeout=600)
    base = None
    for name in out[0]["wall"]:
        per_round = [max(o["wall"][name][i] for o in out) for i in range(cfg["rounds"])]
        med = statistics.median(per_round)
        base = base if base is not None else med
        cpu = statistics.median(c for o in out for c in o["cpu"][name])
        print(f"all_gather {cfg['bytes']} p=2 wait={cfg['wait']} {name:13s} wall {med:7.0f} us  torch/this "
              f"{base / med:.2f}  calling thread's CPU {cpu:6.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
