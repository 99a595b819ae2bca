"""The cost of one call's metadata fingerprint (``comm/runner.py``), as the shared-memory and board
checks pay it on every collective: the JSON + blake2b hash of every call (before session 31)
against ``call_fingerprint``'s memo with the sequence number mixed in (docs/benchmarks.md, session 31).

    python benchmarks/call_fingerprint.py [TRIALS] [CALLS]

Prints the median over interleaved trials of µs per fingerprint, and each trial's.
"""

from __future__ import annotations

import json
import statistics
import sys
import timeit

import torch

from meshtrain.comm import runner
from meshtrain.comm.call import call_meta


def main(argv: list[str]) -> int:
    """Time both ways and print them; returns the exit code."""
    trials = int(argv[0]) if argv else 7
    calls = int(argv[1]) if len(argv) > 1 else 50_000
    meta = dict(call_meta([torch.Size([1024])], torch.float32, "native", redop="sum"), op="all_reduce")
    seq = [0]

    def hashed_every_call() -> int:  # what _run_checked did: the payload with its seq, hashed
        seq[0] += 1
        return runner.fingerprint(json.dumps({"meta": dict(meta, seq=seq[0]), "pair": None}, sort_keys=True))

    def memoized() -> int:
        seq[0] += 1
        return runner.call_fingerprint(meta, seq[0])

    times: dict[str, list[float]] = {"hashed every call": [], "call_fingerprint": []}
    for _ in range(trials):
        for name, fn in (("hashed every call", hashed_every_call), ("call_fingerprint", memoized)):
            times[name].append(timeit.timeit(fn, number=calls) / calls * 1e6)
    for name, ts in times.items():
        print(f"{name:18s} median {statistics.median(ts):6.2f} us  trials {[round(t, 2) for t in ts]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
