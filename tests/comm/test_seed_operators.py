"""The seed API's four usage examples (and its communicator) give the right results."""

import pytest
import torch

import meshtrain.comm as mc
from meshtrain.comm.operators import (AllGatherOperator, AllReduceOperator, BroadcastOperator,
                                      DistributedCommunicator, ReduceScatterOperator,
                                      create_ring_topology, run_threads)

W = 4


@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
def test_all_reduce_example(op):
    comms = create_ring_topology(W)
    ops = [AllReduceOperator(c) for c in comms]
    grads = [torch.randn(1000) for _ in range(W)]
    before = [g.clone() for g in grads]
    synced = run_threads([lambda r=r: ops[r].all_reduce(grads[r], op=op) for r in range(W)])
    stack = torch.stack(grads)
    want = {"sum": stack.sum(0), "max": stack.max(0).values, "min": stack.min(0).values, "mean": stack.mean(0)}[op]
    for s in synced:
        torch.testing.assert_close(s, want)
    assert all(torch.equal(a, b) for a, b in zip(grads, before))  # inputs untouched


@pytest.mark.parametrize("root", [0, 2])
def test_broadcast_example(root):
    ops = [BroadcastOperator(c) for c in create_ring_topology(W)]
    params = torch.randn(1000)
    data = [params if i == root else torch.zeros(1000) for i in range(W)]
    out = run_threads([lambda r=r: ops[r].broadcast(data[r], root_rank=root) for r in range(W)])
    assert all(torch.equal(o, params) for o in out)


def test_all_gather_example():
    ops = [AllGatherOperator(c) for c in create_ring_topology(W)]
    stats = [torch.randn(100) for _ in range(W)]
    out = run_threads([lambda r=r: ops[r].all_gather(stats[r]) for r in range(W)])
    assert all(torch.equal(o, torch.cat(stats)) for o in out)


def test_reduce_scatter_example():
    ops = [ReduceScatterOperator(c) for c in create_ring_topology(W)]
    full = [torch.randn(4000) for _ in range(W)]
    out = run_threads([lambda r=r: ops[r].reduce_scatter(full[r]) for r in range(W)])
    total = torch.stack(full).sum(0)
    for r, o in enumerate(out):
        torch.testing.assert_close(o, total[r * 1000 : (r + 1) * 1000])


def test_reduce_scatter_indivisible_is_a_clear_error():
    ops = [ReduceScatterOperator(c) for c in create_ring_topology(2)]
    with pytest.raises(ValueError, match="divisible by the world size 2"):
        run_threads([lambda r=r: ops[r].reduce_scatter(torch.ones(3)) for r in range(2)])


def test_communicator_send_recv_barrier_and_run_local_form():
    def fn(rank):
        c = DistributedCommunicator(rank, 3)
        if rank == 0:
            c.send(torch.arange(6.0).reshape(2, 3), 2, tag=5)
        if rank == 2:
            got = c.recv(0, torch.Size([2, 3]), torch.float32, tag=5)
            assert torch.equal(got, torch.arange(6.0).reshape(2, 3))
        c.barrier()
        return AllReduceOperator(c).all_reduce(torch.full((2,), float(rank)))

    assert all(torch.equal(o, torch.full((2,), 3.0)) for o in mc.run_local(3, fn))


def test_communicator_wrong_rank_is_a_clear_error():
    with pytest.raises(ValueError, match="does not match"):
        mc.run_local(2, lambda rank: DistributedCommunicator(rank, 5))


def test_benchmark_returns_timings_per_shape():
    ops = [AllReduceOperator(c) for c in create_ring_topology(2)]
    shapes = [(1000,), (10000,)]
    res = run_threads([lambda r=r: ops[r].benchmark(shapes, num_trials=3) for r in range(2)])
    for per_rank in res:
        assert set(per_rank) == {(1000,), (10000,)}
        for t in per_rank.values():
            assert 0 < t["min_s"] <= t["mean_s"] <= t["max_s"] and t["busbw_GBps"] > 0
