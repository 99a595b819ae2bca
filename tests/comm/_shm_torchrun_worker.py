"""Run by test_shm_failures under ``torchrun --standalone --nproc_per_node 4``: init(transport="auto")
must pick shm on one host, and the collectives must agree with plain-torch references."""

import os

import torch

import meshtrain.comm as mc


def main() -> None:
    comm = mc.init(transport="auto", timeout=30)
    assert comm.transport.kind == "shm", comm.transport.kind
    p, r = mc.get_world_size(), mc.get_rank()
    x = torch.arange(100_000, dtype=torch.float32) * (r + 1)
    want = torch.arange(100_000, dtype=torch.float32) * sum(range(1, p + 1))
    for algo in ("auto", "shm", "ring"):
        t = x.clone()
        mc.all_reduce(t, algorithm=algo)
        assert torch.equal(t, want), algo
    b = torch.full((10,), float(r))
    mc.broadcast(b, 3)
    assert torch.equal(b, torch.full((10,), 3.0))
    print(f"shm worker pid {os.getpid()}", flush=True)  # the test checks these ranks' segments are gone
    mc.barrier()
    if r == 0:
        print(f"shm worker OK world={p}", flush=True)
    mc.destroy()


if __name__ == "__main__":
    main()
