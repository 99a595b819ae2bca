"""``symmetric_empty``: tensors the shm collectives reduce in place (see transport/shm_symmetric.py)."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..errors import CollectiveTimeout
from .call import resolve_group
from .communicator import Group
from .transport.base import PeerTimeout, on_shared_memory


def symmetric_empty(size: int | Sequence[int], dtype: torch.dtype = torch.float32,
                    group: Group | None = None) -> torch.Tensor:
    """A tensor of ``size`` (uninitialised) that the group's all-reduce reduces in place.

    Collective: every member calls it with the same size and dtype, in the same order. On the shm
    transport with the whole group on one host, the tensor lives in shared memory that every
    member maps, and ``all_reduce`` of it (or of a slice at the same place on every member)
    skips the copy into the staging buffers; it stays allocated until ``destroy()``. On any other
    transport, or for a group of one, it is a plain ``torch.empty``, so callers need no branch;
    so it is, with a ``RuntimeWarning``, when /dev/shm has no room for every member's tensor.
    """
    g = resolve_group(group)
    shape = (size,) if isinstance(size, int) else tuple(size)
    numel = 1
    for s in shape:
        if not isinstance(s, int) or s < 0:
            raise ValueError(f"symmetric_empty: invalid size {size!r}: use non-negative integers")
        numel *= s
    t = g.comm.transport
    if g.size == 1 or not on_shared_memory(t, g.ranks) or numel == 0:
        return torch.empty(shape, dtype=dtype)
    try:
        flat = t.symmetric.allocate(g.ranks, numel, dtype, time.monotonic() + g.timeout)
        if flat is None:  # /dev/shm too small for all members' tensors (warned)
            return torch.empty(shape, dtype=dtype)
    except PeerTimeout as exc:
        raise CollectiveTimeout(
            f"symmetric_empty on group {g.gid} (ranks {g.ranks}) timed out after {g.timeout:g}s on rank "
            f"{g.comm.rank}: {exc}. Every member must call symmetric_empty with the same size, in the "
            f"same order.") from None
    return flat.view(shape)
