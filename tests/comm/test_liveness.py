"""The heartbeat monitor (comm/liveness.py): a lost or failed rank is named within seconds, a slow
one never is, a clean shutdown is not a loss. Monitors run in this process on a real TCPStore with
short periods; the end-to-end kill -9 across hosts is in tests/hosts."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from meshtrain.comm.liveness import LivenessMonitor, PeerLost

PERIOD, STALE = 0.05, 0.5


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
    yield s
    del s


def _monitors(store, n: int, prefix: str, stale: float = STALE) -> list[LivenessMonitor]:
    def connect():
        return dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=3))

    ms = [LivenessMonitor(connect, r, n, prefix, period=PERIOD, stale=stale, exit_process=False) for r in range(n)]
    for m in ms:
        m.announce()
    for m in ms:
        m.start([f"host{r // 2}/boot" for r in range(n)])
    return ms


def _freeze(m: LivenessMonitor) -> None:
    """Stop a monitor's beats without posting anything: what a kill -9 leaves behind."""
    m._stop.set()
    m._thread.join()


def test_a_silent_rank_is_named_with_its_host(store):
    ms = _monitors(store, 3, "silent")
    time.sleep(3 * PERIOD)
    heard = []
    ms[0].add_listener(heard.append)
    t0 = time.monotonic()
    _freeze(ms[2])
    while ms[0].lost is None and time.monotonic() - t0 < 10 * STALE:
        time.sleep(PERIOD)
    took = time.monotonic() - t0
    assert isinstance(ms[0].lost, PeerLost) and ms[0].lost.missing == [2]
    assert "rank(s) [2] (host host1) lost" in str(ms[0].lost)
    assert STALE <= took < STALE + 10 * PERIOD
    assert heard == [ms[0].lost]
    while ms[1].lost is None and time.monotonic() - t0 < 10 * STALE:
        time.sleep(PERIOD)
    with pytest.raises(PeerLost, match=r"rank\(s\) \[2\]"):  # what the shm transport's waits raise
        ms[1].raise_if_lost()
    for m in ms[:2]:
        m.stop()


def test_a_failed_rank_is_named_at_once_with_its_error(store):
    ms = _monitors(store, 2, "failed")
    time.sleep(2 * PERIOD)
    t0 = time.monotonic()
    ms[1].stop("ValueError: bad batch")
    while ms[0].lost is None and time.monotonic() - t0 < 5:
        time.sleep(PERIOD / 5)
    assert ms[0].lost is not None and ms[0].lost.missing == [1]
    assert "rank 1 (host host0) failed: ValueError: bad batch" in str(ms[0].lost)
    assert time.monotonic() - t0 < STALE  # no waiting for staleness
    assert ms[0].why(1, wait=0).startswith("rank 1 (host host0) failed")
    ms[0].stop()


def test_a_busy_rank_and_a_clean_shutdown_are_not_losses(store):
    ms = _monitors(store, 2, "busy")
    # The main thread of rank 1 is busy (a long collective, a long step): its beats go on.
    busy = threading.Thread(target=lambda: time.sleep(4 * STALE))
    busy.start()
    busy.join()
    assert ms[0].lost is None and ms[1].lost is None
    ms[1].stop()  # clean: posts done
    time.sleep(3 * STALE)
    assert ms[0].lost is None and ms[0].why(1, wait=0) is None
    ms[0].stop()


def test_a_torch_op_on_a_closed_connection_names_the_rank_the_heartbeats_lost():
    """gloo says only "Connection closed by peer": the runner asks the heartbeats and names the
    lost rank; other errors, and worlds without heartbeats, pass through unchanged."""
    import types

    from meshtrain.comm.runner import named_peer_loss
    from meshtrain.errors import CollectiveError, ConfigError

    asked = []

    class Heartbeats:
        def why(self, peer, wait):
            asked.append(wait)
            return "rank(s) [3] (host host1) lost: no heartbeat for 4s"

    g = types.SimpleNamespace(comm=types.SimpleNamespace(liveness=Heartbeats()), gid="w", ranks=[0, 1, 2, 3])
    err = named_peer_loss(g, "all_reduce", 7, RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242"))
    assert isinstance(err, CollectiveError) and "all_reduce #7" in str(err) and "rank(s) [3]" in str(err)
    assert "Connection closed by peer" in str(err) and asked and asked[0] >= 4.0
    assert named_peer_loss(g, "all_reduce", 7, RuntimeError("unsupported dtype")) is None
    assert named_peer_loss(g, "all_reduce", 7, ConfigError("Connection closed")) is None
    g.comm.liveness = None
    assert named_peer_loss(g, "all_reduce", 7, RuntimeError("Connection closed by peer")) is None


def test_a_siblings_closed_connection_names_the_rank_killed_before_it(store, monkeypatch):
    """Rank 3 is killed; its agent stops its sibling, rank 2, whose connections close first. A recv
    from rank 2 that fails on the closed connection waits for the heartbeats up to their naming
    bound, and names rank 3 (whose beat went stale), not only "rank 2 has probably exited"."""
    from meshtrain.comm import liveness
    from meshtrain.comm.transport.torchdist import _peer_failure

    # a loss bound longer than what a closed connection waited for before (1.5 s): the heartbeats
    # name rank 3 about 2 s after it stopped; the bound (3 s here) leaves them room on a busy host
    stale = 2.0
    monkeypatch.setattr(liveness, "STALE_S", stale)
    monkeypatch.setattr(liveness, "PERIOD_S", 0.5)
    ms = _monitors(store, 4, "sibling", stale=stale)
    time.sleep(3 * PERIOD)
    _freeze(ms[3])  # killed: beats no more, posts nothing
    t0 = time.monotonic()  # at once, its sibling's connection closes (rank 2 still beats)
    err = _peer_failure(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242"), 2, "recv from", ms[0])
    took = time.monotonic() - t0
    assert "recv from rank 2 failed: [gloo] Connection closed by peer" in str(err), err
    assert "rank(s) [3] (host host1) lost" in str(err), err
    # it waited for them (rank 3's last beat was seen up to a few periods before it froze), no longer
    assert stale - 3 * PERIOD <= took < liveness.naming_bound(), took
    for m in ms[:3]:
        m.stop()
