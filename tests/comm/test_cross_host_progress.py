"""Rings that mix shared-memory links (same host) and gloo links (other hosts) never deadlock.

Four processes, two per simulated host (``MESHTRAIN_HOST_ID``; tests/hosts runs real namespaces),
``init(transport="auto")``: shm inside a host, gloo between. A ring step larger than the shm outbox
used to deadlock (a rank blocked in gloo never pumped its queued shm chunks); the progress engine
(comm/transport/progress.py) keeps every pending message moving whichever link a rank waits on.
"""

from __future__ import annotations

import torch

from meshtrain.comm.launch import spawn

HOSTS = ["hostA", "hostA", "hostB", "hostB"]


def _rings(rank: int) -> dict[str, bool]:
    import meshtrain.comm as mc

    assert mc.current().transport.kind == "shm" and mc.current().transport.remote is not None
    p = mc.get_world_size()
    ok: dict[str, bool] = {}
    n = 1 << 20  # 4 MiB per rank: each ring step is twice the 2 MiB shm outbox
    for algo in ("auto", "ring", "recursive_doubling", "direct"):
        out = torch.empty(n * p)
        mc.all_gather_into_tensor(out, torch.full((n,), float(rank)), algorithm=algo)
        ok[f"all_gather {algo}"] = torch.equal(out, torch.arange(p, dtype=torch.float32).repeat_interleave(n))
    x = torch.arange(4 * n, dtype=torch.float32) + rank
    out = torch.empty(n)
    mc.reduce_scatter_tensor(out, x, algorithm="ring")
    ok["reduce_scatter ring"] = torch.equal(out, (torch.arange(4 * n, dtype=torch.float32) * p + sum(range(p)))
                                            [rank * n:(rank + 1) * n])
    for algo in ("ring", "halving_doubling", "hierarchical"):
        t = torch.full((3 * n,), float(rank + 1))
        mc.all_reduce(t, algorithm=algo)
        ok[f"all_reduce {algo}"] = torch.equal(t, torch.full((3 * n,), float(sum(range(1, p + 1)))))
    # A permuted group: its ring crosses hosts at every step (0 -> 2 -> 1 -> 3 -> 0).
    g = mc.new_group([0, 2, 1, 3])
    t = torch.full((3 * n,), float(rank))
    mc.all_reduce(t, algorithm="ring", group=g)
    ok["all_reduce ring, permuted group"] = torch.equal(t, torch.full((3 * n,), float(sum(range(p)))))
    return ok


def test_rings_across_shm_and_gloo_links_complete():
    results = spawn(4, _rings, transport="auto", host_ids=HOSTS, timeout=240, comm_timeout=30)
    for rank, ok in enumerate(results):
        assert all(ok.values()), f"rank {rank}: wrong results in {[k for k, v in ok.items() if not v]}"
