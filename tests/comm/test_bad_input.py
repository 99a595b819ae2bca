"""Every bad input raises a clear error within seconds: mismatches, missing ranks, invalid args."""

from __future__ import annotations

import time

import pytest
import torch

import meshtrain.comm as mc
from meshtrain.errors import CollectiveMismatch, CollectiveTimeout


def _raises(p, fn, exc, timeout=2.0, **kw):
    t0 = time.monotonic()
    with pytest.raises(exc) as info:
        mc.run_local(p, fn, timeout=timeout, **kw)
    elapsed = time.monotonic() - t0
    assert elapsed < timeout + 3, f"took {elapsed:.1f}s"
    return str(info.value), elapsed


def test_shape_mismatch_names_op_ranks_and_shapes():
    msg, elapsed = _raises(3, lambda r: mc.all_reduce(torch.ones(4 if r != 2 else 5), algorithm="ring"),
                           CollectiveMismatch)
    assert "all_reduce #1" in msg and "ranks [0, 1]" in msg and "ranks [2]" in msg
    assert "[[4]]" in msg and "[[5]]" in msg
    assert elapsed < 1.5  # detected up front, not by a timeout


def test_dtype_mismatch():
    msg, _ = _raises(2, lambda r: mc.broadcast(torch.ones(3, dtype=torch.float32 if r else torch.float64), 0),
                     CollectiveMismatch)
    assert "float32" in msg and "float64" in msg and "broadcast" in msg


def test_different_ops_at_the_same_point():
    def fn(rank):
        t = torch.ones(3)
        mc.all_reduce(t) if rank == 0 else mc.broadcast(t, 0)

    msg, _ = _raises(2, fn, CollectiveMismatch)
    assert "all_reduce" in msg and "broadcast" in msg


def test_all_to_all_inconsistent_pairwise_sizes():
    def fn(rank):
        ins = [torch.ones(2), torch.ones(2)]
        outs = [torch.empty(2), torch.empty(3 if rank == 1 else 2)]
        mc.all_to_all(outs, ins)

    msg, _ = _raises(2, fn, CollectiveMismatch)
    assert "sends 2 elements to rank 1, which expects 3" in msg


def test_missing_rank_is_named_with_op_and_sequence_number():
    def fn(rank):
        mc.all_reduce(torch.ones(2))
        if rank != 2:
            mc.all_reduce(torch.ones(2), algorithm="ring")
        else:
            time.sleep(3)  # rank 2 is "stuck elsewhere"

    msg, elapsed = _raises(3, fn, CollectiveTimeout, timeout=1.0)
    assert "all_reduce #2" in msg and "[2] never called it" in msg
    assert elapsed < 4


def test_missing_rank_without_check_names_the_silent_peer():
    def fn(rank):
        if rank == 0:
            mc.broadcast(torch.ones(2), 1, algorithm="direct")

    msg, _ = _raises(2, fn, CollectiveTimeout, timeout=1.0, check=False)
    assert "broadcast #1" in msg and "[1]" in msg


def test_p2p_size_mismatch_is_caught_even_without_check():
    def fn(rank):
        if rank == 0:
            mc.send(torch.ones(3), 1)
        else:
            mc.recv(torch.empty(4), 0)

    msg, _ = _raises(2, fn, CollectiveMismatch, check=False)
    assert "sent 3 elements" in msg and "expected 4" in msg


@pytest.mark.parametrize("call, needle", [
    (lambda: mc.broadcast(torch.ones(1), 5), "one of [0, 1]"),
    (lambda: mc.reduce(torch.ones(1), -1), "one of [0, 1]"),
    (lambda: mc.gather(torch.ones(1), None, dst=2), "one of [0, 1]"),
    (lambda: mc.all_reduce(torch.ones(1), op="median"), "'sum', 'avg', 'max', 'min', 'prod'"),
    (lambda: mc.all_reduce(torch.ones(1, dtype=torch.int32), op="avg"), "not defined for integer"),
    (lambda: mc.all_reduce(torch.ones(1), algorithm="magic"), "use one of"),
    (lambda: mc.all_reduce(torch.ones(1), algorithm="native"), "needs the torch transport"),
    (lambda: mc.all_reduce(torch.ones(1, dtype=torch.uint16)), "not supported"),
    (lambda: mc.all_reduce(torch.ones(1, dtype=torch.complex64), op="max"), "not defined on complex"),
    (lambda: mc.all_reduce(torch.ones(1), op="band"), "bitwise and not defined for float32"),
    (lambda: mc.all_gather([torch.ones(1)], torch.ones(1)), "list of 2 tensors"),
    (lambda: mc.all_reduce(torch.ones(1), group="world"), "new_group"),
    (lambda: mc.new_group([0, 0]), "distinct ranks in 0..1"),
    (lambda: mc.new_group([0, 7]), "out of range"),
    (lambda: mc.send(torch.ones(1), 3), "one of [0, 1]"),
    (lambda: mc.reduce_scatter_tensor(torch.empty(3), torch.ones(5)), "2 x 3 = 6"),
])
def test_invalid_arguments_raise_valueerror_with_valid_range(call, needle):
    def fn(rank):
        call()

    with pytest.raises((ValueError, TypeError)) as info:
        mc.run_local(2, fn, timeout=2)
    assert needle in str(info.value)


def test_non_member_calling_group_collective():
    def fn(rank):
        g = mc.new_group([1, 2])
        if rank == 0:
            mc.all_reduce(torch.ones(1), group=g)

    with pytest.raises(ValueError, match="not a member"):
        mc.run_local(3, fn, timeout=2)


def test_work_wait_timeout_raises():
    def fn(rank):
        if rank == 0:
            w = mc.irecv(torch.empty(1), 1, tag=9)
            w.wait(timeout=0.3)

    with pytest.raises(CollectiveTimeout):
        mc.run_local(2, fn, timeout=5)


def test_no_communicator_bound():
    with pytest.raises(RuntimeError, match="init\\(\\).*run_local"):
        mc.all_reduce(torch.ones(1))


def test_failure_on_one_rank_wakes_the_others_fast():
    def fn(rank):
        if rank == 1:
            raise KeyError("boom")
        mc.all_reduce(torch.ones(2))  # would wait for rank 1 until the timeout

    t0 = time.monotonic()
    with pytest.raises(KeyError, match="rank 1"):
        mc.run_local(3, fn, timeout=30)
    assert time.monotonic() - t0 < 5
