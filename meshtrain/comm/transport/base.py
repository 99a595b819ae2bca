"""The transport interface: tagged point-to-point messages plus a small-metadata exchange."""

from __future__ import annotations

import abc
import os
from typing import Any, Sequence

import torch

from ...errors import CollectiveTimeout
from ..work import Work
# The registry (and the Capabilities each entry declares) lives in registry.py; these names are
# re-exported here, where callers have always imported them.
from .registry import Capabilities, capabilities  # noqa: F401


class PeerTimeout(CollectiveTimeout):
    """A transport-level wait ran out of time; ``missing`` lists the global ranks not heard from.
    ``never_arrived``: they never entered the call (a rank that skipped or has not reached it),
    as opposed to a peer that stalled mid-operation after every rank arrived."""

    def __init__(self, message: str, missing: Sequence[int], never_arrived: bool = False) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.never_arrived = never_arrived

    def __reduce__(self) -> tuple:  # picklable (spawn's children send their errors to the parent)
        return (type(self), (str(self), self.missing, self.never_arrived))


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def p2p_timeout(description: str, seconds: float, exc: BaseException) -> CollectiveTimeout:
    """The error of a user's send/recv that did not complete within its group's timeout."""
    return CollectiveTimeout(f"{description} timed out after {seconds:g}s: {exc}. Check that the peer posts "
                             "the matching send/recv with the same tag.")


class FingerprintMismatch(Exception):
    """The members' fingerprints of one call differ (raised on every member; the runner then
    exchanges the full metadata to name the ranks and what each passed)."""


def on_shared_memory(transport: Any, ranks: Sequence[int]) -> bool:
    """True if every rank of ``ranks`` is on this rank's host with shared buffers between them
    (the shm collectives, symmetric memory and the fused fingerprint check can run)."""
    return capabilities(transport).shared_memory and transport.is_local(ranks)


class Transport(abc.ABC):
    """Moves tensors between the ranks of one world.

    Messages between a pair of ranks with the same tag are matched in the order they were posted
    (as in MPI and gloo). ``exchange`` is an all-gather of short strings, used for metadata checks
    and barriers; on timeout it raises ``PeerTimeout`` naming exactly the ranks that never posted.
    """

    kind: str = "abstract"  # the name of its registry entry (registry.py)
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
