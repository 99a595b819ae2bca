"""Where a checked ``auto`` call that kept torch's own op spends its time, phase by phase, in place
(docs/benchmarks.md, session 35).

    python benchmarks/native_call_phases.py BYTES ROUNDS [WAIT]
    python benchmarks/native_call_phases.py 4096 5 park

Two ranks on the torch transport (gloo) call a BYTES all-gather 200 times a round, ROUNDS rounds,
through two paths in turn:

* ``bare``: the ProcessGroup's op and its wait, as torch's own wrapper issues it (no Python around);
* ``auto``: ``meshtrain.comm.all_gather_into_tensor`` with ``algorithm="auto"``, settled first (it
  has kept torch's own op), with the metadata check on.

The ProcessGroup's op is wrapped so that each call is cut into phases: ``pre`` (the call's entry to
the op's issue), ``issue`` (the op's issue), ``wait`` (torch's wait; 0 where the op was seen complete
by looking), ``post`` (the end of the wait to the call's return). For each: the median wall time and
the mean CPU time of the calling thread. A hot loop's front end runs 2-3x faster than the same code
here, between ops, after the thread has slept (a cold cache): this is what a training loop pays.
For ``auto`` the line ``pre segments`` splits ``pre`` at the entries of the runner's steps.

WAIT fixes meshtrain's wait (``look``, ``park`` or ``learn``, default ``park``).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

_SEGMENTS = (("runner", "run"), ("runner", "_run_checked"), ("runner", "_native_ahead"),
             ("native", "all_gather"), ("native", "_run"))


def rank_main(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank: the phases of each path's calls, and ``auto``'s pre segments."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import AllgatherOptions

    import meshtrain.comm as mc
    from meshtrain.bench.comm import _settle, float32_inputs, mc_call
    from meshtrain.comm import check_board, runner
    from meshtrain.comm.algorithms import native, native_wait

    torch.set_num_threads(1)
    p = mc.get_world_size()
    inp, out, _ = float32_inputs("all_gather", cfg["bytes"], p, rank)
    _settle("all_gather", inp.clone(), out.clone(), p)
    native_wait.set_mode(cfg["wait"])
    marks: dict[str, tuple[float, float]] = {}
    stamps: list[tuple[str, float]] = []

    def now() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    class Timed:
        """A work whose wait is timed."""

        __slots__ = ("work",)

        def __init__(self, work: Any) -> None:
            self.work = work

        def wait(self, *a: Any, **k: Any) -> Any:
            marks["w0"] = now()
            r = self.work.wait(*a, **k)
            marks["w1"] = now()
            return r

        def is_completed(self) -> bool:
            return self.work.is_completed()

        def get_future(self) -> Any:
            return self.work.get_future()

    real_op = native._PG_ALL_GATHER_SINGLE

    def issue(*a: Any) -> Timed:
        marks["i0"] = now()
        work = real_op(*a)
        marks["i1"] = now()
        return Timed(work)

    def stamped(mod: Any, name: str) -> None:
        f = getattr(mod, name)

        def entry(*a: Any, **k: Any) -> Any:
            stamps.append((name, time.perf_counter()))
            return f(*a, **k)
        setattr(mod, name, entry)

    native._PG_ALL_GATHER_SINGLE = issue
    for mod, name in _SEGMENTS:
        stamped({"runner": runner, "native": native}[mod], name)
    real_post = check_board.CheckBoard.post

    def post(self: Any, *a: Any) -> None:
        stamps.append(("post", time.perf_counter()))
        real_post(self, *a)
        stamps.append(("posted", time.perf_counter()))
    check_board.CheckBoard.post = post  # type: ignore[method-assign]

    pg = dist.group.WORLD

    def bare() -> None:
        opts = AllgatherOptions()
        opts.asyncOp = False
        native._PG_ALL_GATHER_SINGLE(pg, out, inp, opts).wait()

    paths = {"bare": bare, "auto": lambda: mc_call("all_gather", "auto", inp, out, p)}
    phases = ("pre", "issue", "wait", "post", "total")
    res: dict[str, dict[str, list[tuple[float, float]]]] = {k: {ph: [] for ph in phases} for k in paths}
    segments: dict[str, list[float]] = {}
    for _ in range(cfg["rounds"]):
        for name, call in paths.items():
            mc.barrier()
            for _ in range(200):
                marks.clear()
                stamps.clear()
                t0 = now()
                call()
                t1 = now()
                if "i1" not in marks:  # another algorithm ran (auto re-probing after a drift): not this path
                    continue
                if "w0" not in marks:  # seen complete by looking: no wait of torch's
                    marks["w0"] = marks["w1"] = marks["i1"]
                for ph, a, b in (("pre", t0, marks["i0"]), ("issue", marks["i0"], marks["i1"]),
                                 ("wait", marks["w0"], marks["w1"]), ("post", marks["w1"], t1), ("total", t0, t1)):
                    res[name][ph].append((b[0] - a[0], b[1] - a[1]))
                if name == "auto":
                    prev = t0[0]
                    for step, t in stamps + [("issue", marks["i0"][0])]:
                        segments.setdefault(step, []).append(t - prev)
                        prev = t
    native._PG_ALL_GATHER_SINGLE = real_op
    return {"phases": {name: {ph: (statistics.median(x[0] for x in v) * 1e6, statistics.fmean(x[1] for x in v) * 1e6)
                              for ph, v in r.items() if v} for name, r in res.items()},
            "segments": {k: statistics.median(v) * 1e6 for k, v in segments.items()}}


def main(argv: list[str]) -> int:
    """Run and print the phases; returns the exit code."""
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    from meshtrain.comm.launch import spawn

    cfg = dict(bytes=int(argv[0]), rounds=int(argv[1]), wait=argv[2] if len(argv) > 2 else "park")
    out = spawn(2, rank_main, cfg, transport="torch", timeout=600)
    print(f"all_gather {cfg['bytes']} p=2 wait={cfg['wait']}: wall median / calling thread's CPU mean, us a call")
    for r, o in enumerate(out):
        for name, ph in o["phases"].items():
            print(f"rank {r} {name:5s} " + "  ".join(f"{k} {w:6.1f}/{c:6.1f}" for k, (w, c) in ph.items()))
        print(f"rank {r} auto pre segments (wall median, up to each step's entry): "
              + ", ".join(f"{k} {v:.1f}" for k, v in o["segments"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
