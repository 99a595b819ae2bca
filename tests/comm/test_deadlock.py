"""A deadlock is named in seconds, not after the timeout (comm/deadlock.py): ranks that called
collectives in different orders fail within 10 s, whatever the collective timeout, with every
rank's call in the message; a slow step is never named. The rule on hand-built states, the
heartbeats' part on a real TCPStore, then crossed orders on threads (run_local) and shm processes."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import meshtrain.comm as mc
from meshtrain.comm.deadlock import Call, WaitState, find
from meshtrain.comm.launch import spawn
from meshtrain.comm.liveness import LivenessMonitor
from meshtrain.errors import CollectiveDeadlock, CollectiveError

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 300.0  # the collective timeout: a deadlock must be named long before it


def _state(*calls: tuple[int, list[int], int, str], issued: dict[int, int], idle: float = 8.0,
           blocked: bool = True) -> WaitState:
    return WaitState(tuple(Call(g, tuple(rs), s, op, idle) for g, rs, s, op in calls), issued, idle, blocked)


# -- the rule --------------------------------------------------------------------------------------
def test_a_cycle_of_blocked_ranks_is_named_with_every_call():
    """The brief's case: rank 0 in all_to_all #30 on group 1 waits for rank 1, which is with ranks
    2-3 in all_reduce #12 on group 2, which rank 0 has not reached."""
    states = [
        _state((1, [0, 1], 30, "all_to_all"), issued={0: 4, 1: 30, 2: 11}),
        _state((2, [0, 1, 2, 3], 12, "all_reduce"), issued={0: 4, 1: 29, 2: 12}),
        _state((2, [0, 1, 2, 3], 12, "all_reduce"), issued={0: 4, 2: 12}),
        _state((2, [0, 1, 2, 3], 12, "all_reduce"), issued={0: 4, 2: 12}),
    ]
    msg = find(states, 5.0)
    assert msg is not None
    assert ("rank 0 is in all_to_all #30 on group 1 (ranks [0, 1]) for 8.0s, waiting for rank 1, which has "
            "issued 29 calls on that group") in msg
    assert "rank 1 is in all_reduce #12 on group 2 (ranks [0, 1, 2, 3]) for 8.0s, waiting for rank 0, which " \
           "has issued 11 calls on that group" in msg
    assert "rank 2 is in all_reduce #12" in msg and "rank 3 is in all_reduce #12" in msg
    assert "rank 0 -> rank 1 -> rank 0" in msg and "different orders" in msg and "same order" in msg


def test_what_is_not_a_deadlock():
    crossed = [_state((1, [0, 1], 1, "all_reduce"), issued={1: 1, 2: 0}),
               _state((2, [0, 1], 1, "all_reduce"), issued={1: 0, 2: 1})]
    assert find(crossed, 5.0) is not None
    # every member in the same slow call: each has reached it, no one waits for a call
    slow = [_state((1, [0, 1], 7, "all_reduce"), issued={1: 7}) for _ in range(2)]
    assert find(slow, 5.0) is None
    # a rank computing with nothing in flight (it will call later)
    computing = [crossed[0], WaitState((), {1: 0, 2: 0}, 8.0, False)]
    assert find(computing, 5.0) is None
    # a stall shorter than the bound, on any rank
    assert find([crossed[0], _state((2, [0, 1], 1, "all_reduce"), issued={1: 0, 2: 1}, idle=4.0)], 5.0) is None
    # only async calls in flight, no thread waiting for them: the rank may compute and issue more
    assert find([crossed[0], _state((2, [0, 1], 1, "all_reduce"), issued={1: 0, 2: 1}, blocked=False)], 5.0) is None
    # waiting for a rank that finished is no cycle (the timeout names it as never called)
    assert find([_state((1, [0, 1], 3, "all_reduce"), issued={1: 3}), None], 5.0) is None
    # the check is off
    assert find(crossed, 0.0) is None


def test_a_finished_rank_does_not_hide_a_cycle_and_states_travel_as_json():
    s0 = _state((1, [0, 1], 2, "broadcast"), (3, [0, 2], 5, "all_gather"), issued={1: 2, 3: 5})
    s1 = _state((2, [0, 1], 1, "all_reduce"), issued={1: 1, 2: 1})
    assert WaitState.decode(s0.encode()) == s0 and " " not in s0.encode()
    msg = find([s0, s1, None], 5.0)
    assert msg is not None and "rank 0 is in all_gather #5 on group 3 (ranks [0, 2]) for 8.0s (every member " \
                               "has reached it)" in msg


# -- the heartbeats ----------------------------------------------------------------------------------
@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    yield s
    del s


def _monitors(store, states: list[WaitState | None], prefix: str) -> list[LivenessMonitor]:
    def connect():
        return dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=3))

    ms = [LivenessMonitor(connect, r, len(states), prefix, period=0.05, stale=5.0, exit_process=False)
          for r in range(len(states))]
    for m, s in zip(ms, states):
        if s is not None:
            m.wait_state = lambda s=s: s
        m.announce()
    for m in ms:
        m.start([f"host{r}/boot" for r in range(len(states))])
    return ms


def _wait_lost(ms: list[LivenessMonitor], seconds: float) -> None:
    t0 = time.monotonic()
    while any(m.lost is None for m in ms) and time.monotonic() - t0 < seconds:
        time.sleep(0.02)


def test_heartbeats_carry_the_states_and_every_rank_stops_naming_the_calls(store, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_DEADLOCK_S", "5")
    ms = _monitors(store, [_state((1, [0, 1], 1, "all_reduce"), issued={1: 1, 2: 0}),
                           _state((2, [0, 1], 1, "all_reduce"), issued={1: 0, 2: 1})], "crossed")
    _wait_lost(ms, 5)
    for m in ms:
        assert isinstance(m.lost, CollectiveDeadlock), m.lost
        with pytest.raises(CollectiveDeadlock, match=r"rank 0 is in all_reduce #1 on group 1 .* rank 1 is in "
                                                      r"all_reduce #1 on group 2"):
            m.raise_if_lost()  # what the shm transport's waits raise
        m.stop()


def test_a_posted_deadlock_is_adopted_and_a_live_rank_without_a_state_vetoes(store, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_DEADLOCK_S", "5")
    crossed = [_state((1, [0, 1], 1, "all_reduce"), issued={1: 1, 2: 0}),
               _state((2, [0, 1], 1, "all_reduce"), issued={1: 0, 2: 1})]
    ms = _monitors(store, crossed + [None], "veto")  # rank 2 beats but posts no state (it computes)
    time.sleep(0.5)
    assert all(m.lost is None for m in ms)
    ms[2]._stop.set()  # rank 2 found one: it posts the message and beats no more
    ms[2]._thread.join()
    store.set("veto/hb/2", b"deadlock: named by rank 2")
    _wait_lost(ms[:2], 5)
    assert [str(m.lost) for m in ms[:2]] == ["deadlock: named by rank 2"] * 2
    for m in ms:
        m.stop()


# -- crossed orders, end to end ------------------------------------------------------------------------
def _crossed(rank: int, catch: bool = True) -> tuple[float, str, str] | None:
    """Rank 0: all_reduce on group A then B; rank 1: B then A. Returns (seconds until the error,
    its class, its message)."""
    a, b = mc.new_group([0, 1]), mc.new_group([0, 1])
    t = torch.ones(8)
    mc.all_reduce(t, group=a)  # both groups work in order first
    mc.all_reduce(t, group=b)
    t0 = time.monotonic()
    try:
        for g in ((a, b) if rank == 0 else (b, a)):
            mc.all_reduce(t, group=g)
    except CollectiveError as exc:
        if not catch:
            raise
        return time.monotonic() - t0, type(exc).__name__, str(exc)
    return None


def test_crossed_orders_on_threads_fail_within_seconds(monkeypatch):
    monkeypatch.delenv("MESHTRAIN_DEADLOCK_S", raising=False)  # the default bound (5 s)
    t0 = time.monotonic()
    with pytest.raises(CollectiveDeadlock) as info:
        mc.run_local(2, _crossed, False, timeout=TIMEOUT_S)
    took = time.monotonic() - t0
    assert took < 10, took
    msg = str(info.value)
    assert "rank 0 is in all_reduce #2 on group 1 (ranks [0, 1])" in msg, msg
    assert "rank 1 is in all_reduce #2 on group 2 (ranks [0, 1])" in msg, msg
    assert "waiting for rank 1, which has issued 1 call on that group" in msg, msg


@pytest.mark.timeout(90)
def test_crossed_orders_on_shm_processes_fail_within_seconds(monkeypatch):
    monkeypatch.delenv("MESHTRAIN_DEADLOCK_S", raising=False)
    t0 = time.monotonic()
    res = spawn(2, _crossed, timeout=60, comm_timeout=TIMEOUT_S, transport="shm")
    took = time.monotonic() - t0  # start-up included
    for rank, (seconds, kind, msg) in enumerate(res):
        assert kind == "CollectiveDeadlock" and seconds < 10, (rank, seconds, kind, msg)
        assert "rank 0 is in all_reduce #2 on group 1" in msg and "rank 1 is in all_reduce #2 on group 2" in msg, msg
    assert took < 20, took


def _slow_rank(rank: int) -> float:
    """Rank 1 computes 2.5 s outside any collective while rank 0 waits in one: slow, not stuck."""
    t = torch.ones(4)
    mc.all_reduce(t)
    if rank == 1:
        time.sleep(2.5)
    mc.all_reduce(t)
    return float(t[0])


def _async_overlap(rank: int) -> float:
    """Rank 0 leaves an async call on group B in flight and computes 2.5 s before its call on A,
    which rank 1 makes first: the orders differ, but rank 0 is not blocked, so it resolves."""
    a, b = mc.new_group([0, 1]), mc.new_group([0, 1])
    x, y = torch.ones(4), torch.ones(4)
    if rank == 0:
        w = mc.all_reduce(y, group=b, async_op=True)
        time.sleep(2.5)
        mc.all_reduce(x, group=a)
        w.wait()
    else:
        mc.all_reduce(x, group=a)
        mc.all_reduce(y, group=b)
    return float(x[0] + y[0])


def _async_waited(rank: int) -> None:
    """As ``_async_overlap``, but rank 0 waits for its async call before calling on A: stuck."""
    a, b = mc.new_group([0, 1]), mc.new_group([0, 1])
    x = torch.ones(4)
    if rank == 0:
        mc.all_reduce(x, group=b, async_op=True).wait()
        mc.all_reduce(x, group=a)
    else:
        mc.all_reduce(x, group=a)
        mc.all_reduce(x, group=b)


def test_a_slow_step_on_threads_is_not_a_deadlock_but_a_waited_async_cycle_is(monkeypatch):
    monkeypatch.setenv("MESHTRAIN_DEADLOCK_S", "1")
    assert mc.run_local(2, _slow_rank, timeout=TIMEOUT_S) == [4.0, 4.0]
    assert mc.run_local(2, _async_overlap, timeout=TIMEOUT_S) == [4.0, 4.0]
    t0 = time.monotonic()
    with pytest.raises(CollectiveDeadlock, match=r"rank 0 is in all_reduce #1 on group 2 .* rank 1 is in "
                                                 r"all_reduce #1 on group 1"):
        mc.run_local(2, _async_waited, timeout=TIMEOUT_S)
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(90)
def test_a_slow_step_on_shm_processes_is_not_a_deadlock(monkeypatch):
    monkeypatch.setenv("MESHTRAIN_DEADLOCK_S", "1")
    assert spawn(2, _slow_rank, timeout=60, comm_timeout=TIMEOUT_S, transport="shm") == [4.0, 4.0]
