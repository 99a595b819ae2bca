"""Symmetric memory on one host: a tensor per member of a group, allocated together, in shared
memory that every member maps (``meshtrain.comm.symmetric_empty``).

The shm all-reduce (``algorithms/shm_direct.py``) reads a symmetric tensor's peers in place: no
copy into the staging buffers, no chunking, three synchronisations per call whatever its size.
This is what NCCL's registered buffers and torch's CUDA ``SymmetricMemory`` do for GPUs. DDP's
gradient buckets are allocated here when their group is on one host's shared memory.

Allocations are collective (every member, same size, same order) and live until ``destroy()``:
their names are unlinked once every member has mapped them, so nothing outlives the processes.
"""

from __future__ import annotations

import time
import warnings
from typing import Protocol, Sequence

import torch

from . import shm_memory as mem
from .shm_area import ShmArea


HEADROOM_BYTES = 16 << 20  # left free for the staging buffers and slots of groups made later


class SymmetricHost(Protocol):
    """What symmetric allocations need from the transport of their members (``ShmTransport``)."""

    def exchange(self, key: str, ranks: Sequence[int], payload: str, timeout: float) -> list[str]:
        """All-gather ``payload`` among ``ranks``."""
        ...

    def area(self, ranks: Sequence[int], name: str, deadline: float) -> ShmArea:
        """The shared buffers of ``ranks`` named ``name``, made collectively on first use."""
        ...


class SymmetricRegistry:
    """The symmetric allocations of one process, per group (kept on the shm transport)."""

    def __init__(self, t: SymmetricHost) -> None:
        self.t = t
        self.count: dict[tuple[int, ...], int] = {}
        self.allocs: list[tuple[tuple[int, ...], int, int, ShmArea]] = []  # ranks, address, bytes, area

    def allocate(self, ranks: Sequence[int], numel: int, dtype: torch.dtype,
                 deadline: float) -> torch.Tensor | None:
        """Collectively allocate ``numel`` elements of ``dtype`` on every member of ``ranks``.
        None on every member if /dev/shm lacks room for all of them (the caller falls back)."""
        key = tuple(ranks)
        n = self.count[key] = self.count.get(key, 0) + 1
        nbytes = numel * dtype.itemsize
        # Every member's segment lands in the same /dev/shm, so all decide on the least free
        # space any of them saw: all fall back together, never one symmetric and one plain.
        need = (nbytes + 4095) // 4096 * 4096 * len(ranks) + HEADROOM_BYTES
        seen = self.t.exchange(f"sym/space/{n}", list(ranks), str(mem.free_bytes()),
                               max(deadline - time.monotonic(), 1e-3))
        free = min(int(v) for v in seen)
        if free < need:
            warnings.warn(
                f"symmetric_empty #{n} on ranks {list(ranks)}: {mem.SHM_DIR} has {free} "
                f"bytes free and the members' tensors need {need}; using plain tensors (the all-reduce "
                f"copies through the staging buffers). Give {mem.SHM_DIR} more space (docker run "
                f"--shm-size) to reduce them in place.", RuntimeWarning, stacklevel=3)
            return None
        area = self.t.area(ranks, f"y{n}", deadline)
        area.halves = 1
        area.reserve(max(nbytes, 1), 0, deadline)
        sizes = [area.segment_bytes(k) for k in range(len(ranks))]
        if len(set(sizes)) > 1:
            raise ValueError(
                f"symmetric_empty #{n} on ranks {list(ranks)}: the members asked for different sizes "
                f"(segment bytes by member: {sizes}); every member must allocate the same numel and dtype")
        tensor = area.view(area.me, 0, 0, numel, dtype)
        self.allocs.append((key, tensor.data_ptr(), nbytes, area))
        return tensor

    def find(self, tensor: torch.Tensor, ranks: Sequence[int]) -> tuple[ShmArea, int] | None:
        """(area, byte offset) if contiguous ``tensor`` lies inside a symmetric allocation of
        ``ranks``; None otherwise."""
        if not self.allocs or not tensor.is_contiguous():
            return None
        key = tuple(ranks)
        lo = tensor.data_ptr()
        hi = lo + tensor.numel() * tensor.element_size()
        for r, base, size, area in self.allocs:
            if r == key and base <= lo and hi <= base + size:
                return area, lo - base
        return None
