"""``meshtrain bench comm --front-end``: what a call costs before (and around) its data movement.

One process, a one-rank world made the way a program that switched its import makes it
(``init_process_group("gloo")``): a call on one rank moves no data, so its time is the front end
alone -- argument checks, the algorithm choice, the metadata, the sequence number, the flight
recorder. The same calls through torch.distributed on the same one-rank gloo group are the peer.
Trials interleave meshtrain and torch; the median trial of each is reported.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

TARGET_US = 10.0  # issue 33: the front end's cost per call on a one-rank group


def _calls(mc: Any, td: Any, x: torch.Tensor, out: torch.Tensor) -> dict[str, tuple[Callable, Callable]]:
    from ..comm.algorithms import native

    return {
        "all_reduce": (lambda: mc.all_reduce(x), lambda: td.all_reduce(x)),
        "all_gather_into_tensor": (lambda: mc.all_gather_into_tensor(out, x),
                                   lambda: native.ALL_GATHER_SINGLE(out, x)),
        "reduce_scatter_tensor": (lambda: mc.reduce_scatter_tensor(out, x),
                                  lambda: native.REDUCE_SCATTER_SINGLE(out, x)),
        "broadcast": (lambda: mc.broadcast(x, 0), lambda: td.broadcast(x, 0)),
        "barrier": (lambda: mc.barrier(), lambda: td.barrier()),
    }


def rank_main(rank: int, trials: int, calls: int) -> dict[str, dict[str, Any]]:
    """Time each call on a one-rank world: µs per call, meshtrain and torch, per trial."""
    import torch.distributed as td

    import meshtrain.comm as mc

    torch.set_num_threads(1)
    mc.init_process_group("gloo")
    x, out = torch.randn(1024), torch.empty(1024)
    res: dict[str, dict[str, Any]] = {}
    for name, (ours, theirs) in _calls(mc, td, x, out).items():
        times: dict[str, list[float]] = {"meshtrain": [], "torch": []}
        for _ in range(trials):
            for who, fn in (("meshtrain", ours), ("torch", theirs)):
                for _ in range(min(calls, 200)):
                    fn()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[who].append((time.perf_counter() - t0) / calls * 1e6)
        res[name] = {"meshtrain_us": statistics.median(times["meshtrain"]),
                     "torch_us": statistics.median(times["torch"]),
                     "trials_meshtrain_us": times["meshtrain"], "trials_torch_us": times["torch"]}
    mc.destroy_process_group()
    return res


def run(trials: int = 7, calls: int = 3000, timeout: float = 600.0) -> dict[str, dict[str, Any]]:
    """Run ``rank_main`` in one fresh process (as torchrun leaves it: torch.distributed only)."""
    from ..comm.launch import spawn

    return spawn(1, rank_main, trials, calls, timeout=timeout, transport=None)[0]


def report(res: dict[str, dict[str, Any]]) -> list[str]:
    """Lines of the table: per call, meshtrain and torch µs, the difference and the target."""
    lines = [f"# front end on a one-rank world (init_process_group('gloo')), median trial, us per call; "
             f"target <= {TARGET_US:g} us",
             f"# {'call':24s} {'meshtrain':>10} {'torch':>8} {'ratio':>6}  target"]
    for name, r in res.items():
        ok = "met" if r["meshtrain_us"] <= TARGET_US else "MISSED"
        lines.append(f"  {name:24s} {r['meshtrain_us']:10.2f} {r['torch_us']:8.2f} "
                     f"{r['meshtrain_us'] / r['torch_us']:6.2f}  {ok}")
    return lines
