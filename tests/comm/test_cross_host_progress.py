"""Rings that mix shared-memory links (same host) and gloo links (other hosts) never deadlock.

Four processes, two per simulated host (``MESHTRAIN_HOST_ID``; tests/hosts runs real namespaces),
``init(transport="auto")``: shm inside a host, gloo between. A ring step larger than the shm outbox
used to deadlock (a rank blocked in gloo never pumped its queued shm chunks); the progress engine
(comm/transport/progress.py) keeps every pending message moving whichever link a rank waits on.
"""

from __future__ import annotations

import time

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


def _mismatches(rank: int) -> dict[str, str]:
    """Mismatched hierarchical calls across hosts (the check rides the steps: hierarchical.Check)."""
    import meshtrain.comm as mc
    from meshtrain.errors import CollectiveMismatch, CollectiveTimeout

    p = mc.get_world_size()
    seen: dict[str, str] = {}
    t = mc.current().transport
    rounds = []
    exchange = t.exchange
    t.exchange = lambda *a, **k: rounds.append(a[0]) or exchange(*a, **k)  # count store rounds
    for _ in range(3):  # matching calls check the metadata without a round of their own
        mc.all_reduce(torch.ones(4096), algorithm="hierarchical")
        mc.all_gather_into_tensor(torch.empty(64 * p), torch.ones(64), algorithm="hierarchical")
    seen["store rounds"] = str(rounds)
    # (case, the rank that differs): a leader (2) and a non-leader (3), for each op
    for case, odd in (("all_reduce", 2), ("all_reduce", 3), ("all_gather", 3), ("reduce_scatter", 2)):
        n = 1024 + (8 if rank == odd else 0)
        try:
            if case == "all_reduce":
                mc.all_reduce(torch.ones(n), algorithm="hierarchical")
            elif case == "all_gather":
                mc.all_gather_into_tensor(torch.empty(n * p), torch.ones(n), algorithm="hierarchical")
            else:
                mc.reduce_scatter_tensor(torch.empty(n), torch.ones(n * p), algorithm="hierarchical")
            seen[f"{case} {odd}"] = "no error"
        except CollectiveMismatch as exc:
            seen[f"{case} {odd}"] = str(exc)
        # the group still works after a named mismatch
        t = torch.full((64,), float(rank))
        mc.all_reduce(t, algorithm="hierarchical")
        assert torch.equal(t, torch.full((64,), float(sum(range(p)))))
    # Last (a timed-out gloo wait closes its connection): rank 3 (host B, not its leader) never
    # calls; the others must name it.
    g = mc.new_group(list(range(4)), timeout=2.0)
    if rank == 3:  # alive (an exited rank is named as lost), just elsewhere
        time.sleep(6)
        return seen
    try:
        mc.all_reduce(torch.ones(4096), algorithm="hierarchical", group=g)
        seen["never called"] = "no error"
    except CollectiveTimeout as exc:
        seen["never called"] = str(exc)
    return seen


def test_mismatched_or_missing_calls_across_hosts_are_named_on_every_rank():
    results = spawn(4, _mismatches, transport="auto", host_ids=HOSTS, timeout=120, comm_timeout=20)
    for rank, seen in enumerate(results):
        assert seen.pop("store rounds") == "[]", f"rank {rank}: the check took store rounds"
        if rank != 3:
            msg = seen.pop("never called")
            assert "rank(s) [3] never called it" in msg, f"rank {rank}: {msg}"
        for case, msg in seen.items():
            odd = int(case.split()[1])
            assert f"ranks [{odd}]:" in msg and "shapes=[[1032]]" in msg, f"rank {rank}, {case}: {msg}"



def _two_threads(rank: int, rounds: int) -> list[bool]:
    """The training thread's uneven all-to-alls on one group while another thread all-reduces on
    a second group of the same ranks (data parallelism's buckets beside the experts' dispatch):
    both check their metadata through the store at once."""
    import threading

    import meshtrain.comm as mc

    c = mc.current()
    a, b = c.new_group([0, 1, 2, 3]), c.new_group([0, 1, 2, 3])
    sums: list[bool] = []
    errors: list[BaseException] = []

    def reduce() -> None:
        try:
            for _ in range(rounds):
                t = torch.ones(1000)
                mc.all_reduce(t, group=b)
                sums.append(torch.equal(t, torch.full((1000,), 4.0)))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the rank's thread
            errors.append(exc)

    th = threading.Thread(target=reduce)
    th.start()
    g = torch.Generator().manual_seed(0)
    parts = []
    for _ in range(rounds):
        m = torch.randint(0, 3, (4, 4), generator=g)  # m[i][j]: rows rank i sends to rank j
        sends, recvs = m[rank].tolist(), m[:, rank].tolist()
        out = torch.empty(sum(recvs), 8)
        mc.all_to_all_single(out, torch.full((sum(sends), 8), float(rank)), recvs, sends, group=a)
        parts.append(torch.equal(out, torch.cat([torch.full((n, 8), float(i)) for i, n in enumerate(recvs)])))
    th.join()
    if errors:
        raise errors[0]
    return parts + sums


def test_two_threads_check_calls_of_two_groups_through_the_store_at_once():
    """A TCPStore client's blocking read holds its one socket: two threads' exchanges on one
    connection waited behind each other on every rank (a hang until the timeout). Each thread has
    a connection of its own."""
    start = time.monotonic()
    for ok in spawn(4, _two_threads, 30, timeout=90, comm_timeout=20, transport="auto", host_ids=HOSTS):
        assert len(ok) == 60 and all(ok)
    assert time.monotonic() - start < 60
