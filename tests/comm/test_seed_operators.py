"""The seed API's four usage examples (and its communicator) give the right results."""

import threading
import time

import pytest
import torch

import meshtrain.comm as mc
from meshtrain.comm.operators import (AllGatherOperator, AllReduceOperator, BroadcastOperator,
                                      DistributedCommunicator, ReduceScatterOperator,
                                      create_ring_topology, run_threads)

W = 4
pytestmark = pytest.mark.timeout(60)

# The seed module's four usage examples, verbatim (comments translated): one thread calls every
# rank's operator in a for loop. Examples 2-4 use example 1's ``communicators`` and ``world_size``.
SEED_EXAMPLES = {
    "all_reduce": """
# create the distributed environment
world_size = 4
communicators = create_ring_topology(world_size)
all_reduce_ops = [AllReduceOperator(comm) for comm in communicators]

# each process's gradients
gradients = [torch.randn(1000) for _ in range(world_size)]

# synchronise the gradients
synchronized_grads = []
for i, op in enumerate(all_reduce_ops):
    result = op.all_reduce(gradients[i])
    synchronized_grads.append(result)
""",
    "broadcast": """
# broadcast the model parameters
broadcast_ops = [BroadcastOperator(comm) for comm in communicators]

# the root process has the parameters, the others are empty
params = torch.randn(1000)
broadcast_data = [params if i == 0 else torch.zeros(1000) for i in range(world_size)]

# broadcast the parameters
broadcasted_params = []
for i, op in enumerate(broadcast_ops):
    result = op.broadcast(broadcast_data[i], root_rank=0)
    broadcasted_params.append(result)
""",
    "all_gather": """
# gather every process's statistics
all_gather_ops = [AllGatherOperator(comm) for comm in communicators]

# each process's local statistics
local_stats = [torch.randn(100) for _ in range(world_size)]

# gather the global statistics
global_stats = []
for i, op in enumerate(all_gather_ops):
    result = op.all_gather(local_stats[i])
    global_stats.append(result)
""",
    "reduce_scatter": """
# scatter the computed results
reduce_scatter_ops = [ReduceScatterOperator(comm) for comm in communicators]

# each process's full data
full_data = [torch.randn(4000) for _ in range(world_size)]

# reduce and scatter
scattered_results = []
for i, op in enumerate(reduce_scatter_ops):
    result = op.reduce_scatter(full_data[i])
    scattered_results.append(result)
""",
}


def test_the_seed_examples_run_as_written_in_one_thread_well_under_a_second():
    ns = {"torch": torch, "create_ring_topology": create_ring_topology, "AllReduceOperator": AllReduceOperator,
          "BroadcastOperator": BroadcastOperator, "AllGatherOperator": AllGatherOperator,
          "ReduceScatterOperator": ReduceScatterOperator}
    took = {}
    for name, code in SEED_EXAMPLES.items():
        t0 = time.perf_counter()
        exec(code, ns)  # noqa: S102 - the seed's own text
        took[name] = time.perf_counter() - t0
    assert all(t < 1.0 for t in took.values()), took
    total = torch.stack(ns["gradients"]).sum(0)
    for got in ns["synchronized_grads"]:
        torch.testing.assert_close(got, total)
    assert all(torch.equal(b, ns["params"]) for b in ns["broadcasted_params"])
    assert all(torch.equal(g, torch.cat(ns["local_stats"])) for g in ns["global_stats"])
    full = torch.stack(ns["full_data"]).sum(0)
    for r, got in enumerate(ns["scattered_results"]):
        torch.testing.assert_close(got, full[r * 1000 : (r + 1) * 1000])
    # the seed's benchmark, called on one operator from the same thread, times whole collectives
    res = ns["all_reduce_ops"][0].benchmark([(1000,), (10000,)], num_trials=3)
    assert set(res) == {(1000,), (10000,)} and all(v["min_s"] > 0 for v in res.values())


def test_one_thread_per_rank_blocks_until_its_result_is_complete():
    """Each call returns only when the collective is done: the result is right at return."""
    ops = [AllReduceOperator(c) for c in create_ring_topology(W)]
    grads = [torch.randn(5000) for _ in range(W)]
    want = torch.stack(grads).sum(0)

    def rank(r):
        if r == 0:
            time.sleep(0.2)  # the others must wait for rank 0, not return early
        out = ops[r].all_reduce(grads[r])
        torch.testing.assert_close(out, want)  # checked on the calling thread, at return
        return threading.get_ident()

    idents = run_threads([lambda r=r: rank(r) for r in range(W)])
    assert len(set(idents)) == W


def test_a_bad_call_in_the_loop_fails_at_once_and_ends_the_open_collective():
    """Rank 0's all_reduce is open when rank 1's call fails its checks: the topology is aborted,
    so rank 0's part fails now (seen by the next call) instead of waiting out the timeout."""
    comms = create_ring_topology(2, timeout=30)
    AllReduceOperator(comms[0]).all_reduce(torch.ones(4))
    with pytest.raises(ValueError, match="divisible by the world size 2"):
        ReduceScatterOperator(comms[1]).reduce_scatter(torch.ones(3))
    t0 = time.perf_counter()
    with pytest.raises(mc.CollectiveError, match="aborted: rank 1's call failed: ValueError"):
        AllReduceOperator(comms[1]).all_reduce(torch.ones(4))
    assert time.perf_counter() - t0 < 5


def test_the_first_auto_call_runs_no_hidden_collective():
    """A rank whose first call is auto and one whose first call names its algorithm meet in the
    metadata check (a CollectiveMismatch naming both), not in a calibration exchange that only
    one of them runs (which timed out naming a 'cal/...' key)."""
    def fn(rank):
        mc.all_reduce(torch.ones(8), algorithm=["auto", "ring", "tree"][rank])

    t0 = time.perf_counter()
    with pytest.raises(mc.CollectiveMismatch, match="algorithm="):
        mc.run_local(3, fn, timeout=20)
    assert time.perf_counter() - t0 < 10


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


def test_where_auto_still_calibrates_implicitly_a_missing_member_is_named():
    """Process transports still fit the model on the first auto call that needs it; a member that
    does not join gets a CollectiveTimeout naming it and the ways out, not a bare 'cal/...' wait."""
    from meshtrain.comm import select

    def fn(rank):
        if rank == 0:
            select._implicit_calibration(mc.current().world, "gather")

    with pytest.raises(mc.CollectiveTimeout, match=r"gather with algorithm='auto' on group 0 .*rank\(s\) \[1\] did "
                                                   r"not join.*meshtrain.comm.calibrate\(group\)"):
        mc.run_local(2, fn, timeout=0.5)


def test_exit_does_not_wait_for_a_collective_the_loop_left_open():
    """Calling only rank 0 leaves the others' parts open; the interpreter still exits at once
    (they are aborted before its worker threads are joined), not after the 30 s timeout."""
    import subprocess
    import sys

    code = ("import torch\nfrom meshtrain.comm.operators import AllReduceOperator, create_ring_topology\n"
            "ops = [AllReduceOperator(c) for c in create_ring_topology(4, timeout=30)]\n"
            "ops[0].all_reduce(torch.ones(3))\nprint('returned')\n")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and done.stdout.strip() == "returned", done.stderr
    assert time.perf_counter() - t0 < 25
