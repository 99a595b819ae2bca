"""The board check's own cost (``comm/check_board.py``): what a native call on a torch-transport group
of one host pays the board, apart from the runner's path around the op (docs/benchmarks.md, session 33).

    python benchmarks/check_board_cost.py [TRIALS] [CALLS]

Both members' boards live in this process, over two real shared-memory segments. A call is what the
two members do in a checked native call: both post the call's fingerprint, one looks (``verdict``),
settles and marks it compared, and the other marks it compared. Nobody waits, because every post is
already there. Prints the median over the trials of the calling thread's CPU time a call, in µs, and
each trial's; then each step's time a call, timed apart.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid

import torch

from meshtrain.comm import check_board
from meshtrain.comm.call import call_meta
from meshtrain.comm.runner import call_fingerprint
from meshtrain.comm.transport import shm_memory as mem


def main(argv: list[str]) -> int:
    """Time the board's calls and print them; returns the exit code."""
    trials = int(argv[0]) if argv else 5
    calls = int(argv[1]) if len(argv) > 1 else 20_000
    segs = [mem.Segment.create(f"{mem.PREFIX}{i}.board.{uuid.uuid4().hex[:16]}", 8 * check_board.WORDS)
            for i in range(2)]
    try:
        me, peer = check_board.CheckBoard([0, 1], 0, segs), check_board.CheckBoard([0, 1], 1, segs)
        meta = dict(call_meta([torch.Size([1024])], torch.float32, "native"), op="all_gather")
        per_call, seq = [], 0
        for _ in range(trials):
            start = time.thread_time()
            for _ in range(calls):
                seq += 1
                fp = call_fingerprint(meta, seq)
                peer.post(seq, fp, float("inf"))
                me.post(seq, fp, float("inf"))
                me.verdict(seq, fp)
                me.settle(seq, fp, float("inf"), "the benchmark's call")
                me.compared(seq)
                peer.compared(seq)
            per_call.append((time.thread_time() - start) / calls * 1e6)
        parts = _parts(me, peer, seq, calls)
    finally:
        for s in segs:
            s.unlink()
    print(f"board check, both members: median {statistics.median(per_call):.1f} us a call "
          f"(trials: {', '.join(f'{t:.1f}' for t in per_call)})")
    print("each step, us a call: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    return 0


def _parts(me: check_board.CheckBoard, peer: check_board.CheckBoard, seq: int, calls: int) -> dict[str, float]:
    """The same calls once more, each step timed apart (perf_counter around it): µs a call."""
    spent = dict.fromkeys(("peer post", "post", "verdict", "settle", "compared", "peer compared"), 0.0)
    clock, inf = time.perf_counter, float("inf")
    for _ in range(calls):
        seq += 1
        fp = seq * 7
        steps = (("peer post", peer.post, (seq, fp, inf)), ("post", me.post, (seq, fp, inf)),
                 ("verdict", me.verdict, (seq, fp)), ("settle", me.settle, (seq, fp, inf, "the call")),
                 ("compared", me.compared, (seq,)), ("peer compared", peer.compared, (seq,)))
        for name, step, args in steps:
            t0 = clock()
            step(*args)
            spent[name] += clock() - t0
    return {k: v / calls * 1e6 for k, v in spent.items()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
