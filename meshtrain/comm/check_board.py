"""The metadata check of a torch-transport group whose ranks share one host, on a shared board.

On the torch transport the check used to be an all-gather through the TCPStore: two or three
round trips to the store per collective, as much as a small gloo collective itself. When every
member of a group runs on this host, each member instead owns a small /dev/shm segment (the
board) and writes each call's sequence number and metadata fingerprint into slot ``seq % SLOTS``
of it: a few loads and stores where the store took round trips. meshtrain's algorithms wait
(spin, yield, futex: ``shm_memory.block``) until every peer's slot holds the same call before
any data moves. Torch's own op starts as soon as every peer that has posted matches (``Ahead``):
gloo handed mismatched sizes can abort a process from its own thread ("Received data size
doesn't match"), and this way two members whose calls differ never both enter it.

A difference sends every member to the store exchange of the full metadata, which names the
ranks and what each passed. Call ``s`` uses slot ``s % SLOTS``; a rank reuses a slot only once
every peer has compared the call that used it before (``VERIFIED``), so no slot is overwritten
before it was read. Across hosts the store exchange stays: the board needs one /dev/shm.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import Any, Sequence

from .algorithms import native
from .transport import shm_memory as mem
from .transport.base import FingerprintMismatch, PeerTimeout, capabilities

SLOTS = 64
LATEST, WAITING, VERIFIED = 0, 8, 16  # int64 counters, a cache line apart
SLOT_AT = 24  # slot i: (seq, fingerprint) at SLOT_AT + 2 i
WORDS = SLOT_AT + 2 * SLOTS


def usable(transport: Any, hosts: Sequence[str]) -> bool:
    """True if a group of a transport with torch's own collectives (the torch transport) on
    ``hosts`` can check on a board: all on this host, with a writable /dev/shm
    (``MESHTRAIN_CHECK_BOARD=0`` turns it off)."""
    # native_collectives, not a name: the board exists so that torch's own op starts only once the
    # members' calls match (``Ahead``), and such a transport's check otherwise goes through its store
    return (capabilities(transport).native_collectives and len(hosts) > 1 and len(set(hosts)) == 1
            and os.environ.get("MESHTRAIN_CHECK_BOARD", "1") != "0" and os.access(mem.SHM_DIR, os.W_OK))


def build(transport: Any, ranks: Sequence[int], me: int, key: str, timeout: float) -> "CheckBoard | None":
    """The group's board (collective: every member calls it at the same call), or None on every
    member if any of them cannot create or map the segments (one host id but separate /dev/shm,
    as in containers that share a kernel; a full /dev/shm): the check then stays on the store."""
    try:
        own: mem.Segment | None = mem.Segment.create(f"{mem.PREFIX}{os.getpid()}.board.{uuid.uuid4().hex[:16]}",
                                                     8 * WORDS)
    except OSError:
        own = None
    try:
        names = transport.exchange(f"{key}/names", list(ranks), own.name if own is not None else "", timeout)
        segs = [own if k == me else (mem.Segment.open(n) if n else None) for k, n in enumerate(names)]
        mapped = all(s is not None for s in segs)
        verdicts = transport.exchange(f"{key}/mapped", list(ranks), "ok" if mapped else "no", timeout)
    finally:
        if own is not None:
            own.unlink()  # every member has answered: no one opens it by name any more
    return CheckBoard(list(ranks), me, segs) if all(v == "ok" for v in verdicts) else None


def checks_first(group: Any) -> bool:
    """True if ``group``'s metadata check runs on a board, before any data moves (its board is
    built, or will be on its first call); the same answer on every member."""
    if getattr(group, "board_built", False):
        return group.board is not None
    known = getattr(group, "board_usable", None)  # asked on every auto call: /dev/shm is looked at once
    if known is None:
        known = group.board_usable = usable(group.comm.transport, group.hosts)
    return known


class CheckBoard:
    """The board of one group, over every member's mapped segment (built by ``build``)."""

    def __init__(self, ranks: list[int], me: int, segs: list[mem.Segment]) -> None:
        self.ranks, self.me = ranks, me
        self.others = [k for k in range(len(ranks)) if k != me]
        self._segs = segs
        self.words = [s.i64(0, WORDS) for s in segs]
        self._peers = [self.words[k] for k in self.others]  # the others' words: every call reads them
        self._slot_seq = [0] * SLOTS  # the call that last used each of my slots
        self._addr = [w.ctypes.data for w in self.words]

    # -- writing -----------------------------------------------------------------------------------
    def post(self, seq: int, fp: int, deadline: float) -> None:
        """Post call ``seq``'s fingerprint, once every peer has compared the call that used its
        slot before (``SLOTS`` or more calls ago: calls with the check off post nothing)."""
        before = self._slot_seq[seq % SLOTS]
        if before and not all(w[VERIFIED] >= before for w in self._peers):
            self._wait(lambda k: self.words[k][VERIFIED] >= before, deadline, f"call {before} compared",
                       VERIFIED, before)
        self._slot_seq[seq % SLOTS] = seq
        mine = self.words[self.me]
        at = SLOT_AT + 2 * (seq % SLOTS)
        mine[at + 1] = fp
        mem.store_fence()  # the fingerprint is visible before the sequence number that vouches for it
        mine[at] = seq
        self._publish(LATEST, seq)

    def compared(self, seq: int) -> None:
        """Tell the peers this rank is done reading call ``seq``'s slots."""
        self._publish(VERIFIED, seq)

    def _publish(self, index: int, value: int) -> None:
        mine = self.words[self.me]
        mine[index] = value
        mem.fence()  # the store before the look at the sleepers' flags (see ShmArea.publish)
        for w in self._peers:
            if w[WAITING]:
                mem.futex_wake(self._addr[self.me] + 8 * index)
                return

    # -- reading -----------------------------------------------------------------------------------
    def differs(self, seq: int, fp: int) -> bool:
        """After ``wait_posted(seq)``: True if a peer's slot holds another call or fingerprint."""
        at = SLOT_AT + 2 * (seq % SLOTS)
        mem.fence()
        return any(w[at] != seq or w[at + 1] != fp for w in self._peers)

    def settle(self, seq: int, fp: int, deadline: float, what: str) -> None:
        """Wait until every peer posted ``seq``; FingerprintMismatch if one posted another call."""
        if not all(w[LATEST] >= seq for w in self._peers):
            self.wait_posted(seq, deadline, what)
        if self.differs(seq, fp):
            raise FingerprintMismatch()

    def verdict(self, seq: int, fp: int) -> tuple[bool, bool]:
        """(a peer that posted ``seq`` differs, every peer posted it), without waiting."""
        at = SLOT_AT + 2 * (seq % SLOTS)
        mem.fence()  # after my post (Dekker): of two ranks posting at once, one sees the other's
        everyone = True
        for w in self._peers:
            if w[LATEST] < seq:
                everyone = False
            elif w[at] != seq or w[at + 1] != fp:
                return True, everyone
        return False, everyone

    def wait_posted(self, seq: int, deadline: float, what: str) -> None:
        """Wait until every peer posted ``seq``; PeerTimeout naming those that never did."""
        self._wait(lambda k: self.words[k][LATEST] >= seq, deadline, what, LATEST, seq)

    def _wait(self, ok, deadline: float, what: str, index: int, target: int) -> None:
        if all(ok(k) for k in self.others):
            return
        mine = self.words[self.me]

        def expire() -> None:
            late = [self.ranks[k] for k in self.others if not ok(k)]
            raise PeerTimeout(f"rank(s) {late} never got to {what}", late, never_arrived=True)

        def sleep_on() -> tuple[int, int]:
            mine[WAITING] = 1
            mem.fence()
            for k in self.others:
                v = int(self.words[k][index])
                if v < target:
                    return self._addr[k] + 8 * index, v
            return 0, 0

        try:
            mem.block(lambda: all(ok(k) for k in self.others), deadline, expire, lambda: None, sleep_on)
        finally:
            mine[WAITING] = 0

    def close(self) -> None:
        """Drop the mappings."""
        self.words, self._segs, self._peers = [], [], []


class Ahead:
    """Waits for a torch op that a rank issued before every peer had posted the call (``runner``).

    A rank runs torch's op at once if every peer that has posted the call matches it; the fence in
    ``verdict`` means that of any two members at least one saw the other's post and compared it.
    So two members whose calls differ never both enter gloo (which, handed mismatched sizes, can
    abort a process), and an op that completes had every member in it, all matching. The early
    rank therefore sleeps in torch's own wait, and looks at the board only when that wait has
    lasted WATCH_S: a peer that posted another call ends it (FingerprintMismatch; the runner names
    the ranks), a peer that never posts is named at the deadline. Torch's group then holds an op
    some ranks never joined, as after any mismatched collective in torch.distributed: it is not
    usable afterwards."""

    WATCH_S = 0.02
    """How long torch's wait runs before each look at the board (a mismatch is named this late)."""

    def __init__(self, board: CheckBoard, seq: int, fp: int, deadline: float, what: str) -> None:
        self.board, self.seq, self.fp, self.deadline, self.what = board, seq, fp, deadline, what

    def wait(self, work: Any, nbytes: int = 0, future: bool | None = None) -> None:
        """Wait for ``work`` (of ``nbytes``: see ``native.polled``): raise FingerprintMismatch if a
        peer posts another call first. ``future``: whether the work has a future (None: ask it)."""
        if not native.has_future(work, future):  # such gloo works complete only inside wait(): check first
            self.board.settle(self.seq, self.fp, self.deadline, self.what)
            work.wait()
            return
        if native.polled(work, nbytes):  # a small op ends within the poll (see native.finish)
            self._finish(work)
            return
        watch = timedelta(seconds=self.WATCH_S)
        while True:
            try:
                work.wait(timeout=watch)  # a timed wait leaves the op running (torch's Work.wait)
                return
            except RuntimeError:
                if work.is_completed():  # ended as the watch ran out: its own result or error
                    self._finish(work)
                    return
            bad, everyone = self.board.verdict(self.seq, self.fp)
            if bad:
                raise FingerprintMismatch()
            if everyone:  # every member posted the same call: the op completes or fails on its own
                work.wait()
                return
            if time.monotonic() >= self.deadline:
                self.board.wait_posted(self.seq, self.deadline, self.what)  # PeerTimeout naming them

    def _finish(self, work: Any) -> None:
        """The completed op's result, or its error; a peer that never posted is named first."""
        try:
            work.wait()
        except RuntimeError:
            if not self.board.verdict(self.seq, self.fp)[1]:
                self.board.wait_posted(self.seq, self.deadline, self.what)
            raise
