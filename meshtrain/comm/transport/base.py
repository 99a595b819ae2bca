"""The transport interface: tagged point-to-point messages plus a small-metadata exchange."""

from __future__ import annotations

import abc
from typing import Sequence

import torch

from ...errors import CollectiveTimeout
from ..work import Work


class PeerTimeout(CollectiveTimeout):
    """A transport-level wait ran out of time; ``missing`` lists the global ranks not heard from."""

    def __init__(self, message: str, missing: Sequence[int]) -> None:
        super().__init__(message)
        self.missing = list(missing)

    def __reduce__(self) -> tuple:  # picklable (spawn's children send their errors to the parent)
        return (type(self), (str(self), self.missing))


class FingerprintMismatch(Exception):
    """The members' fingerprints of one call differ (raised on every member; the runner then
    exchanges the full metadata to name the ranks and what each passed)."""


class Transport(abc.ABC):
    """Moves tensors between the ranks of one world.

    Messages between a pair of ranks with the same tag are matched in the order they were posted
    (as in MPI and gloo). ``exchange`` is an all-gather of short strings, used for metadata checks
    and barriers; on timeout it raises ``PeerTimeout`` naming exactly the ranks that never posted.
    """

    kind: str = "abstract"
    rank: int
    world_size: int

    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        """Start sending a contiguous tensor to global rank ``dst``; do not modify it until done."""

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        """Start receiving into contiguous ``tensor`` (same numel and dtype as the sent one)."""

    @abc.abstractmethod
    def exchange(
        self, key: str, ranks: Sequence[int], payload: str, timeout: float
    ) -> list[str]:
        """All-gather ``payload`` among global ``ranks`` (in that order), keyed by a unique ``key``."""

    def host_id(self) -> str:
        """Identifies this rank's host (ranks with equal ids share memory)."""
        return "localhost"

    def close(self) -> None:
        """Release resources held by the transport."""
