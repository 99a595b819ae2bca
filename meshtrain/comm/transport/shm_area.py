"""Shared buffers of one group for the shm collectives (``meshtrain.comm.algorithms.shm_direct``).

Each member owns a control segment (its step counter, its buffer generation) and a data segment
of two halves: chunk c of a collective uses half c % 2, so a rank fills the next chunk while its
peers still read the previous one. Every shm collective follows one step protocol: in chunk c a
rank announces step 2c+1 once its input is in its buffer and 2c+2 once its share of the result
is. Peers read my half c % 2 only between their own steps 2c+1 and 2c+3, so before writing chunk
c a rank waits until every peer has announced 2c-1. The chunk counter runs on across calls.

The data segment grows on demand, collectively: every member makes the same call with the same
size, so every member grows at the same call, maps the others' new segment, and unlinks its own
name once all have mapped it.
"""

from __future__ import annotations

import struct
import time
from typing import Protocol, Sequence

import torch

from ...errors import CollectiveMismatch
from ..work import Work
from . import shm_memory as mem
from .base import PeerTimeout

STEP, GEN, OPENED, EXCH, WAITING, FPRINT = 0, 8, 16, 24, 32, 40  # int64 indices, a cache line apart
BOARD_AT, BOARD_BYTES = 4096, 8192  # two halves after the counters: the exchange board
CTRL_BYTES = BOARD_AT + 2 * BOARD_BYTES


class AreaHost(Protocol):
    """What the shared buffers need from the transport of their members (``ShmTransport``)."""

    rank: int
    pids: list[int]
    """The process id of every global rank (segment names carry the owner's pid)."""
    round: int
    """The transport's rendezvous round (in segment names: a second transport of one process
    never meets the first one's segments)."""

    def poll(self) -> bool:
        """Move this rank's queued point-to-point messages; True if any moved."""
        ...

    def check_alive(self, ranks: Sequence[int], what: str) -> None:
        """Raise if a rank of ``ranks`` is gone while this rank waits for ``what``."""
        ...

    def send_exchange(self, key: str, peers: Sequence[int], data: bytes) -> list[Work]:
        """Send an exchange payload too large for the board to ``peers`` as messages."""
        ...

    def recv_exchange(self, key: str, src: int, deadline: float) -> bytes:
        """Receive what ``send_exchange`` of rank ``src`` sent for ``key``."""
        ...


class ShmArea:
    """The shared buffers of the group ``ranks`` (global ranks, all on this host)."""

    def __init__(self, t: AreaHost, ranks: list[int], key: str, deadline: float) -> None:
        self.t, self.ranks, self.key = t, ranks, key
        self.me = ranks.index(t.rank)
        self.others = [k for k in range(len(ranks)) if k != self.me]
        self.chunk = 0  # chunks done by this group, across calls
        self.half = 0  # bytes per half of every member's data segment
        self.halves = 2  # a symmetric allocation (transport/shm_symmetric.py) has one
        self.gen = 0
        self._data: list[mem.Segment | None] = [None] * len(ranks)
        self._views: dict[tuple, torch.Tensor] = {}
        self._ctrl_segs = self._map_all("c", CTRL_BYTES, deadline, None)
        self.ctrl = [s.i64(0, FPRINT + 2) for s in self._ctrl_segs]
        self._addr = [c.ctypes.data for c in self.ctrl]
        self.exchanges = 0
        self._all_opened(1, deadline)

    def _name(self, k: int, suffix: str) -> str:
        r = self.ranks[k]
        return f"{mem.PREFIX}{self.t.pids[r]}.{self.t.round}.{self.key}.r{r}.{suffix}"

    def _map_all(self, suffix: str, size: int, deadline: float, gen: int | None) -> list[mem.Segment]:
        """Create my segment ``suffix``, then map every peer's; the names stay until _all_opened."""
        own = mem.Segment.create(self._name(self.me, suffix), size)
        self._pending = own
        if gen is not None:
            self.publish(GEN, gen)
        segs: list[mem.Segment] = []
        try:
            for k in range(len(self.ranks)):
                if k == self.me:
                    segs.append(own)
                    continue
                if gen is not None:
                    self.wait(k, GEN, gen, deadline, "a larger shared buffer")
                seg = None
                while seg is None:
                    seg = mem.Segment.open(self._name(k, suffix))
                    if seg is None:
                        self._poll_peer(k, deadline)
                segs.append(seg)
        except BaseException:  # a peer that never came (timeout, death): my name must not outlive me
            own.unlink()
            raise
        return segs

    def _poll_peer(self, k: int, deadline: float) -> None:
        r = self.ranks[k]
        self.t.check_alive([r], "its shared buffers")
        if time.monotonic() > deadline:
            raise PeerTimeout(f"rank {r} never created its shared buffers for this group", [r])
        time.sleep(0.0005)

    def _all_opened(self, value: int, deadline: float) -> None:
        """Announce that I mapped everything, wait for all, then unlink my new name."""
        try:
            self.publish(OPENED, value)
            self.wait_all(value, deadline, "mapping the shared buffers", index=OPENED)
        finally:
            self._pending.unlink()

    def reserve(self, half_bytes: int, cap: int, deadline: float) -> None:
        """Make each half at least ``half_bytes`` (collective). The first call takes ``cap`` (the
        largest chunk any collective uses), so no later call grows the buffers: growing is a step
        every member must take, and members of a mismatched call could disagree on it (a hang
        until the timeout instead of the metadata check's clear error)."""
        if half_bytes <= self.half:
            return
        new = _round_up(max(half_bytes, cap), 4096)
        self.gen += 1
        self._data = list(self._map_all(f"d{self.gen}", self.halves * new, deadline, self.gen))
        self._views.clear()
        self._all_opened(self.gen + 1, deadline)
        self.half = new

    def segment_bytes(self, k: int) -> int:
        """Size of member ``k``'s data segment as mapped here."""
        return self._data[k].size

    def view(self, k: int, parity: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements at byte ``offset`` of half ``parity`` of member ``k``'s buffer.
        Cached: making a view costs microseconds, as much as a whole small collective's copy."""
        key = (k, parity, offset, numel, dtype)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 512:
                self._views.clear()
            at = parity * self.half + offset
            v = self._views[key] = self._data[k].u8[at : at + numel * dtype.itemsize].view(dtype)
        return v

    def begin(self, deadline: float) -> tuple[int, int]:
        """Start a chunk: its number and buffer half, once peers are done reading that half."""
        c = self.chunk
        self.chunk += 1
        if c >= 1:
            self.wait_all(2 * c - 1, deadline, "its peers to finish reading")
        return c, c % 2

    def announce(self, step: int, fingerprint: int | None = None) -> None:
        """Tell the peers I have reached ``step``; with ``fingerprint``, the call's metadata
        fingerprint goes with it (into slot ``step // 2 % 2``: a peer overwrites that slot only two
        chunks later, after I announced the next step, so it is still there when I read it)."""
        if fingerprint is not None:
            self.ctrl[self.me][FPRINT + step // 2 % 2] = fingerprint
            mem.fence()  # visible before the step that announces it
        self.publish(STEP, step)

    def agree(self, step: int, fingerprint: int) -> bool:
        """After waiting for every member's ``step``: True if all announced ``fingerprint`` with it."""
        mem.fence()
        slot = FPRINT + step // 2 % 2
        return all(int(self.ctrl[k][slot]) == fingerprint for k in self.others)

    def publish(self, index: int, value: int) -> None:
        """Set my counter ``index`` and wake the peers asleep on it. The fence makes the store
        visible before the WAITING flags are read; a sleeper sets its flag before its last look at
        the counter, so one of the two sees the other (a lost race costs one futex timeout)."""
        mine = self.ctrl[self.me]
        mine[index] = value
        mem.fence()
        for k in self.others:
            if self.ctrl[k][WAITING]:
                mem.futex_wake(self._addr[self.me] + 8 * index)
                return

    def wait(self, k: int, index: int, target: int, deadline: float, what: str) -> None:
        """Wait until member ``k``'s counter ``index`` reaches ``target``."""
        ctrl = self.ctrl[k]
        if ctrl[index] >= target:
            return
        self._block(lambda: ctrl[index] >= target, [k], deadline, what, target)

    def wait_all(self, target: int, deadline: float, what: str, index: int = STEP) -> None:
        """Wait until every peer's counter ``index`` reaches ``target``."""
        ctrls = [self.ctrl[k] for k in self.others]

        def done() -> bool:
            for c in ctrls:
                if c[index] < target:
                    return False
            return True

        if not done():
            self._block(done, self.others, deadline, what, target, index)

    def _block(self, done, members: Sequence[int], deadline: float, what: str, target: int,
               index: int = STEP) -> None:
        def behind() -> list[int]:
            return [self.ranks[k] for k in members if self.ctrl[k][index] < target]

        def expire() -> None:
            late = behind()
            raise PeerTimeout(f"rank(s) {late} stopped before step {target} of the shm collective "
                              f"(rank {self.t.rank} was waiting for {what})", late)

        def check() -> None:
            self.t.check_open()  # before behind(): close() drops the counters
            self.t.poll()  # queued point-to-point sends of this rank keep moving
            self.t.check_alive(behind(), f"{what} (step {target} of group {self.ranks})")

        mine = self.ctrl[self.me]

        def sleep_on() -> tuple[int, int]:
            self.t.check_open()
            mine[WAITING] = 1
            mem.fence()
            for k in members:
                v = int(self.ctrl[k][index])
                if v < target:
                    return self._addr[k] + 8 * index, v
            return 0, 0  # arrived meanwhile: look again instead of sleeping

        try:
            mem.block(done, deadline, expire, check, sleep_on)
        finally:
            mine[WAITING] = 0

    def exchange(self, key: str, payload: str, deadline: float) -> list[str]:
        """All-gather short strings through the board: one write, one wait, p-1 reads. Each entry
        is (key length, key, payload); a payload that does not fit is marked (length -1) and sent
        as a point-to-point message instead."""
        e = self.exchanges = self.exchanges + 1
        if e >= 3:  # my half e % 2 was last read in exchange e - 2, by peers now past e - 1
            self.wait_all(e - 1, deadline, f"the exchange before {key!r}", index=EXCH)
        kb = key.encode()
        data = struct.pack("<q", len(kb)) + kb + payload.encode()
        at = BOARD_AT + (e % 2) * BOARD_BYTES
        own = self._ctrl_segs[self.me].mm
        fits = len(data) + 8 <= BOARD_BYTES
        big = [] if fits else self.t.send_exchange(key, [self.ranks[k] for k in self.others], data)
        own[at : at + 8 + (len(data) if fits else 0)] = struct.pack("<q", len(data) if fits else -1) + (
            data if fits else b"")
        self.publish(EXCH, e)
        self.wait_all(e, deadline, f"the exchange {key!r} (metadata check or barrier)", index=EXCH)
        out = []
        for k, seg in enumerate(self._ctrl_segs):
            if k == self.me:
                out.append(payload)
                continue
            (n,) = struct.unpack_from("<q", seg.mm, at)
            raw = seg.mm[at + 8 : at + 8 + n] if n >= 0 else self.t.recv_exchange(key, self.ranks[k], deadline)
            (nk,) = struct.unpack_from("<q", raw, 0)
            if raw[8 : 8 + nk] != kb:
                raise CollectiveMismatch(
                    f"rank {self.ranks[k]} is at {raw[8 : 8 + nk].decode()!r} while rank {self.t.rank} is "
                    f"at {key!r}: the ranks called collectives (or created groups) in different orders")
            out.append(raw[8 + nk :].decode())
        for w in big:
            w.wait(max(deadline - time.monotonic(), 1e-3))
        return out

    def close(self) -> None:
        """Drop the mappings (the memory is freed once no process maps it)."""
        self._data = []
        self._views.clear()
        self._ctrl_segs = []
        self.ctrl = []


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k
