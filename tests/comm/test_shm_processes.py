"""The shm transport with real processes (world sizes 2, 3, 4): every collective and algorithm,
including the shm collectives, against plain-torch references; groups, async, tagged p2p.

Slots and chunks are shrunk (4 KiB) so that small tensors already travel as many pipelined chunks
and the shared buffers grow several times: the paths large messages take, at a test's cost.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

from meshtrain.comm.algorithms import algorithms_for
from meshtrain.comm.launch import spawn
from meshtrain.comm.transport import shm_memory

from ._reference import FLOATS, INTS, assert_reduced, make_input, reduce_ref

pytestmark = pytest.mark.timeout(120)

SMALL_CHUNKS = {"MESHTRAIN_SHM_SLOT_BYTES": "4096", "MESHTRAIN_SHM_CHUNK_BYTES": "4096"}
# (20_011,) crosses SMALL_BYTES (64 KiB) for 4-byte types: the chunked reduce-scatter/all-gather path
SHAPES = ((0,), (1,), (13,), (3, 5), (1_001,), (20_011,))


def _bits(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def _cases(seed: int, p: int, n: int) -> list[tuple]:
    """The same random cases on every rank: (dtype, shape, op, group ranks)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        dtype = rng.choice(FLOATS + INTS)
        shape = SHAPES[i % len(SHAPES)]
        op = rng.choice(["sum", "max", "min", "prod"] + (["avg"] if dtype in FLOATS else []))
        ranks = list(range(p)) if i % 3 == 0 or p < 3 else rng.sample(range(p), rng.randint(2, p))
        out.append((dtype, shape, op, ranks))
    return out


def _matrix(rank: int, seed: int, ncases: int) -> dict:
    """Runs in every process: returns failed cases and the bits of every all_reduce result."""
    import meshtrain.comm as mc

    p = mc.get_world_size()
    fails: list[str] = []
    bits: dict[str, int] = {}
    groups: dict[tuple, object] = {}
    for ci, (dtype, shape, op, granks) in enumerate(_cases(seed, p, ncases)):
        if tuple(granks) not in groups:  # every rank creates every group, in the same order
            groups[tuple(granks)] = mc.new_group(granks)
        g = groups[tuple(granks)]
        if rank not in granks:
            continue
        me, q = granks.index(rank), len(granks)
        cseed = seed * 1000 + ci

        def check(name, fn):
            try:
                fn()
            except AssertionError as exc:
                fails.append(f"rank {rank} case {ci} {name} {dtype} {shape} {op} {granks}: {str(exc)[:200]}")

        want = reduce_ref([make_input(cseed, r, shape, dtype, op) for r in granks], op)
        for algo in algorithms_for("all_reduce", "shm") + ["auto"]:
            def ar(algo=algo):
                t = make_input(cseed, rank, shape, dtype, op)
                mc.all_reduce(t, op=op, group=g, algorithm=algo)
                assert_reduced(t, want, op, q)
                bits[f"{ci}/{algo}"] = _bits(t)
            check(f"all_reduce {algo}", ar)
        xs = [make_input(cseed, r, shape, dtype) for r in granks]
        root = granks[ci % q]
        for algo in algorithms_for("broadcast", "shm"):
            def bc(algo=algo):
                t = xs[me].clone()
                mc.broadcast(t, root, group=g, algorithm=algo)
                assert torch.equal(t, xs[granks.index(root)])
            check(f"broadcast {algo}", bc)
        for algo in algorithms_for("reduce", "shm"):
            def rd(algo=algo):
                t = xs[me].clone()
                mc.reduce(t, root, group=g, algorithm=algo)
                if rank == root:
                    assert_reduced(t, reduce_ref(xs, "sum"), "sum", q)
                else:
                    assert torch.equal(t, xs[me])  # non-roots keep their input
            check(f"reduce {algo}", rd)
        for algo in algorithms_for("all_gather", "shm"):
            def ag(algo=algo):
                outs = [torch.empty(shape, dtype=dtype) for _ in range(q)]
                mc.all_gather(outs, xs[me], group=g, algorithm=algo)
                assert all(torch.equal(a, b) for a, b in zip(outs, xs))
            check(f"all_gather {algo}", ag)
        for algo in algorithms_for("reduce_scatter", "shm"):
            def rs(algo=algo):
                ins = [make_input(cseed, rank * q + j, shape, dtype) for j in range(q)]
                out = torch.empty(shape, dtype=dtype)
                mc.reduce_scatter(out, ins, op=op, group=g, algorithm=algo)
                ref = reduce_ref([make_input(cseed, r * q + me, shape, dtype) for r in granks], op)
                assert_reduced(out, ref, op, q)
            check(f"reduce_scatter {algo}", rs)
        if ci % 3 == 0:  # gather and scatter have no shm variant: they ride on shm p2p
            def ga():
                lst = [torch.empty(shape, dtype=dtype) for _ in range(q)] if rank == root else None
                mc.gather(xs[me].clone(), lst, dst=root, group=g)
                mc.scatter(out := torch.empty(shape, dtype=dtype), lst, src=root, group=g)
                assert torch.equal(out, xs[me])
            check("gather+scatter", ga)

            for algo in algorithms_for("all_to_all", "shm"):
                def a2a(algo=algo):
                    # uneven sizes, zeros among them; one pair of 3000 elements spans several 4 KiB chunks
                    n = lambda i, j: 3000 if (i, j) == (0, 1) else (i + 2 * j) % 4  # noqa: E731
                    ins = [make_input(9, me * 10 + j, (n(me, j),), dtype) for j in range(q)]
                    outs = [torch.empty(n(j, me), dtype=dtype) for j in range(q)]
                    mc.all_to_all(outs, ins, group=g, algorithm=algo)
                    assert all(torch.equal(outs[j], make_input(9, j * 10 + me, (n(j, me),), dtype)) for j in range(q))
                check(f"all_to_all {algo}", a2a)
    return {"fails": fails, "bits": bits, "pid": os.getpid()}


@pytest.mark.parametrize("p", [2, 3, 4])
def test_matrix_over_shm_matches_references(p, monkeypatch):
    for k, v in SMALL_CHUNKS.items():
        monkeypatch.setenv(k, v)
    res = spawn(p, _matrix, 100 + p, 12 if p < 4 else 9, timeout=110, comm_timeout=30, transport="shm")
    assert not [f for r in res for f in r["fails"]]
    keys = set().union(*(r["bits"] for r in res))
    assert len(keys) > 50
    for key in keys:  # every rank that took part holds bitwise the same all_reduce result
        assert len({r["bits"][key] for r in res if key in r["bits"]}) == 1, key
    # nothing of theirs left in /dev/shm (which another xdist worker's ranks may share meanwhile)
    assert shm_memory.segments_of(r["pid"] for r in res) == []


def _groups_async_p2p(rank: int) -> dict:
    import meshtrain.comm as mc

    g = mc.new_group([2, 0])  # non-contiguous, reversed: group rank 0 is global rank 2
    out: dict = {}
    if rank in (0, 2):
        t = torch.full((3000,), float(rank))
        w = mc.all_reduce(t, group=g, algorithm="shm", async_op=True)
        lst = [torch.empty(3) for _ in range(2)]
        mc.all_gather(lst, torch.full((3,), float(rank)), group=g, algorithm="shm")  # waits for w first
        w.wait(timeout=30)
        out["async"], out["gathered"] = t[0].item(), [x[0].item() for x in lst]
    if rank in (1, 3):  # tagged p2p, received in the opposite order; one message spans many slots
        peer = 4 - rank
        a, b = torch.full((2,), float(rank)), torch.arange(50_000, dtype=torch.float64) * rank
        w1, w2 = mc.isend(a, peer, tag=3), mc.isend(b, peer, tag=4)
        rb, ra = torch.empty(50_000, dtype=torch.float64), torch.empty(2)
        mc.recv(rb, peer, tag=4)
        mc.recv(ra, peer, tag=3)
        w1.wait(), w2.wait()
        out["p2p"] = (ra[0].item(), rb[1].item(), bool(torch.equal(rb, torch.arange(50_000.0, dtype=torch.float64) * peer)))
    strided = [torch.empty(3, 2).t() for _ in range(4)]  # outputs that are not contiguous
    mc.all_gather(strided, torch.full((2, 3), float(rank)), algorithm="shm")
    out["strided"] = [x[0, 0].item() for x in strided]
    half = torch.empty(3, dtype=torch.bfloat16)  # summed in fp32: the staging path
    mc.reduce_scatter(half, [torch.full((3,), float(rank + j), dtype=torch.bfloat16) for j in range(4)],
                      algorithm="shm")
    out["rs_bf16"] = half[0].item()
    ts = [torch.ones(2) * rank, torch.ones(3)]
    mc.all_reduce_coalesced(ts, algorithm="shm")
    out["coalesced"] = (ts[0][0].item(), ts[1][0].item())
    try:  # a tensor off the CPU ("meta" stands in for a GPU here) is refused with the fix
        mc.all_reduce(torch.empty(4, device="meta"))
        out["device"] = "accepted"
    except ValueError as exc:
        out["device"] = str(exc)
    mc.barrier()
    return out


def test_groups_async_p2p_coalesced_over_shm(monkeypatch):
    monkeypatch.setenv("MESHTRAIN_SHM_SLOT_BYTES", "4096")
    res = spawn(4, _groups_async_p2p, timeout=100, transport="shm")
    assert res[0]["async"] == res[2]["async"] == 2.0
    assert res[0]["gathered"] == res[2]["gathered"] == [2.0, 0.0]  # group order, not rank order
    assert res[1]["p2p"] == (3.0, 3.0, True) and res[3]["p2p"] == (1.0, 1.0, True)
    assert all(r["coalesced"] == (6.0, 4.0) for r in res)
    assert all(r["strided"] == [0.0, 1.0, 2.0, 3.0] for r in res)
    assert [r["rs_bf16"] for r in res] == [float(sum(q + j for q in range(4))) for j in range(4)]
    assert all("is on meta, but the shm transport moves CPU tensors" in r["device"] for r in res)
