"""Ranks as threads of one process: a simulated cluster for tests and teaching.

Sends copy the tensor into the receiver's inbox and complete at once (eager, buffered); receives
block on a condition variable until the matching message arrives. Each (src, dst, tag) stream is
numbered so a receive takes exactly the message posted in the same position, whatever order the
receiver waits in.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Sequence

import torch

from ...errors import CollectiveError, CollectiveMismatch
from ..work import Work, completed_work
from .. import shake
from .base import PeerTimeout, Transport
from .registry import Capabilities, Setup, TransportSpec, register


class _Inbox:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.messages: dict[tuple[int, int, int], torch.Tensor] = {}  # (src, tag, msg_no) -> data


class LocalWorld:
    """State shared by the threads of one simulated world: inboxes, the exchange board, abort."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.inboxes = [_Inbox() for _ in range(world_size)]
        self.board_cond = threading.Condition()
        self.board: dict[str, dict[int, str]] = {}
        self.board_reads: dict[str, int] = defaultdict(int)
        self.abort_reason: str | None = None

    def abort(self, reason: str) -> None:
        """Wake every waiting rank with an error (used when one rank's function raised)."""
        self.abort_reason = reason
        for box in self.inboxes:
            with box.cond:
                box.cond.notify_all()
        with self.board_cond:
            self.board_cond.notify_all()

    def check_abort(self) -> None:
        """Raise if the world was aborted."""
        if self.abort_reason is not None:
            raise CollectiveError(f"the local world was aborted: {self.abort_reason}")

    def transports(self) -> list["LocalTransport"]:
        """One transport per rank."""
        return [LocalTransport(self, r) for r in range(self.world_size)]


class _LocalRecvWork(Work):
    def __init__(self, world: LocalWorld, dst: int, src: int, tag: int, no: int, out: torch.Tensor):
        super().__init__(f"recv from rank {src} (tag {tag})")
        self._world, self._dst, self._key, self._out = world, dst, (src, tag, no), out

    def _progress(self, timeout: float | None) -> bool:
        if self._done.is_set():
            return True
        box = self._world.inboxes[self._dst]
        deadline = None if timeout is None else time.monotonic() + timeout
        with box.cond:
            while self._key not in box.messages:
                self._world.check_abort()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if timeout == 0:
                        return False
                    src = self._key[0]
                    raise PeerTimeout(f"rank {self._dst} got no message from rank {src}", [src])
                box.cond.wait(remaining)
            data = box.messages.pop(self._key)
        if data.numel() != self._out.numel() or data.dtype != self._out.dtype:
            exc = CollectiveMismatch(
                f"rank {self._key[0]} sent {data.numel()} elements of {data.dtype} but rank "
                f"{self._dst} expected {self._out.numel()} elements of {self._out.dtype}"
            )
            self._finish(exc=exc)
        else:
            self._out.view(-1).copy_(data.view(-1))
            self._finish(self._out)
        return True


class LocalTransport(Transport):
    """The transport of one rank (thread) of a ``LocalWorld``."""

    kind = "local"

    def __init__(self, world: LocalWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self._send_no: dict[tuple[int, int], int] = defaultdict(int)
        self._recv_no: dict[tuple[int, int], int] = defaultdict(int)

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer rank {peer} out of range: valid ranks are 0..{self.world_size - 1}")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        self._check_peer(dst)
        self.world.check_abort()
        if shake.ACTIVE is not None:  # a send posted late, as a descheduled thread's would be
            shake.ACTIVE.pause(self.rank)
        no = self._send_no[(dst, tag)]
        self._send_no[(dst, tag)] = no + 1
        box = self.world.inboxes[dst]
        data = tensor.detach().clone()
        with box.cond:
            box.messages[(self.rank, tag, no)] = data
            box.cond.notify_all()
        return completed_work(tensor, f"send to rank {dst}")

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        self._check_peer(src)
        no = self._recv_no[(src, tag)]
        self._recv_no[(src, tag)] = no + 1
        return _LocalRecvWork(self.world, self.rank, src, tag, no, tensor)

    def exchange(self, key: str, ranks: Sequence[int], payload: str, timeout: float) -> list[str]:
        w = self.world
        deadline = time.monotonic() + timeout
        with w.board_cond:
            posted = w.board.setdefault(key, {})
            posted[self.rank] = payload
            w.board_cond.notify_all()
            while len(posted) < len(ranks):
                w.check_abort()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [r for r in ranks if r not in posted]
                    raise PeerTimeout(f"ranks {missing} never arrived", missing, never_arrived=True)
                w.board_cond.wait(remaining)
            values = [posted[r] for r in ranks]
            w.board_reads[key] += 1
            if w.board_reads[key] == len(ranks):  # last reader cleans up
                del w.board[key], w.board_reads[key]
        return values


def _build(setup: Setup) -> LocalTransport:
    """One thread's transport in ``run_local``'s world."""
    return LocalTransport(setup.world, setup.rank)


SPEC = register(TransportSpec(
    name=LocalTransport.kind, build=_build,
    capabilities=Capabilities(cpu_only=False, ranks_are_threads=True),
    cost_model=(30e-6, 1 / 3e9, 1 / 4e9),  # threads never calibrate implicitly: these stay
))
