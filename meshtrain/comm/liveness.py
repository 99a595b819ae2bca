"""Liveness across hosts: every rank stops within seconds of losing a peer, whatever the timeout.

A collective timeout cannot tell a dead peer from a slow one, so it must be long (minutes), and a
rank killed on another host used to be noticed only then. Here, as in torch's elastic agent and
the seeds' heartbeat monitor, each process rank runs a thread that bumps its counter in the
rendezvous store every ``PERIOD_S`` (``hb/<rank>``) and reads everyone's. A rank whose counter has
not moved for ``STALE_S`` is lost: its process is gone (kill -9, its host died, its agent died and
took it along) or frozen. A merely slow collective is never declared lost, since the heartbeat
thread runs beside it. A rank that shuts down cleanly (``destroy()``) posts ``done``; one that
fails posts ``failed: <error>`` (``report_failure``), so its peers stop at once, naming it.

On a loss every surviving rank: prints one line naming the lost ranks and their hosts; makes the
waits it can interrupt (the shm transport's) raise ``PeerLost``; and, if the process is still
running ``GRACE_S`` later (blocked inside gloo or the store, which Python cannot interrupt), ends
it with ``os._exit(EXIT_CODE)``, as NCCL's watchdog tears down a process whose communicator failed.
The heartbeat uses a connection of its own to the store, so a long blocking store read of the
main thread never delays it.

The beats also name a deadlock (``deadlock.py``): a rank blocked in a collective with no call
completed for ``deadlock.stall_s()`` posts its ``WaitState`` after its beat (``<beat> <json>``), and
each round every rank runs ``deadlock.find`` on its own state and the peers' posted ones. A rank
that finds a cycle posts the message (``deadlock: ...``) in its key, the others adopt and post it
too, and once every live rank has, all stop as on a loss, with ``CollectiveDeadlock`` naming each
rank's call.

Cost: one ``add`` and one ``multi_get`` of ``world_size`` keys per rank per period (see
docs/comm.md); the states ride them only while a rank is stalled. ``MESHTRAIN_HEARTBEAT_S`` /
``MESHTRAIN_LOST_AFTER_S`` change the period and the staleness bound, ``MESHTRAIN_HEARTBEAT=0``
turns the monitor off (and the deadlock check with it).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

from ..errors import CollectiveDeadlock, CollectiveError
from . import deadlock

PERIOD_S = float(os.environ.get("MESHTRAIN_HEARTBEAT_S", "1.0"))
STALE_S = float(os.environ.get("MESHTRAIN_LOST_AFTER_S", "4.0"))
GRACE_S = 1.0
EXIT_CODE = 75  # EX_TEMPFAIL: this rank is healthy, another is gone; the agent may restart the job
_DONE, _FAILED, _DEADLOCK = b"done", b"failed:", b"deadlock: "  # a deadlock's value is its message


def naming_bound() -> float:
    """Seconds within which the heartbeats name a lost rank: its beat goes stale (``STALE_S``), and
    two periods for a monitor to see it (its last beat seen up to a period before it stopped, the
    round that finds it stale up to a period after). How long a wait for the reason of a closed
    connection may take."""
    return STALE_S + 2 * PERIOD_S


class PeerLost(CollectiveError):
    """Ranks of the world were lost (killed, crashed, or their host died); ``missing`` names them."""

    def __init__(self, message: str, missing: Sequence[int]) -> None:
        super().__init__(message)
        self.missing = list(missing)

    def __reduce__(self) -> tuple:  # picklable (spawn's children send their errors to the parent)
        return (type(self), (str(self), self.missing))


def _tcp_address(store: Any) -> tuple[str, int] | None:
    """(host, port) of the TCPStore under ``store`` (unwrapping PrefixStores), or None."""
    while store is not None:
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if host is not None and port is not None:
            return str(host), int(port)
        store = getattr(store, "underlying_store", None)
    return None


def _short_host(host_id: str) -> str:
    return host_id.split("/", 1)[0]


class LivenessMonitor:
    """The heartbeat thread of one process rank (see the module docstring)."""

    def __init__(self, connect: Callable[[], Any], rank: int, world_size: int, prefix: str,
                 period: float = PERIOD_S, stale: float = STALE_S, grace: float = GRACE_S,
                 exit_process: bool = True) -> None:
        self._connect = connect
        self.rank, self.world_size, self.prefix = rank, world_size, prefix
        self.period, self.stale, self.grace = period, stale, grace
        self.exit_process = exit_process
        self.hosts: list[str] = ["?"] * world_size
        self.lost: CollectiveError | None = None  # a PeerLost, or the CollectiveDeadlock found
        # This rank's deadlock.WaitState (Communicator.wait_state), set once the communicator exists.
        self.wait_state: Callable[[], deadlock.WaitState] | None = None
        self.failures: dict[int, str] = {}  # rank -> what it reported (failed: ...) or "lost"
        self._store: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listeners: list[Callable[[CollectiveError], None]] = []

    def _key(self, r: int) -> str:
        return f"{self.prefix}/hb/{r}"

    # -- life cycle ------------------------------------------------------------------------------
    def announce(self) -> None:
        """Post this rank's first beat (before the world's rendezvous, so that once it completes
        every rank's key exists and reading them never waits)."""
        self._store = self._connect()
        self._store.set(self._key(self.rank), "1")

    def start(self, hosts: Sequence[str]) -> None:
        """Start beating and watching (after the rendezvous; ``hosts`` names each rank's host)."""
        self.hosts = list(hosts)
        self._thread = threading.Thread(target=self._run, name=f"meshtrain-heartbeat-r{self.rank}", daemon=True)
        self._thread.start()

    def add_listener(self, fn: Callable[[CollectiveError], None]) -> None:
        """Call ``fn(error)`` on the heartbeat thread when a loss (``PeerLost``) or a deadlock
        (``CollectiveDeadlock``) is found, before the grace."""
        self._listeners.append(fn)

    def stop(self, failure: str | None = None) -> None:
        """Stop the thread and post ``done`` (or ``failed: <failure>``) for the other ranks."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period + 1)
        if self._store is not None and self.lost is None:
            try:
                value = _DONE if failure is None else _FAILED + failure.encode()[:500]
                self._store.set(self._key(self.rank), value)
            except Exception:  # noqa: BLE001 - the store may be gone at shutdown; nothing to tell
                pass

    def why(self, peer: int | None, wait: float = PERIOD_S * 1.5) -> str | None:
        """What is known of ``peer``'s end (its reported error, or that it was lost; any loss for
        None), waiting up to ``wait`` seconds for the next heartbeat round to tell; None if
        nothing is known."""
        deadline = time.monotonic() + wait
        while peer not in self.failures and self.lost is None and time.monotonic() < deadline:
            if self._stop.wait(0.05):
                break
        if peer in self.failures:
            return self.failures[peer]
        return str(self.lost) if self.lost is not None else None

    def raise_if_lost(self) -> None:
        """Raise ``PeerLost`` (or ``CollectiveDeadlock``) if a loss (a deadlock) was found; called
        by waits that can be interrupted."""
        if self.lost is not None:
            raise self.lost

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        keys = [self._key(r) for r in range(self.world_size)]
        seen: dict[int, bytes] = {}
        moved_at: dict[int, float] = {}
        beat = 1
        while not self._stop.wait(self.period):
            beat += 1
            stall = deadlock.stall_s()
            mine = self._own_state(stall)
            stalled = mine is not None and mine.stalled(stall)
            try:
                # the state rides the beat only while stalled: a job that completes calls pays nothing
                self._store.set(keys[self.rank], f"{beat} {mine.encode()}" if stalled else str(beat))
                values = self._store.multi_get(keys)
            except Exception as exc:  # noqa: BLE001 - the store's host is gone (or unreachable)
                if self._stop.is_set() or seen.get(0) == _DONE:
                    return  # a clean shutdown: rank 0 (the store's usual host) finished first
                # The store is served from rank 0's host (its torchrun agent, or rank 0 itself).
                gone = [r for r in range(self.world_size) if self.hosts[r] == self.hosts[0]]
                self._lose(f"rank {self.rank} lost the rendezvous store ({str(exc).splitlines()[0][:200]}), which is "
                           f"served from the host of rank 0: rank(s) {gone} ({self._where(gone)}) lost with it, "
                           f"probably (its torchrun agent or the host died)", gone)
                return
            now = time.monotonic()
            failed, lost = [], []
            for r, v in enumerate(values):
                if r == self.rank or v == _DONE or v.startswith(_DEADLOCK):  # (a deadlock: adopted below)
                    continue
                if v.startswith(_FAILED):
                    failed.append((r, v[len(_FAILED):].decode(errors="replace")))
                elif seen.get(r) != v:
                    seen[r], moved_at[r] = v, now
                elif now - moved_at[r] > self.stale:
                    lost.append(r)
            for r, v in enumerate(values):
                if v == _DONE:
                    seen[r] = v
            for r, why in failed:
                self.failures[r] = f"rank {r} ({self._where([r])}) failed: {why}"
            for r in lost:
                self.failures[r] = f"rank {r} ({self._where([r])}) was lost"
            if failed:
                r, why = failed[0]
                self._lose(self.failures[r], [r for r, _ in failed])
                return
            if lost:
                self._lose(f"rank(s) {lost} ({self._where(lost)}) lost: no heartbeat for {self.stale:g}s "
                           f"(killed, crashed, or their host died)", lost)
                return
            found = self._deadlock(values, mine if stalled else None, stall)
            if found is not None:
                self._agree(keys, found)
                self._end(CollectiveDeadlock(found), "a deadlock")
                return

    def _where(self, ranks: Sequence[int]) -> str:
        hosts = sorted({_short_host(self.hosts[r]) for r in ranks})
        return ("host " if len(hosts) == 1 else "hosts ") + ", ".join(hosts)

    def _own_state(self, stall: float) -> deadlock.WaitState | None:
        """This rank's wait state (None without a communicator, with the check off, or if reading
        it failed: the heartbeat must go on whatever the check does)."""
        if self.wait_state is None or stall <= 0:
            return None
        try:
            return self.wait_state()
        except Exception:  # noqa: BLE001 - a group made while reading; the next round reads again
            return None

    def _deadlock(self, values: Sequence[bytes], mine: deadlock.WaitState | None, stall: float) -> str | None:
        """The deadlock message a peer posted, or the one ``deadlock.find`` names from this rank's
        stalled state ``mine`` and the peers' posted ones; None otherwise."""
        for v in values:
            if v.startswith(_DEADLOCK):
                return v.decode(errors="replace")
        if mine is None:
            return None
        states: list[deadlock.WaitState | None] = []
        for r, v in enumerate(values):
            if r == self.rank or v == _DONE:  # a finished rank is not live
                states.append(mine if r == self.rank else None)
                continue
            _, _, text = v.partition(b" ")
            if not text:
                return None  # a live rank that is not stalled (or has posted no state yet)
            try:
                states.append(deadlock.WaitState.decode(text.decode()))
            except (ValueError, KeyError, TypeError):
                return None
        return deadlock.find(states, stall)

    def _agree(self, keys: Sequence[str], message: str) -> None:
        """Post ``message`` (a deadlock found here or adopted from a peer), then wait until every
        live rank has posted one, at most two periods and a second. Each rank reads the others'
        states at its own moment, so one may find the cycle a round before another; a rank that
        raised at once could end its process before a peer looked, and that peer's wait would
        name a dead peer (``PeerDied``) instead of the calls."""
        deadline = time.monotonic() + 2 * self.period + 1.0
        try:
            self._store.set(keys[self.rank], message.encode())  # (deadlock.find's begins with _DEADLOCK)
            while time.monotonic() < deadline:
                values = self._store.multi_get(list(keys))
                if all(v == _DONE or v.startswith((_DEADLOCK, _FAILED)) for v in values):
                    return
                if self._stop.wait(min(0.05, self.period)):
                    return
        except Exception:  # noqa: BLE001 - the store is gone: stop now, the peers see this rank end
            return

    def _lose(self, what: str, missing: list[int]) -> None:
        self._end(PeerLost(f"{what}. Rank {self.rank} stops: the job cannot go on without every rank; see the lost "
                           f"ranks' logs, then restart the job", missing), "a lost peer")

    def _end(self, err: CollectiveError, cause: str) -> None:
        """Stop this rank for ``err``: print it, make interruptible waits raise it, tell the
        listeners, and exit the process if it still runs after the grace."""
        self.lost = err
        print(f"meshtrain: [rank {self.rank}] {err}", file=sys.stderr, flush=True)
        for fn in self._listeners:
            try:
                fn(err)
            except Exception:  # noqa: BLE001 - a listener must not keep the process alive
                pass
        if self.exit_process and not self._stop.wait(self.grace):
            # Still running: the main thread is blocked where Python cannot interrupt it (gloo).
            print(f"meshtrain: [rank {self.rank}] exiting (code {EXIT_CODE}) after {cause}", file=sys.stderr,
                  flush=True)
            os._exit(EXIT_CODE)


def monitor_for(store: Any, rank: int, world_size: int) -> LivenessMonitor | None:
    """A monitor on its own connection to the TCPStore behind ``store`` (None if it has no TCP
    address, the world has one rank, or ``MESHTRAIN_HEARTBEAT=0``)."""
    if world_size < 2 or os.environ.get("MESHTRAIN_HEARTBEAT", "1") == "0":
        return None
    address = _tcp_address(store)
    if address is None:
        return None
    import torch.distributed as dist

    host, port = address
    from .transport.torchdist import round_prefix

    prefix = f"{round_prefix() or 'meshtrain'}/liveness"

    def connect() -> Any:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=max(PERIOD_S * 3, 3.0)))

    return LivenessMonitor(connect, rank, world_size, prefix=prefix)


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent (the torchrun agent) dies, so a
    killed agent leaves no orphan training on (Linux's PR_SET_PDEATHSIG; elsewhere a no-op).
    Returns True if set. Only for processes an elastic agent started (TORCHELASTIC_RUN_ID set)."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the agent died before the call: nothing will signal us, so go now
        os._exit(EXIT_CODE)
    return True
