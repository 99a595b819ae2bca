"""``Ctx``: what an algorithm sees of its group — ranks 0..size-1, tagged p2p with a deadline."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..transport.base import PeerTimeout, Transport
from ..work import Work, completed_work


class BufferPool:
    """Scratch buffers reused across calls, keyed by name and dtype, grown on demand."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements; its contents are undefined."""
        key = (name, dtype, torch.device(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:numel]

    def nbytes(self) -> int:
        """Bytes held by the pool."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


class Ctx:
    """One collective call as an algorithm sees it.

    ``rank`` and peers are indices into ``ranks`` (the group's global ranks); every wait is bounded
    by the collective's deadline; bytes sent are counted for ``meshtrain.comm.stats()``.
    """

    def __init__(
        self,
        transport: Transport,
        ranks: Sequence[int],
        rank: int,
        tag: int,
        deadline: float,
        pool: BufferPool,
        hosts: Sequence[str] | None = None,
        counter: list[int] | None = None,
    ) -> None:
        self.transport = transport
        # A group's own lists are taken as they are (no algorithm changes them): the copies cost
        # ~0.5 us of every call's front end.
        self.ranks = ranks if type(ranks) is list else list(ranks)
        self.rank = rank
        self.size = len(self.ranks)
        self.tag = tag
        self.deadline = deadline
        self.pool = pool
        self.hosts = (hosts if type(hosts) is list else list(hosts)) if hosts is not None else ["localhost"] * self.size
        self._counter = counter if counter is not None else [0]
        # The call's metadata fingerprint, when the algorithm checks it itself in its first
        # synchronisation (the shm collectives); the algorithm sets it to None once checked.
        self.fingerprint: int | None = None

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank has sent in this collective so far."""
        return self._counter[0]

    def remaining(self) -> float:
        """Seconds left before the collective's deadline (at least a tiny positive value)."""
        return max(self.deadline - time.monotonic(), 1e-3)

    def isend(self, tensor: torch.Tensor, peer: int) -> Work:
        """Start sending a contiguous tensor to group rank ``peer``."""
        if tensor.numel() == 0:  # both sides know the size, so both skip empty messages
            return completed_work(tensor)
        self._counter[0] += tensor.numel() * tensor.element_size()
        return self.transport.isend(tensor, self.ranks[peer], self.tag)

    def irecv(self, tensor: torch.Tensor, peer: int) -> Work:
        """Start receiving into a contiguous tensor from group rank ``peer``."""
        if tensor.numel() == 0:
            return completed_work(tensor)
        return self.transport.irecv(tensor, self.ranks[peer], self.tag)

    def wait(self, work: Work) -> None:
        """Wait for ``work`` until the collective's deadline."""
        if time.monotonic() >= self.deadline and not work.is_completed():
            raise PeerTimeout(f"deadline passed while waiting for {work.description}", [])
        work.wait(self.remaining())

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Blocking send."""
        self.wait(self.isend(tensor, peer))

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        """Blocking receive into ``tensor``."""
        self.wait(self.irecv(tensor, peer))

    def sendrecv(self, send_t: torch.Tensor, dst: int, recv_t: torch.Tensor, src: int) -> None:
        """Send to ``dst`` and receive from ``src`` at the same time (no deadlock in a ring)."""
        r = self.irecv(recv_t, src)
        s = self.isend(send_t, dst)
        self.wait(r)
        self.wait(s)

    def scratch(self, name: str, numel: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """A reusable scratch buffer (contents undefined)."""
        return self.pool.get(name, numel, dtype, device or torch.device("cpu"))

    def sub(self, members: Sequence[int]) -> "Ctx":
        """A view of the subset ``members`` (indices in this ctx); this rank must be one of them."""
        members = list(members)
        return Ctx(
            self.transport,
            [self.ranks[m] for m in members],
            members.index(self.rank),
            self.tag,
            self.deadline,
            self.pool,
            [self.hosts[m] for m in members],
            self._counter,
        )


def even_bounds(numel: int, parts: int) -> list[int]:
    """Boundaries splitting ``numel`` into ``parts`` contiguous chunks whose sizes differ by <= 1."""
    q, r = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + q + (1 if i < r else 0))
    return bounds
