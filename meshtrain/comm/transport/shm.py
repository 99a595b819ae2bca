"""Ranks are processes on one host; they talk through POSIX shared memory.

Each rank owns one segment holding, per peer, an outbox of ``SLOTS`` slots of ``SLOT_BYTES``:

    [ head[d] for every rank d | tail[s] for every rank s ]   int64 counters, one writer each
    [ slot headers: (tag, total bytes, offset, bytes) per (dst, slot) ]
    [ slot data: SLOTS x SLOT_BYTES per destination ]

A sender copies a chunk into slot ``head % SLOTS`` of its outbox to ``d``, writes the slot header,
then bumps ``head[d]``; the receiver copies the chunk out and bumps its own ``tail[src]``. Messages
larger than a slot travel as consecutive chunks, so sender and receiver copy at the same time
(pipelined). Every counter has one writer, and x86 keeps stores in order, so no locks are shared
between processes. A receiver matches messages per (src, tag) in posting order; a message that
arrives before its receive is posted is copied aside (as MPI's unexpected-message queue), so a
full outbox never blocks a receive of another tag.

Rendezvous goes through the torch.distributed store (the one torchrun or ``meshtrain.comm.init``
made): each rank publishes its host id and pid, creates its segment under a name derived from
both, maps its peers', and unlinks its own name once everyone has mapped it. From then on nothing
is left in /dev/shm even if a rank is killed. ``exchange`` (the metadata check, barriers) travels
as small messages through the same slots. Peers on other hosts are reached through ``remote``, a
torch transport (gloo), which is how ``init(transport="auto")`` spans several hosts.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
import zlib
from collections import defaultdict, deque
from typing import Any, Sequence

import torch

from ...errors import CollectiveError, CollectiveMismatch
from ..work import Work
from . import shm_memory as mem
from .base import PeerTimeout, Transport
from .progress import ProgressEngine
from .shm_symmetric import SymmetricRegistry
from .torchdist import host_identity

SLOT_BYTES = int(os.environ.get("MESHTRAIN_SHM_SLOT_BYTES", str(512 << 10)))
SLOTS = 4
_instances = [0]  # transports created by this process: the rendezvous round


class PeerDied(CollectiveError):
    """A peer process exited or was killed while this rank waited for it; ``missing`` names it."""

    def __init__(self, message: str, missing: Sequence[int]) -> None:
        super().__init__(message)
        self.missing = list(missing)

    def __reduce__(self) -> tuple:  # picklable (spawn's children send their errors to the parent)
        return (type(self), (str(self), self.missing))


class _ShmWork(Work):
    def __init__(self, transport: "ShmTransport", peer: int, description: str) -> None:
        super().__init__(description)
        self._t, self.peer = transport, peer

    def _progress(self, timeout: float | None) -> bool:
        return self._done.is_set() or self._t._wait(self, timeout)


class _Send:
    __slots__ = ("data", "tag", "off", "work")

    def __init__(self, data: torch.Tensor, tag: int, work: Work) -> None:
        self.data, self.tag, self.off, self.work = data, tag, 0, work


class _Incoming:
    """The message being received from one source: where its chunks go."""

    __slots__ = ("key", "total", "target", "got", "work")

    def __init__(self, key: tuple[int, int, int], total: int, target: torch.Tensor, work: Work | None):
        self.key, self.total, self.target, self.got, self.work = key, total, target, 0, work


def _u8(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _exchange_tag(key: str) -> int:
    """Exchanges use negative tags (collectives and user p2p use non-negative ones), one per key
    family (``c/<gid>`` ...), so their messages are matched in order like any other stream."""
    return -1 - (zlib.crc32(key.rsplit("/", 1)[0].encode()) & 0x3FFFFFFF)


class ShmTransport(Transport):
    """A rank's shared-memory transport; build it with ``ShmTransport.connect``."""

    kind = "shm"

    def __init__(self, store: Any, rank: int, world_size: int, hosts: list[str], pids: list[int],
                 round_no: int, remote: Transport | None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.hosts, self.pids, self.round = hosts, pids, round_no
        self.local = [r for r in range(world_size) if hosts[r] == hosts[rank]]
        self._local_set = set(self.local)
        self.remote = remote
        self._lock = threading.RLock()
        self._closed = False
        self._areas: dict[Any, Any] = {}
        self.symmetric = SymmetricRegistry(self)
        self._boards: dict[Any, Any] = {}
        w, hdr0 = world_size, 16 * world_size
        self._hdr0 = hdr0
        self._data0 = _round_up(hdr0 + w * SLOTS * 32, 4096)
        self._seg_size = self._data0 + w * SLOTS * SLOT_BYTES
        self._segs: dict[int, mem.Segment] = {}
        self._ctrl: dict[int, Any] = {}
        self._hdr: dict[int, Any] = {}
        self._head = [0] * w  # my published chunk counts, mirrored from my segment
        self._tail = [0] * w  # my consumed chunk counts
        self._txq: dict[int, deque[_Send]] = defaultdict(deque)
        self._rx: dict[int, _Incoming | None] = defaultdict(lambda: None)
        self._recv_no: dict[tuple[int, int], int] = defaultdict(int)
        self._post_no: dict[tuple[int, int], int] = defaultdict(int)
        self._posted: dict[tuple[int, int, int], tuple[torch.Tensor | None, _ShmWork]] = {}
        self._stash: dict[tuple[int, int, int], torch.Tensor] = {}
        # While this rank's thread blocks on gloo or the store, another thread moves its shm
        # messages (see progress.py: otherwise a ring mixing shm and gloo links deadlocks).
        self._engine = ProgressEngine(self.poll, f"meshtrain-progress-r{rank}")
        self.liveness: Any = None  # comm.init sets the heartbeat monitor: a lost remote rank ends waits
        if remote is not None:
            remote.while_blocked = self._engine.blocked  # type: ignore[attr-defined]

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def connect(cls, store: Any, rank: int, world_size: int, timeout: float,
                remote: Transport | None = None, host: str | None = None) -> "ShmTransport":
        """Rendezvous with every rank through ``store`` and map the segments of same-host peers.

        ``remote`` carries messages to ranks on other hosts (None: all ranks must share this host).
        """
        mem.remove_stale_segments()
        _instances[0] += 1
        round_no = _instances[0]
        host = host or host_identity()
        info = _store_all_gather(store, f"shm/{round_no}/info", rank, world_size,
                                 json.dumps({"host": host, "pid": os.getpid()}), timeout)
        hosts = [json.loads(v)["host"] for v in info]
        pids = [json.loads(v)["pid"] for v in info]
        t = cls(store, rank, world_size, hosts, pids, round_no, remote)
        others = [r for r in range(world_size) if hosts[r] != host]
        if others and remote is None:
            raise ValueError(
                f"transport='shm' needs every rank on one host, but ranks {others} run on other "
                f"hosts than rank {rank} ({host}): use init(transport='auto'), which uses shm "
                "inside a host and gloo between hosts, or transport='torch'"
            )
        if len(t.local) > 1:
            mem.oversubscribed(len(t.local))
            t._map_peers(timeout)
        return t

    def _seg_name(self, rank: int) -> str:
        return f"{mem.PREFIX}{self.pids[rank]}.{self.round}.r{rank}.p2p"

    def _map_peers(self, timeout: float) -> None:
        mine = mem.Segment.create(self._seg_name(self.rank), self._seg_size)
        try:
            deadline = time.monotonic() + timeout
            for r in self.local:
                seg = mine if r == self.rank else None
                while seg is None:
                    seg = mem.Segment.open(self._seg_name(r))
                    if seg is None:
                        self._check_alive([r], "its shared-memory segment")
                        if time.monotonic() > deadline:
                            raise PeerTimeout(f"rank {r} never created its shared-memory segment", [r])
                        time.sleep(0.001)
                self._segs[r] = seg
                self._ctrl[r] = seg.i64(0, 2 * self.world_size)
                self._hdr[r] = seg.i64(self._hdr0, self.world_size * SLOTS * 4)
            # Once every local rank has mapped every segment, the names can go: the memory lives
            # as long as a mapping does, so even a SIGKILL leaves nothing behind in /dev/shm.
            _store_all_gather(self.store, f"shm/{self.round}/mapped", self.rank, self.world_size, "1",
                              timeout, ranks=self.local)
        finally:
            mine.unlink()

    # -- point to point ----------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        """Queue ``tensor`` for ``dst`` and copy out as much as the outbox takes now (eager)."""
        if dst not in self._local_set:
            return self._remote_or_fail(dst).isend(tensor, dst, tag)
        return self._post_send(_u8(tensor), dst, tag, tensor)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        """Post a receive; it completes during any later wait on this transport."""
        if src not in self._local_set:
            return self._remote_or_fail(src).irecv(tensor, src, tag)
        return self._post_recv(_u8(tensor), src, tag, tensor)

    def _remote_or_fail(self, peer: int) -> Transport:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer rank {peer} out of range: valid ranks are 0..{self.world_size - 1}")
        if self.remote is None or peer == self.rank:
            raise ValueError(f"rank {self.rank} cannot send to or receive from rank {peer} over shm")
        return self.remote

    def _post_send(self, data: torch.Tensor, dst: int, tag: int, result: Any) -> Work:
        work = _ShmWork(self, dst, f"send to rank {dst} (tag {tag})")
        work._result = result
        with self._lock:
            self._check_open()
            self._txq[dst].append(_Send(data, tag, work))
            self._pump_send(dst)  # eager: small messages are out before isend returns
        return work

    def _post_recv(self, out: torch.Tensor | None, src: int, tag: int, result: Any) -> Work:
        work = _ShmWork(self, src, f"recv from rank {src} (tag {tag})")
        with self._lock:
            self._check_open()
            no = self._post_no[(src, tag)]
            self._post_no[(src, tag)] = no + 1
            key = (src, tag, no)
            if key in self._stash:
                self._deliver(self._stash.pop(key), out, work, result, src)
            else:
                self._posted[key] = (out, work)
                work._result = result
        return work

    def _deliver(self, data: torch.Tensor, out: torch.Tensor | None, work: Work, result: Any, src: int) -> None:
        if out is None:
            work._finish(bytes(data.numpy()))
        elif out.numel() != data.numel():
            work._finish(exc=CollectiveMismatch(
                f"rank {src} sent {data.numel()} bytes but rank {self.rank} expected {out.numel()} bytes: "
                "the matching send and recv must use tensors of the same size and dtype"))
        else:
            out.copy_(data)
            work._finish(result)

    def _pump_send(self, dst: int) -> bool:
        q = self._txq[dst]
        if not q:
            return False
        me = self.rank
        seg = self._segs[me]
        peer_tail = int(self._ctrl[dst][self.world_size + me])
        head = self._head[dst]
        base = dst * SLOTS
        while q and head - peer_tail < SLOTS:
            m = q[0]
            total = m.data.numel()
            nb = min(SLOT_BYTES, total - m.off)
            k = base + head % SLOTS
            at = self._data0 + k * SLOT_BYTES
            if nb:
                seg.u8[at : at + nb].copy_(m.data[m.off : m.off + nb])
            self._hdr[me][k * 4 : k * 4 + 4] = (m.tag, total, m.off, nb)
            head += 1
            self._ctrl[me][dst] = head  # publish after data and header (x86: stores stay ordered)
            m.off += nb
            if m.off >= total:
                q.popleft()
                m.work._finish(m.work._result)
        moved = head != self._head[dst]
        self._head[dst] = head
        return moved

    def _pump_recv(self, src: int) -> bool:
        me = self.rank
        avail = int(self._ctrl[src][me])
        tail = self._tail[src]
        if tail >= avail:
            return False
        seg, hdr = self._segs[src], self._hdr[src]
        while tail < avail:
            k = me * SLOTS + tail % SLOTS
            tag, total, off, nb = (int(x) for x in hdr[k * 4 : k * 4 + 4])
            cur = self._rx[src]
            if cur is None:  # first chunk of a message
                no = self._recv_no[(src, tag)]
                self._recv_no[(src, tag)] = no + 1
                key = (src, tag, no)
                posted = self._posted.pop(key, None)
                if posted is not None and posted[0] is not None and posted[0].numel() == total:
                    cur = _Incoming(key, total, posted[0], posted[1])
                else:  # unexpected, size-agnostic or wrong-sized: copy aside, sort out at the end
                    cur = _Incoming(key, total, torch.empty(total, dtype=torch.uint8), None)
                    if posted is not None:
                        self._posted[key] = posted
                self._rx[src] = cur
            at = self._data0 + k * SLOT_BYTES
            if nb:
                cur.target[off : off + nb].copy_(seg.u8[at : at + nb])
            cur.got += nb
            tail += 1
            self._ctrl[me][self.world_size + src] = tail
            if cur.got >= cur.total:
                self._rx[src] = None
                if cur.work is not None:
                    cur.work._finish(cur.work._result)
                else:
                    posted = self._posted.pop(cur.key, None)
                    if posted is None:
                        self._stash[cur.key] = cur.target
                    else:
                        self._deliver(cur.target, posted[0], posted[1], posted[1]._result, src)
        self._tail[src] = tail
        return True

    def _progress_all(self) -> bool:
        moved = False
        for r in self.local:
            if r != self.rank:
                moved = self._pump_send(r) | moved
                moved = self._pump_recv(r) | moved
        return moved

    def poll(self) -> bool:
        """Move whatever can move now (called by waits elsewhere, so queued sends never stall);
        True if anything moved."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    return self._progress_all()
            finally:
                self._lock.release()
        return False

    def _wait(self, work: _ShmWork, timeout: float | None) -> bool:
        def done() -> bool:
            with self._lock:
                if not self._closed:
                    self._progress_all()
            return work._done.is_set()

        if done():
            return True
        if timeout == 0:
            return False

        def expire() -> None:
            raise PeerTimeout(f"rank {self.rank} waited {timeout:.3g}s for {work.description}", [work.peer])

        deadline = None if timeout is None else time.monotonic() + timeout
        mem.block(done, deadline, expire, lambda: self._check_alive([work.peer], work.description))
        return True

    # -- liveness ------------------------------------------------------------------------------
    def _check_alive(self, ranks: Sequence[int], what: str) -> None:
        if self.liveness is not None:
            self.liveness.raise_if_lost()
        dead = [r for r in ranks if r in self._local_set and r != self.rank and not mem.alive(self.pids[r])]
        if dead:
            mem.remove_segments_of(self.pids[r] for r in dead)
            who = ", ".join(f"rank {r} (pid {self.pids[r]})" for r in dead)
            raise PeerDied(
                f"{who} exited or was killed while rank {self.rank} was waiting for {what}; the "
                f"job cannot continue: see the log of rank(s) {dead} for the cause", dead)

    def _check_open(self) -> None:
        if self._closed:
            raise CollectiveError("the shm transport is closed: meshtrain.comm.destroy() was called")

    # -- metadata exchange -------------------------------------------------------------------
    def exchange(self, key: str, ranks: Sequence[int], payload: str, timeout: float) -> list[str]:
        """All-gather through the group's board in shared memory (no store round trip)."""
        if any(r not in self._local_set for r in ranks):
            return self._remote_or_fail(next(r for r in ranks if r not in self._local_set)).exchange(
                key, ranks, payload, timeout)
        if len(ranks) == 1:
            return [payload]
        family = key.split("/")[1] if "/" in key else key
        deadline = time.monotonic() + timeout
        try:
            board = self._boards.get((family, tuple(ranks)))
            if board is None:
                board = self._boards[(family, tuple(ranks))] = self.area(
                    ranks, f"x{zlib.crc32(family.encode()):08x}", deadline)
            return board.exchange(key, payload, deadline)
        except PeerTimeout as exc:
            raise PeerTimeout(f"ranks {exc.missing} never arrived", exc.missing, never_arrived=True) from None

    def recv_exchange(self, key: str, src: int, deadline: float) -> bytes:
        """Receive an exchange payload too large for the board (see ``exchange_by_messages``)."""
        w = self._post_recv(None, src, _exchange_tag(key), None)
        w.wait(max(deadline - time.monotonic(), 1e-3))
        return w._result

    # -- shared buffers for the shm collectives ---------------------------------------------
    def is_local(self, ranks: Sequence[int]) -> bool:
        """True if every rank in ``ranks`` shares this host (the shm collectives can run)."""
        return all(r in self._local_set for r in ranks)

    def area(self, ranks: Sequence[int], name: str, deadline: float) -> Any:
        """The shared buffers of ``ranks`` named ``name`` (letters and digits), made collectively
        by the members on first use: one per group for the shm collectives, one for exchanges."""
        from .shm_area import ShmArea

        key = (name, tuple(ranks))
        a = self._areas.get(key)
        if a is None:
            self._check_open()
            a = self._areas[key] = ShmArea(self, list(ranks), f"{name}g{zlib.crc32(str(ranks).encode()):08x}",
                                           deadline)
        return a

    def host_id(self) -> str:
        """hostname + boot id, as published at the rendezvous."""
        return self.hosts[self.rank]

    def close(self) -> None:
        """Drop every mapping (names were unlinked at creation) and close the remote transport."""
        self._engine.close()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for a in self._areas.values():
                a.close()
            self._areas.clear()
            self.symmetric.allocs.clear()
            self._boards.clear()
            self._segs.clear()
            self._ctrl.clear()
            self._hdr.clear()
        if self.remote is not None:
            self.remote.close()


def exchange_by_messages(t: ShmTransport, key: str, peers: Sequence[int], data: bytes) -> list[Work]:
    """Send an exchange payload to ``peers`` as point-to-point messages (board overflow)."""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return [t._post_send(buf, r, _exchange_tag(key), None) for r in peers]


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _store_all_gather(store: Any, key: str, rank: int, world_size: int, value: str, timeout: float,
                      ranks: Sequence[int] | None = None) -> list[str]:
    """All-gather ``value`` through the torch.distributed store; PeerTimeout names who is missing."""
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    keys = [f"{key}/{r}" for r in ranks]
    store.set(f"{key}/{rank}", value)
    store.set_timeout(datetime.timedelta(seconds=max(timeout, 0.001)))
    try:
        return [v.decode() for v in store.multi_get(keys)]
    except Exception as exc:  # DistStoreError on timeout
        if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
            raise
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise PeerTimeout(f"ranks {missing} never arrived at the shm rendezvous", missing,
                          never_arrived=True) from None
