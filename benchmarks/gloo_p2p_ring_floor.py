"""The floor for any ring all-reduce built on gloo's point-to-point path, next to gloo's own.

Run: ``torchrun --nproc-per-node 4 benchmarks/gloo_p2p_ring_floor.py [MiB]``. Rank 0 prints the
mean time of: a bare ring all-reduce written straight on ``torch.distributed.isend/irecv`` (one
message per step, no checks, no Python engine), the same steps without the reductions, all those
messages posted at once (no step depends on another), and ``dist.all_reduce`` (gloo's in-library
ring). meshtrain's ring cannot beat the first line on the torch transport: see docs/benchmarks.md.
"""

import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    """Time the four variants, interleaved three times, and print one line each on rank 0."""
    dist.init_process_group("gloo")
    r, p = dist.get_rank(), dist.get_world_size()
    n = (int(sys.argv[1]) if len(sys.argv) > 1 else 16) * (1 << 20) // 4
    x, chunk = torch.randn(n), n // p
    right, left = (r + 1) % p, (r - 1) % p
    slot = torch.empty(chunk)

    def ring(reduce: bool = True) -> None:
        for t in range(2 * (p - 1)):
            s = dist.isend(x[:chunk], right)
            dist.irecv(slot, left).wait()
            if reduce and t < p - 1:
                x[chunk : 2 * chunk].add_(slot)
            s.wait()

    def all_posted() -> None:
        works = []
        for _ in range(2 * (p - 1)):
            works += [dist.isend(x[:chunk], right), dist.irecv(slot, left)]
        for w in works:
            w.wait()

    variants = [("p2p ring", ring), ("p2p ring, no reduction", lambda: ring(False)),
                ("p2p messages all posted", all_posted), ("gloo all_reduce", lambda: dist.all_reduce(x))]
    for name, fn in variants * 3:
        for _ in range(2):
            fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        dist.barrier()
        if r == 0:
            print(f"p={p} {n * 4 >> 20} MiB  {name:<26} {(time.perf_counter() - t0) / 10 * 1e3:7.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
