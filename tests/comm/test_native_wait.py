"""How meshtrain waits for torch.distributed's own ops (``algorithms/native.py``): CPU ops are
issued asynchronously and looked at, yielding the core, before torch's blocking wait; NCCL's
(stream-ordered) ops and gloo's reduce-scatter (no future) are called as torch would be."""

from __future__ import annotations

import time

import pytest
import torch

from meshtrain.comm.algorithms import native

pytestmark = pytest.mark.timeout(30)


class FakeWork:
    """A work that completes after ``looks`` calls of is_completed (never if None)."""

    def __init__(self, looks: int | None) -> None:
        self.looks, self.seen, self.waited = looks, 0, 0

    def is_completed(self) -> bool:
        self.seen += 1
        return self.looks is not None and self.seen > self.looks

    def wait(self) -> bool:
        self.waited += 1
        return True


class FakeOp:
    """Stands for a torch.distributed op: records how it was called, returns a FakeWork if async."""

    def __init__(self, looks: int | None = 3) -> None:
        self.calls: list[dict] = []
        self.work = FakeWork(looks)

    def __call__(self, *args, **kw):
        self.calls.append(kw)
        return self.work if kw.get("async_op") else None


def test_a_cpu_op_is_issued_async_looked_at_then_waited_for(monkeypatch):
    monkeypatch.setattr(native, "POLL_S", 30.0)  # a loaded machine's yields must not end the looks early
    monkeypatch.setattr(native, "POLL_SMALL_S", 30.0)
    op = FakeOp(looks=3)
    native._run(op, torch.ones(4), group=None)
    assert op.calls == [{"async_op": True, "group": None}]
    assert op.work.seen == 4 and op.work.waited == 1  # three looks before it completed, one wait after


def test_a_list_of_cpu_tensors_counts_as_cpu():
    op = FakeOp(looks=0)
    native._run(op, [torch.ones(2), torch.ones(2)], torch.ones(2))
    assert op.calls[0].get("async_op") is True and op.work.waited == 1


def test_an_op_off_the_cpu_is_called_as_torch_calls_it():
    # NCCL's ops are ordered on the CUDA stream: waiting for one on the host would stall the caller.
    op = FakeOp()
    native._run(op, torch.empty(4, device="meta"))
    assert op.calls == [{}] and op.work.seen == 0


def test_an_op_without_a_future_is_called_as_torch_calls_it():
    # gloo's reduce-scatter completes only inside wait(): looking at it would only burn POLL_S.
    assert native.dist.reduce_scatter in native.NO_FUTURE
    seen: list[dict] = []

    def reduce_scatter(*args, **kw):
        seen.append(kw)

    native.NO_FUTURE = native.NO_FUTURE | {reduce_scatter}
    try:
        native._run(reduce_scatter, torch.ones(4))
    finally:
        native.NO_FUTURE = native.NO_FUTURE - {reduce_scatter}
    assert seen == [{}]


def test_a_long_op_is_looked_at_for_poll_s_then_left_to_torchs_wait():
    work = FakeWork(looks=None)
    t0 = time.monotonic()
    assert native.polled(work) is False
    assert time.monotonic() - t0 >= native.POLL_S and work.seen >= 1
    native.finish(work)
    assert work.waited == 1


def test_with_a_core_per_rank_a_small_op_is_looked_at_longer(monkeypatch):
    """Ranks fitting the cores: an op below POLL_SMALL_MAX_BYTES is looked at for POLL_SMALL_S (it
    ends within it, and parking sooner let the core idle into a slow wake-up); a larger one for
    POLL_S; on a crowded host a small one for POLL_S too."""
    monkeypatch.setattr(native, "POLL_S", 0.02)
    monkeypatch.setattr(native, "POLL_SMALL_S", 0.5)
    monkeypatch.setattr(native, "_crowded", [False])

    def looked(nbytes: int) -> float:
        t0 = time.monotonic()
        assert native.polled(FakeWork(looks=None), nbytes) is False
        return time.monotonic() - t0

    assert looked(native.POLL_SMALL_MAX_BYTES - 1) >= 0.5
    assert 0.02 <= looked(native.POLL_SMALL_MAX_BYTES) < 0.5
    native.crowded(10_000)
    assert 0.02 <= looked(1024) < 0.5


def test_on_a_crowded_host_a_large_op_is_looked_at_once_and_a_small_one_still_polled(monkeypatch):
    """More ranks on the host than cores: an op of LOOK_MAX_BYTES or more is looked at once and
    left to torch's wait (its looks would take the core from the ranks it waits for); a smaller
    op is still looked at for POLL_S. With the ranks fitting the cores, every op is polled."""
    monkeypatch.setattr(native, "POLL_S", 0.05)
    monkeypatch.setattr(native, "_crowded", [False])
    native.crowded(10_000)  # more ranks than any machine running this has cores
    assert native._crowded == [True]
    big = FakeWork(looks=None)
    assert native.polled(big, native.LOOK_MAX_BYTES) is False and big.seen == 1
    small = FakeWork(looks=None)
    t0 = time.monotonic()
    assert native.polled(small, native.LOOK_MAX_BYTES - 1) is False
    assert time.monotonic() - t0 >= native.POLL_S and small.seen > 1
    native.crowded(1)
    assert native._crowded == [False]
    big = FakeWork(looks=None)
    assert native.polled(big, native.LOOK_MAX_BYTES) is False and big.seen > 1
    # _run hands the op's size on: a 1 MiB fp32 buffer on a crowded host gets one look
    native.crowded(10_000)
    op = FakeOp(looks=None)
    native._run(op, torch.ones(native.LOOK_MAX_BYTES // 4))
    assert op.work.seen == 1 and op.work.waited == 1


# -- looking or parking, learned per size from the calls (algorithms/native_wait.py) --------------------------------

from meshtrain.comm.algorithms import native_wait  # noqa: E402

EXPLORING = native_wait.ROUNDS * 2 * native_wait.BLOCK


class Clock:
    """A clock the test moves: each simulated call takes what the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(native_wait, "clock", c)
    native_wait.reset("learn")
    yield c
    native_wait.reset("learn")


def _calls(clock: Clock, n: int, seconds, nbytes: int = 4096) -> list[native_wait.Call]:
    """``n`` calls of ``nbytes``, each taking ``seconds(call, i)``; returns their decisions."""
    made = []
    for i in range(n):
        call = native_wait.begin(nbytes)
        clock.now += seconds(call, i)
        native_wait.record(call)
        made.append(call)
    return made


def test_the_faster_mode_is_kept_and_the_first_call_of_each_block_is_not_counted(clock):
    # parking is twice as fast, but the first parked call of each block (the switch) takes 100 s
    def seconds(call, i):
        return 1.0 if call.look else (100.0 if i % native_wait.BLOCK == 0 else 0.5)

    made = _calls(clock, EXPLORING + 1, seconds)
    assert [c.look for c in made[:EXPLORING]] == [
        (i // native_wait.BLOCK) % 2 == 0 for i in range(EXPLORING)]  # look first, blocks alternating
    assert native_wait.kept(4096) is False and made[-1].look is False and not made[-1].counted
    assert native_wait.kept(1 << 20) is None  # another size class learns on its own


def test_looking_stays_unless_parking_wins_by_more_than_prior(clock):
    _calls(clock, EXPLORING + 1, lambda call, i: 1.0 if call.look else 1.0 / (1 + native_wait.PRIOR / 2))
    assert native_wait.kept(4096) is True


def test_the_schedule_depends_on_the_calls_alone_so_members_switch_together(clock):
    a = [c.look for c in _calls(clock, EXPLORING, lambda call, i: 1.0 if call.look else 0.1)]
    native_wait.reset("learn")
    b = [c.look for c in _calls(clock, EXPLORING, lambda call, i: 0.1 if call.look else 7.0)]
    assert a == b


def test_a_kept_mode_is_explored_again_after_recheck_calls(clock):
    _calls(clock, EXPLORING + 1, lambda call, i: 1.0 if call.look else 0.5)
    assert native_wait.kept(4096) is False
    kept = _calls(clock, native_wait.RECHECK, lambda call, i: 0.5)
    assert all(not c.look and not c.counted for c in kept)
    # the host changed: looking is now the faster
    _calls(clock, EXPLORING + 1, lambda call, i: 0.5 if call.look else 1.0)
    assert native_wait.kept(4096) is True


def test_a_fixed_mode_never_explores():
    try:
        for setting, look in (("park", False), ("look", True)):
            native_wait.reset(setting)
            calls = [native_wait.begin(4096) for _ in range(EXPLORING + 1)]
            assert all(c.look is look and not c.counted for c in calls)
            assert native_wait.kept(4096) is None
    finally:
        native_wait.reset("learn")


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("MESHTRAIN_NATIVE_WAIT", "fast")
    with pytest.raises(ValueError, match=r"MESHTRAIN_NATIVE_WAIT='fast'.*learn.*look.*park"):
        native.crowded(1)  # what comm.init calls
    monkeypatch.setenv("MESHTRAIN_NATIVE_WAIT", "park")
    native.crowded(1)
    assert not native_wait.begin(4096).look
    monkeypatch.delenv("MESHTRAIN_NATIVE_WAIT")
    native.crowded(1)


def test_run_parks_once_parking_measured_faster(monkeypatch, clock):
    """Through ``_run``: a parked call is looked at once, then left to torch's wait."""
    monkeypatch.setattr(native, "POLL_S", 0.002)
    monkeypatch.setattr(native, "POLL_SMALL_S", 0.002)

    class TimedWork(FakeWork):
        def wait(self) -> bool:  # the op's time as the learner's clock sees it
            clock.now += 1.0 if native._local.look else 0.5
            return super().wait()

    for _ in range(EXPLORING + 1):
        op = FakeOp(looks=None)
        op.work = TimedWork(looks=None)
        native._run(op, torch.ones(16))
    assert native_wait.kept(64) is False
    op = FakeOp(looks=None)
    native._run(op, torch.ones(16))
    assert op.work.seen == 1 and op.work.waited == 1


def test_parking_is_kept_only_if_it_wins_every_round(clock):
    """One round where parking looks faster (a noisy moment) does not make the process park."""
    half = native_wait.BLOCK * 2  # the calls of one round: a block looking, then a block parking

    def first_round_only(call, i):
        return 1.0 if call.look or i >= half else 0.5

    _calls(clock, EXPLORING + 1, first_round_only)
    assert native_wait.kept(4096) is True
    native_wait.reset("learn")
    _calls(clock, EXPLORING + 1, lambda call, i: 1.0 if call.look or i < half else 0.5)  # the second only
    assert native_wait.kept(4096) is True
    native_wait.reset("learn")
    # by a mean alone these would park: 0.2 a call in one round outweighs 1.1 in the other
    _calls(clock, EXPLORING + 1, lambda call, i: 1.0 if call.look else (0.2 if i < half else 1.1))
    assert native_wait.kept(4096) is True
    native_wait.reset("learn")
    _calls(clock, EXPLORING + 1, lambda call, i: 1.0 if call.look else (0.4 if i < half else 0.9))
    assert native_wait.kept(4096) is False  # faster by more than PRIOR in both rounds


def test_an_ops_future_is_asked_of_its_first_work_only():
    """A guarded wait is told whether the op's works have a future (gloo's reduce-scatter's have
    none and complete only inside ``wait``): asked of each op's first work, then remembered."""
    asked = []

    class Work:
        def __init__(self, has: bool) -> None:
            self.has = has

        def get_future(self) -> None:
            asked.append(self.has)
            if not self.has:
                raise RuntimeError("this work has no future")

    with_future, without = object(), object()  # two torch ops, as _run keys them
    try:
        assert native._future_of(with_future, Work(True)) is True
        assert native._future_of(with_future, Work(False)) is True  # remembered, not asked again
        assert native._future_of(without, Work(False)) is False
        assert asked == [True, False]
        assert native.has_future(Work(False)) is False and native.has_future(Work(False), True) is True
    finally:
        native._FUTURES.pop(with_future, None)
        native._FUTURES.pop(without, None)
