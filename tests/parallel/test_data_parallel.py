"""DataParallel: parity with a single process on the global batch, buckets, no_sync, unused params."""

from __future__ import annotations

import pytest
import torch

from meshtrain import comm
from meshtrain.parallel.data import DataParallel, NaiveDataParallel

from .._accelerator import as_accelerator, device_check_threads
from ._models import assert_close_state, batches, loss_fn, make_model, make_opt, reference, shard

STEPS, BATCH = 5, 24


def _train(rank, world, wrapper, opt="adamw", micro=1, set_to_none=True, unused=False, **kw):
    model = make_model(seed=rank + 100, unused=unused)  # different init per rank: the wrap must broadcast
    dp = wrapper(model, **kw)
    o = make_opt(model.parameters(), opt)
    for x, y in batches(STEPS, BATCH):
        xs, ys = shard(x, rank, world), shard(y, rank, world)
        o.zero_grad(set_to_none=set_to_none)
        for m, (xm, ym) in enumerate(zip(xs.chunk(micro), ys.chunk(micro))):
            last = m == micro - 1
            ctx = dp.no_sync() if (not last and hasattr(dp, "no_sync")) else _nullctx()
            with ctx:
                (loss_fn(dp, xm, ym) / micro).backward()
        if isinstance(dp, NaiveDataParallel):
            dp.sync_gradients()
        o.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _ref(**kw):
    # the reference starts from rank 0's init, which the wrapper broadcasts
    return reference(STEPS, BATCH, seed=100, **kw)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_data_parallel_matches_single_process(world):
    want = _ref()
    got = comm.run_local(world, _train, world, DataParallel, timeout=60)
    for g in got:
        assert_close_state(g, want)


@pytest.mark.parametrize("cap", [1e-4, 0.003, 0.02])
def test_odd_bucket_caps_and_sgd(cap):
    want = _ref(opt="sgd")
    for g in comm.run_local(2, _train, 2, DataParallel, "sgd", bucket_cap_mb=cap, timeout=60):
        assert_close_state(g, want)


def test_tiny_buckets_split_the_model_and_overlap_backward():
    def fn(rank):
        model = make_model()
        dp = DataParallel(model, bucket_cap_mb=0.003)
        launched_during_backward = []
        orig = dp._launch_ready

        def spy():
            before = dp._next
            orig()
            if dp._next > before and dp._armed:
                launched_during_backward.append(dp._next)
        dp._launch_ready = spy
        x, y = batches(1, 8)[0]
        loss_fn(dp, x, y).backward()
        return len(dp.buckets), launched_during_backward

    for n, launched in comm.run_local(2, fn, timeout=30):
        assert n >= 3
        assert launched, "no bucket was launched before the end of backward"


def test_grads_are_bucket_views():
    def fn(rank):
        model = make_model()
        dp = DataParallel(model, bucket_cap_mb=0.003)
        x, y = batches(1, 8)[0]
        loss_fn(dp, x, y).backward()
        ptrs = {b.buffer.untyped_storage().data_ptr() for b in dp.buckets}
        return all(p.grad.untyped_storage().data_ptr() in ptrs for p in model.parameters())

    assert comm.run_local(2, fn, timeout=30) == [True, True]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_accumulation_with_no_sync(set_to_none):
    want = _ref(micro=4)
    for g in comm.run_local(2, _train, 2, DataParallel, "adamw", 4, set_to_none, timeout=60):
        assert_close_state(g, want)


def test_unused_parameters_found_or_named():
    want = _ref(unused=True)
    for g in comm.run_local(2, _train, 2, DataParallel, "adamw", 1, True, True,
                            find_unused_parameters=True, timeout=60):
        assert_close_state(g, want)
    with pytest.raises(RuntimeError, match=r"dead\.(weight|bias).*find_unused_parameters=True"):
        comm.run_local(2, _train, 2, DataParallel, "adamw", 1, True, True, timeout=20)


def test_naive_reference_matches_too():
    want = _ref()
    for g in comm.run_local(3, _train, 3, NaiveDataParallel, timeout=60):
        assert_close_state(g, want)


def test_buffers_are_broadcast_from_rank_0():
    def fn(rank):
        model = make_model(seed=rank)
        model.shift.fill_(float(rank))
        dp = DataParallel(model)
        model.shift.fill_(float(rank) + 5)  # drift: forward re-syncs
        dp(torch.zeros(2, 11))
        return model.shift[0].item(), model.inp.weight.sum().item()

    out = comm.run_local(3, fn, timeout=30)
    assert [o[0] for o in out] == [5.0, 5.0, 5.0]
    assert len({o[1] for o in out}) == 1


def test_bad_bucket_cap_is_named():
    def fn(rank):
        DataParallel(make_model(), bucket_cap_mb=0)

    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        comm.run_local(1, fn, timeout=10)


def test_a_dropped_wrapper_is_freed_with_its_worker_thread():
    """The gradient hooks hold the wrapper weakly: one that goes out of scope takes its buckets and
    its reduction thread with it (they once stayed for the life of the process)."""
    import gc
    import weakref

    def run(rank: int):
        dp = DataParallel(torch.nn.Linear(4, 4))
        dp(torch.ones(2, 4)).sum().backward()
        return weakref.ref(dp), dp._worker._threads.copy()

    (ref, threads), = comm.run_local(1, run)
    gc.collect()
    assert ref() is None, "the DataParallel wrapper is still referenced"
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads) and threads, threads


def test_a_device_step_reduces_its_buckets_from_the_worker_thread(monkeypatch):
    """Through the accelerator double (tests/_accelerator.py): the buckets' all-reduces (and the
    unused-parameter flags') take comm's device check on DataParallel's worker thread, which has no
    communicator; on a GPU that check asked the thread's and failed (issue 32)."""
    as_accelerator(monkeypatch)
    threads = device_check_threads(monkeypatch)
    want = _ref(unused=True)
    for g in comm.run_local(2, _train, 2, DataParallel, unused=True, find_unused_parameters=True,
                            bucket_cap_mb=0.003, timeout=60):
        assert_close_state(g, want)
    assert any(t.startswith("meshtrain-dp") for t in threads), sorted(set(threads))
