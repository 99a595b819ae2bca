"""The slot mailbox of the shm transport: point-to-point messages between ranks of one host.

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

The mailbox only moves bytes and completes ``Work``s; mapping the segments, waiting, liveness and
locking are the transport's (``shm.py``): every method here runs under the transport's lock.
"""

from __future__ import annotations

import os
from collections import defaultdict, deque
from typing import Any

import torch

from ...errors import CollectiveMismatch
from ..work import Work
from . import shm_memory as mem

SLOT_BYTES = int(os.environ.get("MESHTRAIN_SHM_SLOT_BYTES", str(512 << 10)))
SLOTS = 4


class _Send:
    __slots__ = ("data", "tag", "off", "work")

    def __init__(self, data: torch.Tensor, tag: int, work: Work) -> None:
        self.data, self.tag, self.off, self.work = data, tag, 0, work


class _Incoming:
    """The message being received from one source: where its chunks go."""

    __slots__ = ("key", "total", "target", "got", "work")

    def __init__(self, key: tuple[int, int, int], total: int, target: torch.Tensor, work: Work | None):
        self.key, self.total, self.target, self.got, self.work = key, total, target, 0, work


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


class Mailbox:
    """One rank's outboxes to, and inboxes from, the ranks of its host (layout: module docstring)."""

    def __init__(self, rank: int, world_size: int, local: list[int]) -> None:
        self.rank, self.world_size = rank, world_size
        self.peers = [r for r in local if r != rank]
        w = world_size
        self._hdr0 = 16 * w
        self._data0 = _round_up(self._hdr0 + w * SLOTS * 32, 4096)
        self.segment_bytes = self._data0 + w * SLOTS * SLOT_BYTES
        """The size of every rank's segment."""
        self._segs: dict[int, mem.Segment] = {}
        self._ctrl: dict[int, Any] = {}
        self._hdr: dict[int, Any] = {}
        self._head = [0] * w  # my published chunk counts, mirrored from my segment
        self._tail = [0] * w  # my consumed chunk counts
        self._txq: dict[int, deque[_Send]] = defaultdict(deque)
        self._rx: dict[int, _Incoming | None] = defaultdict(lambda: None)
        self._recv_no: dict[tuple[int, int], int] = defaultdict(int)
        self._post_no: dict[tuple[int, int], int] = defaultdict(int)
        self._posted: dict[tuple[int, int, int], tuple[torch.Tensor | None, Work]] = {}
        self._stash: dict[tuple[int, int, int], torch.Tensor] = {}

    def attach(self, rank: int, seg: mem.Segment) -> None:
        """Use ``seg`` as the segment of local ``rank`` (this rank's own, or a peer's)."""
        self._segs[rank] = seg
        self._ctrl[rank] = seg.i64(0, 2 * self.world_size)
        self._hdr[rank] = seg.i64(self._hdr0, self.world_size * SLOTS * 4)

    def detach_all(self) -> None:
        """Drop every segment (the transport is closing)."""
        self._segs.clear()
        self._ctrl.clear()
        self._hdr.clear()

    def send(self, data: torch.Tensor, dst: int, tag: int, work: Work) -> None:
        """Queue bytes ``data`` for ``dst`` and copy out as much as the outbox takes now (eager:
        small messages are out before ``isend`` returns); ``work`` finishes once all is out."""
        self._txq[dst].append(_Send(data, tag, work))
        self._pump_send(dst)

    def recv(self, out: torch.Tensor | None, src: int, tag: int, work: Work, result: Any) -> None:
        """Post a receive of the next message from ``src`` with ``tag`` into bytes ``out`` (None:
        finish ``work`` with the message as ``bytes``), else with ``result``. A message already
        copied aside is delivered at once."""
        no = self._post_no[(src, tag)]
        self._post_no[(src, tag)] = no + 1
        key = (src, tag, no)
        if key in self._stash:
            self._deliver(self._stash.pop(key), out, work, result, src)
        else:
            self._posted[key] = (out, work)
            work._result = result

    def progress(self) -> bool:
        """Move whatever can move now, to and from every peer; True if anything moved."""
        moved = False
        for r in self.peers:
            moved = self._pump_send(r) | moved
            moved = self._pump_recv(r) | moved
        return moved

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
