"""The torch transport with real processes over gloo (world sizes 2, 3, 4): meshtrain's algorithms
against plain-torch references and against torch.distributed's own collectives on the same inputs."""

from __future__ import annotations

import time
import zlib

import pytest
import torch

from meshtrain.comm.algorithms import REGISTRY
from meshtrain.comm.launch import spawn
from meshtrain.errors import CollectiveMismatch, CollectiveTimeout

from ._reference import assert_reduced, make_input, reduce_ref

pytestmark = pytest.mark.timeout(240)

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
SHAPES = ((0,), (1,), (13,), (3, 5), (300_007,))  # the last spans several pipelined ring segments


def _matrix(rank: int) -> list[str]:
    """Runs in every process: returns a list of failed cases (empty when all pass)."""
    import torch.distributed as dist

    import meshtrain.comm as mc

    p = mc.get_world_size()
    fails: list[str] = []

    def check(name, fn):
        try:
            fn()
        except AssertionError as exc:
            fails.append(f"rank {rank} {name}: {str(exc)[:200]}")

    for dtype in DTYPES:
        for shape in SHAPES:
            seed = zlib.crc32(f"{dtype}{shape}".encode()) % 1000  # hash() of str is salted per process
            for op in ("sum", "max") + (("avg",) if dtype.is_floating_point else ()):
                want = reduce_ref([make_input(seed, r, shape, dtype, op) for r in range(p)], op)
                for algo in list(REGISTRY["all_reduce"]) + ["native"]:
                    def run_ar(algo=algo):
                        t = make_input(seed, rank, shape, dtype, op)
                        mc.all_reduce(t, op=op, algorithm=algo)
                        assert_reduced(t, want, op, p)
                    check(f"all_reduce {algo} {dtype} {shape} {op}", run_ar)

                def vs_torch():  # torch.distributed's own result on the same inputs
                    if op == "avg" or dtype in (torch.bfloat16, torch.float16):
                        return  # gloo has no avg everywhere and sums halves in half precision
                    ours = make_input(seed, rank, shape, dtype, op)
                    theirs = ours.clone()
                    mc.all_reduce(ours, op=op, algorithm="ring")
                    dist.all_reduce(theirs, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
                    assert_reduced(ours, theirs, op, p)
                check(f"vs torch {dtype} {shape} {op}", vs_torch)
            xs = [make_input(seed, r, shape, dtype) for r in range(p)]
            for algo in list(REGISTRY["broadcast"]) + ["native"]:
                def bc(algo=algo):
                    t = xs[rank].clone()
                    mc.broadcast(t, p - 1, algorithm=algo)
                    assert torch.equal(t, xs[p - 1])
                check(f"broadcast {algo} {dtype} {shape}", bc)
            for algo in list(REGISTRY["reduce"]) + ["native"]:
                def rd(algo=algo):
                    t = xs[rank].clone()
                    mc.reduce(t, 1, algorithm=algo)
                    if rank == 1:
                        assert_reduced(t, reduce_ref(xs, "sum"), "sum", p)
                check(f"reduce {algo} {dtype} {shape}", rd)
            for algo in list(REGISTRY["all_gather"]) + ["native"]:
                def ag(algo=algo):
                    outs = [torch.empty(shape, dtype=dtype) for _ in range(p)]
                    mc.all_gather(outs, xs[rank], algorithm=algo)
                    theirs = [torch.empty(shape, dtype=dtype) for _ in range(p)]
                    dist.all_gather(theirs, xs[rank])
                    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(outs, xs, theirs))
                check(f"all_gather {algo} {dtype} {shape}", ag)
            for algo in list(REGISTRY["reduce_scatter"]) + ["native"]:
                def rs(algo=algo):
                    ins = [make_input(seed, rank * p + j, shape, dtype) for j in range(p)]
                    out = torch.empty(shape, dtype=dtype)
                    mc.reduce_scatter(out, ins, algorithm=algo)
                    want = reduce_ref([make_input(seed, r * p + rank, shape, dtype) for r in range(p)], "sum")
                    assert_reduced(out, want, "sum", p)
                check(f"reduce_scatter {algo} {dtype} {shape}", rs)
            for algo in list(REGISTRY["gather"]) + ["native"]:
                def ga(algo=algo):
                    lst = [torch.empty(shape, dtype=dtype) for _ in range(p)] if rank == 0 else None
                    mc.gather(xs[rank].clone(), lst, dst=0, algorithm=algo)
                    if rank == 0:
                        assert all(torch.equal(a, b) for a, b in zip(lst, xs))
                check(f"gather {algo} {dtype} {shape}", ga)
            for algo in list(REGISTRY["scatter"]) + ["native"]:
                def sc(algo=algo):
                    out = torch.empty(shape, dtype=dtype)
                    mc.scatter(out, [x.clone() for x in xs] if rank == p - 1 else None, src=p - 1, algorithm=algo)
                    assert torch.equal(out, xs[rank])
                check(f"scatter {algo} {dtype} {shape}", sc)
        for algo in ("direct", "native"):
            def a2a(algo=algo):
                n = lambda i, j: (i + 2 * j) % 4  # noqa: E731 - uneven sizes
                ins = [make_input(9, rank * 10 + j, (n(rank, j),), dtype) for j in range(p)]
                outs = [torch.empty(n(j, rank), dtype=dtype) for j in range(p)]
                mc.all_to_all(outs, ins, algorithm=algo)
                assert all(torch.equal(outs[j], make_input(9, j * 10 + rank, (n(j, rank),), dtype)) for j in range(p))
            check(f"all_to_all {algo} {dtype}", a2a)
    return fails


@pytest.mark.parametrize("p", [2, 3, 4])
def test_matrix_over_gloo_matches_torch(p):
    fails = spawn(p, _matrix, timeout=200)
    assert not [f for rank_fails in fails for f in rank_fails]


def _groups_async_p2p(rank: int) -> dict:
    import meshtrain.comm as mc

    g = mc.new_group([2, 0])  # non-contiguous, reversed order: group rank 0 is global rank 2
    out: dict = {"grank": mc.get_rank(g), "gsize": mc.get_world_size(g)}
    if rank in (0, 2):
        ts = [torch.full((3,), float(rank)) for _ in range(2)]
        lst = [torch.empty(3) for _ in range(2)]
        mc.all_gather(lst, ts[0], group=g, algorithm="native")
        out["gathered"] = [t[0].item() for t in lst]
        w = mc.all_reduce(ts[1], group=g, algorithm="ring", async_op=True)
        w.wait(timeout=30)
        out["async"] = ts[1][0].item()
    if rank in (1, 3):  # p2p with tags, received in the opposite order
        peer = 4 - rank
        a, b = torch.full((2,), float(rank)), torch.full((5,), float(rank * 10))
        w1, w2 = mc.isend(a, peer, tag=3), mc.isend(b, peer, tag=4)
        rb, ra = torch.empty(5), torch.empty(2)
        mc.recv(rb, peer, tag=4)
        mc.recv(ra, peer, tag=3)
        w1.wait(), w2.wait()
        out["p2p"] = (ra[0].item(), rb[0].item())
    ts = [torch.ones(2) * rank, torch.ones(3)]
    mc.all_reduce_coalesced(ts, algorithm="ring")
    out["coalesced"] = (ts[0][0].item(), ts[1][0].item())
    mc.barrier()
    return out


def test_groups_async_p2p_coalesced_over_gloo():
    res = spawn(4, _groups_async_p2p, timeout=120)
    assert [r["grank"] for r in res] == [1, -1, 0, -1] and res[0]["gsize"] == 2
    assert res[0]["gathered"] == res[2]["gathered"] == [2.0, 0.0]  # group order, not rank order
    assert res[0]["async"] == res[2]["async"] == 2.0
    assert res[1]["p2p"] == (3.0, 30.0) and res[3]["p2p"] == (1.0, 10.0)
    assert all(r["coalesced"] == (6.0, 4.0) for r in res)


def _native_off_the_host(rank: int) -> list[list[float]]:
    """Runs in every process (its own, so nothing leaks): torch's own collectives with every tensor
    read as off the host (tests/_accelerator.py), so the device paths of ``native`` and
    ``dispatch`` run on gloo: NCCL's synchronous calls, the list forms, no reduce-scatter over
    all-reduce."""
    import meshtrain.comm as mc
    from meshtrain.comm import device

    device.HOST_DEVICE_TYPES = frozenset()
    x = torch.arange(4.0) + 10 * rank
    a, whole, parts, mine = x.clone(), torch.empty(8), [torch.empty(4) for _ in range(2)], torch.empty(2)
    mc.all_reduce(a, algorithm="native")
    mc.all_gather_into_tensor(whole, x, algorithm="native")
    mc.all_gather(parts, x, algorithm="native")
    mc.reduce_scatter_tensor(mine, x, algorithm="native")
    return [a.tolist(), whole.tolist(), torch.cat(parts).tolist(), mine.tolist()]


def test_native_collectives_off_the_host_over_gloo():
    xs = [torch.arange(4.0) + 10 * r for r in range(2)]
    for rank, got in enumerate(spawn(2, _native_off_the_host, timeout=60)):
        total = (xs[0] + xs[1]).tolist()
        assert got == [total, torch.cat(xs).tolist(), torch.cat(xs).tolist(), total[2 * rank : 2 * rank + 2]]


def _mismatch(rank: int, op: str, algo: str) -> None:
    import meshtrain.comm as mc

    n = 4 if rank != 1 else 6
    if op == "all_reduce":
        mc.all_reduce(torch.ones(n), algorithm=algo)
    else:  # gloo's reduce_scatter work has no future: the check beside it is awaited first
        mc.reduce_scatter_tensor(torch.empty(n), torch.ones(3 * n), algorithm=algo)


def _skip(rank: int, algo: str) -> None:
    import meshtrain.comm as mc

    mc.all_reduce(torch.ones(4))
    if rank != 2:
        mc.all_reduce(torch.ones(4), algorithm=algo)
    else:
        time.sleep(8)


# "native" runs torch's op with the metadata check beside it (runner._native_checked_beside)
@pytest.mark.parametrize("op, algo", [("all_reduce", "ring"), ("all_reduce", "native"), ("reduce_scatter", "native")])
def test_mismatch_over_gloo_is_an_error_not_a_hang(op, algo):
    t0 = time.monotonic()
    with pytest.raises(CollectiveMismatch, match=rf"ranks \[1\]: {op}\w* shapes=\[\[6\]\]"):
        spawn(3, _mismatch, op, algo, timeout=60, comm_timeout=20)
    assert time.monotonic() - t0 < 30  # well before the 20 s collective timeout plus startup


@pytest.mark.parametrize("algo", ["ring", "native"])
def test_missing_rank_over_gloo_is_named_within_the_timeout(algo):
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"all_reduce #2 .*rank\(s\) \[2\] never called it"):
        spawn(3, _skip, algo, timeout=60, comm_timeout=3)
    assert time.monotonic() - t0 < 25


def _unmatched_recv(rank: int) -> None:
    import meshtrain.comm as mc

    if rank == 0:
        mc.irecv(torch.empty(4), 1, tag=5).wait()  # rank 1 never sends: the group's timeout ends it
    else:
        time.sleep(8)  # alive past rank 0's timeout: a timeout, not a closed connection


def test_a_recv_nobody_sends_to_ends_at_the_group_timeout_naming_it():
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"recv from rank 1 \(tag 5\) timed out after 3s: .*matching send/recv"):
        spawn(2, _unmatched_recv, timeout=60, comm_timeout=3)
    assert time.monotonic() - t0 < 25


def _native_on_a_subgroup(rank: int) -> dict:
    """torch's ops called on the ProcessGroup itself (native._run's ``direct``) on a subgroup whose
    meshtrain order (3, 1) is not torch's (1, 3): roots are global ranks, mapped to torch's."""
    import meshtrain.comm as mc

    g = mc.new_group([3, 1])
    out: dict = {}
    if rank in (1, 3):
        x = torch.arange(4, dtype=torch.float32) + 10 * rank
        for root in (3, 1):
            t = x.clone()
            mc.broadcast(t, root, group=g, algorithm="native")
            out[f"broadcast{root}"] = t.tolist()
            t = x.clone()
            mc.reduce(t, root, group=g, algorithm="native")
            out[f"reduce{root}"] = t.tolist() if rank == root else None
        t = x.clone()
        mc.all_reduce(t, op="max", group=g, algorithm="native")
        out["all_reduce_max"] = t.tolist()
        whole = torch.empty(8)
        mc.all_gather_into_tensor(whole, x, group=g, algorithm="native")
        out["all_gather"] = whole.tolist()
        part = torch.empty(2)
        mc.reduce_scatter_tensor(part, x, group=g, algorithm="native")
        out["reduce_scatter"] = part.tolist()
        c = torch.tensor([1 + 2j, rank * 1j], dtype=torch.complex64)  # torch's wrapper views it as real
        mc.all_reduce(c, group=g, algorithm="native")
        out["complex"] = c.tolist()
    mc.barrier()
    return out


def test_native_ops_on_a_reordered_subgroup_match_torch_semantics():
    res = spawn(4, _native_on_a_subgroup, timeout=120)
    xs = {r: torch.arange(4, dtype=torch.float32) + 10 * r for r in (1, 3)}
    total = (xs[1] + xs[3]).tolist()
    for r in (1, 3):
        out = res[r]
        for root in (3, 1):
            assert out[f"broadcast{root}"] == xs[root].tolist()
            assert out[f"reduce{root}"] == (total if r == root else None)
        assert out["all_reduce_max"] == torch.maximum(xs[1], xs[3]).tolist()
        assert out["all_gather"] == torch.cat([xs[3], xs[1]]).tolist()  # meshtrain's group order
        mine = 0 if r == 3 else 1
        assert out["reduce_scatter"] == (xs[1] + xs[3])[2 * mine : 2 * mine + 2].tolist()
        assert out["complex"] == [2 + 4j, 4j]
    assert res[0] == res[2] == {}
