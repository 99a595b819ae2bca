"""Gradient buckets: parameters grouped into flat buffers whose slices are the ``.grad`` tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class GradBucket:
    """A flat gradient buffer and the parameters whose ``.grad`` are views into it.

    ``offsets[i]`` is where ``params[i]``'s gradient starts in ``buffer``. A communication hook
    receives the bucket and returns the averaged flat gradient (``buffer`` itself or a new tensor).
    """

    index: int
    buffer: torch.Tensor
    params: list[torch.nn.Parameter]
    offsets: list[int]
    names: list[str]
    pending: int = 0
    ready: set[int] = field(default_factory=set)  # positions in ``params`` whose grad arrived
    group: Any = None
    """The group its gradients are averaged over (None: the wrapper's)."""
    scale: float = 1.0
    """What the average is multiplied by (``grad_groups.ReduceGroup.scale``)."""

    def view(self, i: int) -> torch.Tensor:
        """The slice of ``buffer`` that is ``params[i]``'s gradient, shaped like the parameter."""
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    def views(self) -> list[torch.Tensor]:
        """Every parameter's gradient view, in bucket order."""
        return [self.view(i) for i in range(len(self.params))]


def build_buckets(named_params: list[tuple[str, torch.nn.Parameter]], cap_bytes: int,
                  dtype: torch.dtype | None = None, first_cap_bytes: int | None = None,
                  alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None) -> list[GradBucket]:
    """Fill buckets of at most ``cap_bytes`` (a parameter larger than the cap gets its own) in the
    given order, a new bucket whenever the dtype changes; buffers are zeroed. The first bucket
    may have its own, smaller cap (DDP: 1 MB), so the first reduction starts early in backward.
    ``alloc(numel, dtype, device)`` makes the buffers (DDP: ``comm.symmetric_empty`` on CPU).

    DDP's order is the reverse of registration, the order in which backward produces gradients,
    so the first bucket fills first and its reduction overlaps the rest of backward.
    """
    buckets: list[GradBucket] = []
    cur: list[tuple[str, torch.nn.Parameter]] = []
    cur_bytes = 0

    def flush() -> None:
        nonlocal cur, cur_bytes
        if not cur:
            return
        bdtype = dtype or cur[0][1].dtype
        offsets, total = [], 0
        for _, p in cur:
            offsets.append(total)
            total += p.numel()
        device = cur[0][1].device
        buf = torch.zeros(total, dtype=bdtype, device=device) if alloc is None else alloc(total, bdtype, device).zero_()
        buckets.append(GradBucket(len(buckets), buf, [p for _, p in cur], offsets, [n for n, _ in cur]))
        cur, cur_bytes = [], 0

    for name, p in named_params:
        nbytes = p.numel() * p.element_size()
        cap = first_cap_bytes if (first_cap_bytes is not None and not buckets) else cap_bytes
        if cur and (p.dtype != cur[0][1].dtype or p.device != cur[0][1].device or cur_bytes + nbytes > cap):
            flush()
        cur.append((name, p))
        cur_bytes += nbytes
    flush()
    return buckets
