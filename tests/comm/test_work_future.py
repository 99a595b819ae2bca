"""Work.wait(timeout) and Work.get_future() with torch's semantics, all_to_all_single's checks, and
the errors for reduce ops a dtype has no meaning for (ranks as threads)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

import meshtrain.comm as mc
from meshtrain.comm.types import UnsupportedReduction

pytestmark = pytest.mark.timeout(60)


def test_wait_timeout_raises_and_the_operation_goes_on():
    """Past wait(timeout) a RuntimeError (CollectiveTimeout) names the wait; a later wait() gets
    the finished result, because the collective itself runs to its group deadline."""
    def fn(rank):
        t = torch.full((3,), float(rank + 1))
        if rank == 1:
            time.sleep(0.8)
        work = mc.all_reduce(t, async_op=True)
        if rank == 0:
            with pytest.raises(RuntimeError, match=r"did not complete within 0.2s of wait\(\)") as info:
                work.wait(timeout=datetime.timedelta(seconds=0.2))
            assert isinstance(info.value, mc.CollectiveTimeout)
        assert work.wait() is True
        return t

    for t in mc.run_local(2, fn, timeout=20):
        assert torch.equal(t, torch.full((3,), 3.0))


def test_a_zero_timedelta_means_no_timeout_and_a_bad_type_is_a_typeerror():
    def fn(rank):
        if rank == 1:
            time.sleep(0.3)
        work = mc.all_reduce(torch.ones(2), async_op=True)
        if rank == 0:
            with pytest.raises(TypeError, match="seconds or a datetime.timedelta"):
                work.wait(timeout="1s")
        return work.wait(timeout=datetime.timedelta(0))  # torch's default: no timeout

    assert mc.run_local(2, fn, timeout=20) == [True, True]


def test_a_failed_operation_fails_its_future_and_its_then_chain():
    def fn(rank):
        work = mc.all_reduce(torch.ones(2 + rank), async_op=True)  # shapes differ: a mismatch
        fut = work.get_future()
        chained = fut.then(lambda f: f.value())
        with pytest.raises(mc.CollectiveMismatch, match="ranks disagree"):
            fut.wait()
        with pytest.raises(RuntimeError, match="CollectiveMismatch"):  # torch wraps a callback's error
            chained.wait()
        assert fut.done() and work.get_future() is fut
        return True

    assert mc.run_local(2, fn, timeout=20) == [True, True]


def test_a_receive_future_completes_when_waited_on():
    """A receive on the thread transport finishes when driven; the future's wait() drives it."""
    def fn(rank):
        if rank == 0:
            fut = mc.isend(torch.arange(4.0), 1).get_future()
        else:
            fut = mc.irecv(torch.empty(4), 0).get_future()
        return fut.wait()

    sent, got = mc.run_local(2, fn, timeout=20)
    assert torch.equal(sent[0], torch.arange(4.0)) and torch.equal(got[0], torch.arange(4.0))


@pytest.mark.parametrize("call, exc, needle", [
    (lambda: mc.all_to_all_single(torch.empty(3), torch.ones(4)), ValueError,
     "output has 3 rows (dim 0), which do not split into 2 equal parts (the group size): pad it or pass "
     "output_split_sizes"),
    (lambda: mc.all_to_all_single(torch.empty(4), torch.ones(4), [4], [4]), RuntimeError,
     "output_split_sizes has 1 entries; it needs one per rank of the group (2)"),
    (lambda: mc.all_to_all_single(torch.empty(4), torch.ones(4), None, [5, -1]), RuntimeError,
     "input_split_sizes [5, -1] must be non-negative and add up to the 4 rows"),
    (lambda: mc.all_to_all_single(torch.empty(4, dtype=torch.int8), torch.ones(4)), ValueError,
     "output is torch.int8 but input is torch.float32"),
    (lambda: mc.all_to_all_single(torch.empty(4), [1.0] * 4), TypeError, "input must be a torch.Tensor"),
])
def test_all_to_all_single_bad_arguments_name_the_problem(call, exc, needle):
    with pytest.raises(exc) as info:
        mc.run_local(2, lambda rank: call(), timeout=5)
    assert needle in str(info.value)


def test_all_to_all_single_pairwise_sizes_are_checked():
    """Rank 0 cuts its input [1, 3] where every rank expects 2 rows from each: a mismatch naming
    the sender, the receiver and both sizes, not a hang."""
    def fn(rank):
        mc.all_to_all_single(torch.empty(4), torch.ones(4), [2, 2], [1, 3] if rank == 0 else [2, 2])

    with pytest.raises(mc.CollectiveMismatch, match="rank 0 sends 1 elements to rank 0, which expects 2"):
        mc.run_local(2, fn, timeout=10)


@pytest.mark.parametrize("dtype, op, needle", [
    (torch.float32, "band", "op='band' (ReduceOp.BAND) is bitwise and not defined for float32: use it on an "
                            "integer or bool tensor"),
    (torch.bfloat16, mc.ReduceOp.BXOR, "bitwise and not defined for bfloat16"),
    (torch.bool, "avg", "op='avg' is not defined for integer or bool dtype torch.bool: use op='sum' and divide"),
    (torch.complex128, "min", "op='min' is not defined on complex tensors (complex128), as in torch.distributed: "
                              "use 'sum' or 'avg'"),
    (torch.complex64, mc.ReduceOp.PRODUCT, "op='prod' is not defined on complex tensors"),
])
def test_a_reduce_op_the_dtype_has_no_meaning_for_is_named(dtype, op, needle):
    """Raised before any communication, on every rank; both a ValueError and torch's RuntimeError."""
    def fn(rank):
        with pytest.raises(UnsupportedReduction) as info:
            mc.all_reduce(torch.ones(2, dtype=dtype), op=op)
        assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
        assert needle in str(info.value)
        t = torch.ones(2)  # the group goes on
        mc.all_reduce(t)
        return t

    assert all(torch.equal(t, torch.full((2,), 2.0)) for t in mc.run_local(2, fn, timeout=10))


def test_torch_reduce_ops_and_product_alias_map():
    import torch.distributed as tdist

    assert mc.ReduceOp.PRODUCT is mc.ReduceOp.PROD
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        assert mc.types.parse_op(getattr(tdist.ReduceOp, name)) is getattr(mc.ReduceOp, name)


def test_a_works_latch_wakes_every_waiter_and_times_out_unset():
    """Work's completion latch (one lock, not an Event): unset, a wait with a timeout returns False
    after it; set from another thread, every waiter wakes, and later waits return at once."""
    import threading

    from meshtrain.comm.work import _Latch

    latch = _Latch()
    t0 = time.monotonic()
    assert latch.wait(0.05) is False and not latch.is_set()
    assert time.monotonic() - t0 >= 0.04
    woke: list[bool] = []
    waiters = [threading.Thread(target=lambda: woke.append(latch.wait(10))) for _ in range(3)]
    for w in waiters:
        w.start()
    time.sleep(0.05)
    threading.Thread(target=latch.set).start()
    for w in waiters:
        w.join(5)
    assert woke == [True, True, True]
    latch.set()  # a second set is harmless
    assert latch.wait() is True and latch.wait(0) is True and latch.is_set()
