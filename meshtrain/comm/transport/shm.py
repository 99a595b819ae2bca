"""Ranks are processes on one host; they talk through POSIX shared memory.

``ShmTransport`` routes each message: to a peer of this host through the slot mailbox
(``shm_mailbox.py``: the segment layout, chunking and early-message matching), to a peer on
another host through ``remote``, a torch transport (gloo), which is how
``init(transport="auto")`` spans several hosts. It also owns what those pieces share: the
rendezvous, the lock, the waits, and the liveness of same-host peers.

Rendezvous goes through the torch.distributed store (the one torchrun or ``meshtrain.comm.init``
made; ``rendezvous.store_all_gather``): each rank publishes its host id and pid, creates its
segment under a name derived from both, maps its peers', and unlinks its own name once everyone
has mapped it. From then on nothing is left in /dev/shm even if a rank is killed. ``exchange``
(the metadata check, barriers) goes through a board in the group's shared buffers
(``shm_area.py``), overflowing into small messages through the same slots.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from typing import Any, Sequence

import torch

from ...errors import CollectiveError
from ..work import Work
from . import shm_memory as mem
from .base import PeerTimeout, Transport
from .progress import ProgressEngine
from .rendezvous import set_store_timeout, store_all_gather
from .shm_area import ShmArea
from .shm_mailbox import Mailbox, as_bytes
from .shm_symmetric import SymmetricRegistry
from .registry import ANY_BACKEND, Capabilities, Setup, TransportSpec, register
from .torchdist import TorchTransport, host_identity

_instances = [0]  # transports created by this process: the rendezvous round
_AT_RENDEZVOUS = " at the shm rendezvous"  # ends the PeerTimeout message of a late rank


class PeerDied(CollectiveError):
    """A peer process exited or was killed while this rank waited for it; ``missing`` names it."""

    def __init__(self, message: str, missing: Sequence[int]) -> None:
        super().__init__(message)
        self.missing = list(missing)

    def __reduce__(self) -> tuple:  # picklable (spawn's children send their errors to the parent)
        return (type(self), (str(self), self.missing))


class _ShmWork(Work):
    """A send or receive of the mailbox; waiting on it moves the transport's messages."""

    def __init__(self, transport: "ShmTransport", peer: int, description: str) -> None:
        super().__init__(description)
        self._t, self.peer = transport, peer

    def _progress(self, timeout: float | None) -> bool:
        return self._done.is_set() or self._t._wait(self, timeout)


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
        self._areas: dict[tuple[str, tuple[int, ...]], ShmArea] = {}
        self.symmetric = SymmetricRegistry(self)
        self._boards: dict[tuple[str, tuple[int, ...]], ShmArea] = {}
        self.mailbox = Mailbox(rank, world_size, self.local)
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
        set_store_timeout(store, timeout)
        info = store_all_gather(store, f"shm/{round_no}/info", rank, range(world_size),
                                json.dumps({"host": host, "pid": os.getpid()}), where=_AT_RENDEZVOUS)
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
        mine = mem.Segment.create(self._seg_name(self.rank), self.mailbox.segment_bytes)
        try:
            deadline = time.monotonic() + timeout
            for r in self.local:
                seg = mine if r == self.rank else None
                while seg is None:
                    seg = mem.Segment.open(self._seg_name(r))
                    if seg is None:
                        self.check_alive([r], "its shared-memory segment")
                        if time.monotonic() > deadline:
                            raise PeerTimeout(f"rank {r} never created its shared-memory segment", [r])
                        time.sleep(0.001)
                self.mailbox.attach(r, seg)
            # Once every local rank has mapped every segment, the names can go: the memory lives
            # as long as a mapping does, so even a SIGKILL leaves nothing behind in /dev/shm.
            set_store_timeout(self.store, timeout)
            store_all_gather(self.store, f"shm/{self.round}/mapped", self.rank, self.local, "1",
                             where=_AT_RENDEZVOUS)
        finally:
            mine.unlink()

    # -- point to point ----------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        """Queue ``tensor`` for ``dst`` and copy out as much as the outbox takes now (eager)."""
        if dst not in self._local_set:
            return self._remote_or_fail(dst).isend(tensor, dst, tag)
        return self._post_send(as_bytes(tensor), dst, tag, tensor)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        """Post a receive; it completes during any later wait on this transport."""
        if src not in self._local_set:
            return self._remote_or_fail(src).irecv(tensor, src, tag)
        return self._post_recv(as_bytes(tensor), src, tag, tensor)

    def _remote_or_fail(self, peer: int) -> Transport:
        """The transport to a peer on another host; ValueError for a rank nothing can reach."""
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer rank {peer} out of range: valid ranks are 0..{self.world_size - 1}")
        if self.remote is None or peer == self.rank:
            raise ValueError(f"rank {self.rank} cannot send to or receive from rank {peer} over shm")
        return self.remote

    def _post_send(self, data: torch.Tensor, dst: int, tag: int, result: Any) -> Work:
        work = _ShmWork(self, dst, f"send to rank {dst} (tag {tag})")
        work._result = result
        with self._lock:
            self.check_open()
            self.mailbox.send(data, dst, tag, work)
        return work

    def _post_recv(self, out: torch.Tensor | None, src: int, tag: int, result: Any) -> Work:
        work = _ShmWork(self, src, f"recv from rank {src} (tag {tag})")
        with self._lock:
            self.check_open()
            self.mailbox.recv(out, src, tag, work, result)
        return work

    def poll(self) -> bool:
        """Move whatever can move now (called by waits elsewhere, so queued sends never stall);
        True if anything moved."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    return self.mailbox.progress()
            finally:
                self._lock.release()
        return False

    def _wait(self, work: _ShmWork, timeout: float | None) -> bool:
        def done() -> bool:
            with self._lock:
                if not self._closed:
                    self.mailbox.progress()
            return work._done.is_set()

        if done():
            return True
        if timeout == 0:
            return False

        def expire() -> None:
            raise PeerTimeout(f"rank {self.rank} waited {timeout:.3g}s for {work.description}", [work.peer])

        deadline = None if timeout is None else time.monotonic() + timeout
        mem.block(done, deadline, expire, lambda: self.check_alive([work.peer], work.description))
        return True

    # -- liveness ------------------------------------------------------------------------------
    def check_alive(self, ranks: Sequence[int], what: str) -> None:
        """Raise if a lost remote rank ended the job (the heartbeats) or a process of ``ranks`` on
        this host has exited: ``PeerDied`` naming it, its segments removed; ``CollectiveError`` once
        this transport is closed, so a wait left in another thread (an async op, a bucket's
        reduction) ends at ``destroy()`` instead of holding the process's exit until its timeout.
        ``what``: what this rank was waiting for, for the message."""
        self.check_open()
        if self.liveness is not None:
            self.liveness.raise_if_lost()
        dead = [r for r in ranks if r in self._local_set and r != self.rank and not mem.alive(self.pids[r])]
        if dead:
            mem.remove_segments_of(self.pids[r] for r in dead)
            who = ", ".join(f"rank {r} (pid {self.pids[r]})" for r in dead)
            raise PeerDied(
                f"{who} exited or was killed while rank {self.rank} was waiting for {what}; the "
                f"job cannot continue: see the log of rank(s) {dead} for the cause", dead)

    def check_open(self) -> None:
        """Raise ``CollectiveError`` if ``close()`` (``meshtrain.comm.destroy``) has run."""
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

    def send_exchange(self, key: str, peers: Sequence[int], data: bytes) -> list[Work]:
        """Send an exchange payload too large for the board to ``peers`` as messages."""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return [self._post_send(buf, r, _exchange_tag(key), None) for r in peers]

    # -- shared buffers for the shm collectives ---------------------------------------------
    def is_local(self, ranks: Sequence[int]) -> bool:
        """True if every rank in ``ranks`` shares this host (the shm collectives can run)."""
        return all(r in self._local_set for r in ranks)

    def area(self, ranks: Sequence[int], name: str, deadline: float) -> ShmArea:
        """The shared buffers of ``ranks`` named ``name`` (letters and digits), made collectively
        by the members on first use: one per group for the shm collectives, one for exchanges."""
        key = (name, tuple(ranks))
        a = self._areas.get(key)
        if a is None:
            self.check_open()
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
            self.mailbox.detach_all()
        if self.remote is not None:
            self.remote.close()


def _build(setup: Setup) -> ShmTransport:
    """Rendezvous through the store; with ``spans_hosts`` (``auto``) peers on other hosts are reached
    through a gloo ``TorchTransport``."""
    import torch.distributed as dist

    remote = TorchTransport(setup.store) if setup.spans_hosts else None
    return ShmTransport.connect(dist.PrefixStore("meshtrain", setup.store), setup.rank, setup.world_size,
                                setup.timeout, remote=remote)


SPEC = register(TransportSpec(
    name=ShmTransport.kind, build=_build,
    capabilities=Capabilities(shared_memory=True),
    cost_model=(10e-6, 1 / 5e9, 1 / 4e9),
    algorithms=("shm", "shm_symmetric"),  # shm_symmetric: the bench's shm all_reduce on symmetric memory
    config_hint="comm.transport = 'shm', or 'auto' without nccl",
    auto_backends=(ANY_BACKEND,),  # gloo (any backend but NCCL): shared memory in a host, gloo between
))
