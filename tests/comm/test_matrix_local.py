"""Property-based correctness of every collective x algorithm x world size x dtype x shape on the
thread transport, against references computed here with plain torch from all ranks' inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import meshtrain.comm as mc
from meshtrain.comm.algorithms import REGISTRY

from ._reference import FLOATS, INTS, assert_reduced, make_input, reduce_ref

WORLDS = st.sampled_from([1, 2, 3, 4, 5, 7, 8])
DTYPES = st.sampled_from(FLOATS + INTS)
SHAPES = st.sampled_from([(0,), (1,), (7,), (13,), (31,), (3, 5), (2, 0, 3), (4, 1, 2)])
SEEDS = st.integers(0, 10_000)
# ranks per simulated host (run_local's ranks_per_node): the hierarchical algorithms group by host,
# so this gives them several nodes, uneven ones (p % k != 0), and one rank per node (k = 1)
NODES = st.sampled_from([None, 1, 2, 3])


def _ops_for(dtype):
    return ["sum", "max", "min", "prod"] + (["avg"] if dtype in FLOATS else [])


def _group_ranks(p: int, pick: int) -> list[int]:
    """A subset of the world in a scrambled, non-contiguous order (or the whole world)."""
    if p < 3 or pick % 3 == 0:
        return list(range(p))
    ranks = list(range(p))[pick % 2 :: 2] or [0]
    return ranks[::-1] if pick % 4 == 1 else ranks


@given(p=WORLDS, dtype=DTYPES, shape=SHAPES, seed=SEEDS, op_pick=st.integers(0, 4), gpick=st.integers(0, 11),
       rpn=NODES)
def test_all_reduce_every_algorithm(p, dtype, shape, seed, op_pick, gpick, rpn):
    op = _ops_for(dtype)[op_pick % len(_ops_for(dtype))]
    granks = _group_ranks(p, gpick)

    def fn(rank):
        g = mc.new_group(granks)
        if rank not in granks:
            return None
        xs = [make_input(seed, r, shape, dtype, op) for r in granks]
        want = reduce_ref(xs, op)
        outs = {}
        for algo in REGISTRY["all_reduce"]:
            for node in ((None, 1, 2, 3) if algo == "hierarchical" else (None,)):
                mc.current().node_size = node
                t = make_input(seed, rank, shape, dtype, op)
                mc.all_reduce(t, op=op, group=g, algorithm=algo)
                assert_reduced(t, want, op, len(granks))
                outs[(algo, node)] = t
        return outs

    res = [r for r in mc.run_local(p, fn, timeout=30, ranks_per_node=rpn) if r is not None]
    for key in res[0]:  # every rank holds bitwise the same result
        assert all(torch.equal(r[key], res[0][key]) for r in res), key


@given(p=WORLDS, dtype=DTYPES, shape=SHAPES, seed=SEEDS, root_pick=st.integers(0, 7), op_pick=st.integers(0, 4))
def test_reduce_and_broadcast(p, dtype, shape, seed, root_pick, op_pick):
    op = _ops_for(dtype)[op_pick % len(_ops_for(dtype))]
    root = root_pick % p

    def fn(rank):
        xs = [make_input(seed, r, shape, dtype, op) for r in range(p)]
        want = reduce_ref(xs, op)
        for algo in REGISTRY["reduce"]:
            t = make_input(seed, rank, shape, dtype, op)
            mc.reduce(t, root, op=op, algorithm=algo)
            if rank == root:
                assert_reduced(t, want, op, p)
            else:  # non-roots keep their input
                assert torch.equal(t, xs[rank]), algo
        for algo in REGISTRY["broadcast"]:
            t = make_input(seed, rank, shape, dtype)
            mc.broadcast(t, root, algorithm=algo)
            assert torch.equal(t, make_input(seed, root, shape, dtype)), algo

    mc.run_local(p, fn, timeout=30)


@given(p=WORLDS, dtype=DTYPES, shape=SHAPES, seed=SEEDS, gpick=st.integers(0, 11), rpn=NODES)
def test_all_gather_both_forms(p, dtype, shape, seed, gpick, rpn):
    granks = _group_ranks(p, gpick)

    def fn(rank):
        g = mc.new_group(granks)
        if rank not in granks:
            return
        xs = [make_input(seed, r, shape, dtype) for r in granks]
        for algo in REGISTRY["all_gather"]:
            outs = [torch.full(shape, -1).to(dtype) for _ in granks]
            mc.all_gather(outs, make_input(seed, rank, shape, dtype), group=g, algorithm=algo)
            assert all(torch.equal(o, x) for o, x in zip(outs, xs)), algo
            flat = torch.empty((len(granks) * shape[0],) + shape[1:], dtype=dtype)
            mc.all_gather_into_tensor(flat, make_input(seed, rank, shape, dtype), group=g, algorithm=algo)
            assert torch.equal(flat, torch.cat(xs)), algo

    mc.run_local(p, fn, timeout=30, ranks_per_node=rpn)


@given(p=WORLDS, dtype=DTYPES, shape=SHAPES, seed=SEEDS, op_pick=st.integers(0, 4), gpick=st.integers(0, 11),
       rpn=NODES)
def test_reduce_scatter_both_forms(p, dtype, shape, seed, op_pick, gpick, rpn):
    op = _ops_for(dtype)[op_pick % len(_ops_for(dtype))]
    granks = _group_ranks(p, gpick)
    q = len(granks)

    def fn(rank):
        g = mc.new_group(granks)
        if rank not in granks:
            return
        # group rank i contributes make_input(seed, i*q + j) as its part j
        parts = [[make_input(seed, i * q + j, shape, dtype, op) for j in range(q)] for i in range(q)]
        me = granks.index(rank)
        want = reduce_ref([parts[i][me] for i in range(q)], op)
        for algo in REGISTRY["reduce_scatter"]:
            out = torch.empty(shape, dtype=dtype)
            mc.reduce_scatter(out, [t.clone() for t in parts[me]], op=op, group=g, algorithm=algo)
            assert_reduced(out, want, op, q)
            out2 = torch.empty(shape, dtype=dtype)
            mc.reduce_scatter_tensor(out2, torch.cat(parts[me]), op=op, group=g, algorithm=algo)
            assert_reduced(out2, want, op, q)

    mc.run_local(p, fn, timeout=30, ranks_per_node=rpn)


@given(p=WORLDS, dtype=DTYPES, shape=SHAPES, seed=SEEDS, root_pick=st.integers(0, 7))
def test_gather_and_scatter(p, dtype, shape, seed, root_pick):
    root = root_pick % p

    def fn(rank):
        xs = [make_input(seed, r, shape, dtype) for r in range(p)]
        for algo in REGISTRY["gather"]:
            lst = [torch.empty(shape, dtype=dtype) for _ in range(p)] if rank == root else None
            mc.gather(xs[rank].clone(), lst, dst=root, algorithm=algo)
            if rank == root:
                assert all(torch.equal(a, b) for a, b in zip(lst, xs)), algo
        for algo in REGISTRY["scatter"]:
            out = torch.empty(shape, dtype=dtype)
            mc.scatter(out, [x.clone() for x in xs] if rank == root else None, src=root, algorithm=algo)
            assert torch.equal(out, xs[rank]), algo

    mc.run_local(p, fn, timeout=30)


@given(p=WORLDS, dtype=DTYPES, seed=SEEDS, sizes=st.lists(st.integers(0, 9), min_size=64, max_size=64))
def test_all_to_all_uneven(p, dtype, seed, sizes):
    n = lambda i, j: sizes[(i * 8 + j) % 64]  # elements rank i sends to rank j  # noqa: E731

    def fn(rank):
        ins = [make_input(seed, rank * 100 + j, (n(rank, j),), dtype) for j in range(p)]
        outs = [torch.empty(n(j, rank), dtype=dtype) for j in range(p)]
        mc.all_to_all(outs, ins)
        for j in range(p):
            assert torch.equal(outs[j], make_input(seed, j * 100 + rank, (n(j, rank),), dtype))

    mc.run_local(p, fn, timeout=30)


@given(p=WORLDS, seed=SEEDS, dtype=DTYPES)
def test_coalesced_barrier_and_p2p(p, seed, dtype):
    shapes = [(3,), (0,), (2, 2), (7,)]

    def fn(rank):
        ts = [make_input(seed, rank * 10 + i, s, dtype) for i, s in enumerate(shapes)]
        mc.all_reduce_coalesced(ts, op="sum", algorithm="ring")
        for i, s in enumerate(shapes):
            assert_reduced(ts[i], reduce_ref([make_input(seed, r * 10 + i, s, dtype) for r in range(p)], "sum"), "sum", p)
        mc.barrier()
        if p > 1:  # a ring of sends with two tags, received in the opposite order
            right, left = (rank + 1) % p, (rank - 1) % p
            a, b = make_input(seed, rank, (5,), dtype), make_input(seed, rank + 50, (4,), dtype)
            w1, w2 = mc.isend(a, right, tag=1), mc.isend(b, right, tag=2)
            rb, ra = torch.empty(4, dtype=dtype), torch.empty(5, dtype=dtype)
            mc.recv(rb, left, tag=2)
            mc.irecv(ra, left, tag=1).wait()
            w1.wait(), w2.wait()
            assert torch.equal(ra, make_input(seed, left, (5,), dtype))
            assert torch.equal(rb, make_input(seed, left + 50, (4,), dtype))

    mc.run_local(p, fn, timeout=30)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_async_ops_complete_in_order(p):
    def fn(rank):
        ts = [torch.full((5,), float(rank + i)) for i in range(6)]
        works = [mc.all_reduce(t, algorithm=a, async_op=True) for t, a in zip(ts, ["ring", "tree", "direct"] * 2)]
        assert all(isinstance(w, mc.Work) for w in works)
        mc.all_reduce(torch.ones(1))  # a synchronous call waits for the async ones of its group
        assert all(w.is_completed() and w.exception() is None for w in works)
        for i, (t, w) in enumerate(zip(ts, works)):
            assert w.wait(timeout=5)
            assert torch.equal(t, torch.full((5,), float(sum(range(p)) + p * i)))
        seqs = [r["seq"] for r in mc.flight_recorder()]
        assert seqs == sorted(seqs)

    mc.run_local(p, fn, timeout=30)


def test_non_contiguous_and_half_precision_accumulate_in_fp32():
    def fn(rank):
        base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank
        t = base.t()  # non-contiguous view: reduced in place all the same
        mc.all_reduce(t, algorithm="ring")
        assert torch.equal(t, (torch.arange(12.0).reshape(3, 4) * 4 + 6).t())
        # 4096 + 1 + 1 + 1 in fp16: pairwise fp16 rounding would give 4096, fp32 accumulation 4099->4100
        h = torch.tensor([4096.0 if rank == 0 else 1.0], dtype=torch.float16)
        mc.all_reduce(h, algorithm="ring")
        assert h.item() == torch.tensor(4099.0).half().item()

    mc.run_local(4, fn)
