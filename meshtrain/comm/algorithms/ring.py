"""Ring algorithms: bandwidth-optimal reduce-scatter + all-gather, and a pipelined chain broadcast.

Ring all-reduce costs 2(p-1)·α + 2((p-1)/p)·n·β + ((p-1)/p)·n·γ. Each step's chunk is cut into
segments: all segment receives are posted at once and each segment is reduced as soon as it lands,
so the reduction of one segment overlaps the transfer of the next.
"""

from __future__ import annotations

import torch

from ..types import ReduceOp, combine_
from .base import Ctx, even_bounds

SEGMENT_BYTES = 1 << 20  # 1 MiB: big enough to amortise per-message cost, small enough to overlap


def _segments(lo: int, hi: int, elem: int) -> list[tuple[int, int]]:
    seg = max(SEGMENT_BYTES // elem, 1)
    return [(s, min(s + seg, hi)) for s in range(lo, hi, seg)]  # empty range: no message


def reduce_scatter_bounds(ctx: Ctx, buf: torch.Tensor, bounds: list[int], op: ReduceOp) -> None:
    """Ring reduce-scatter: afterwards chunk ``ctx.rank`` of ``buf`` (by ``bounds``) holds the result."""
    p, r = ctx.size, ctx.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    biggest = max(bounds[i + 1] - bounds[i] for i in range(p))
    tmp = ctx.scratch("ring_rs", biggest, buf.dtype, buf.device)
    elem = buf.element_size()
    for step in range(p - 1):
        send_c = (r - step - 1) % p
        recv_c = (r - step - 2) % p
        s_lo, s_hi = bounds[send_c], bounds[send_c + 1]
        r_lo, r_hi = bounds[recv_c], bounds[recv_c + 1]
        segs = _segments(r_lo, r_hi, elem)
        recvs = [ctx.irecv(tmp[a - r_lo : b - r_lo], left) for a, b in segs]
        sends = [ctx.isend(buf[a:b], right) for a, b in _segments(s_lo, s_hi, elem)]
        for (a, b), w in zip(segs, recvs):
            ctx.wait(w)
            combine_(buf[a:b], tmp[a - r_lo : b - r_lo], op)
        for w in sends:
            ctx.wait(w)


def all_gather_bounds(ctx: Ctx, buf: torch.Tensor, bounds: list[int]) -> None:
    """Ring all-gather: rank i's chunk ``i`` (by ``bounds``) ends up on every rank."""
    p, r = ctx.size, ctx.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    elem = buf.element_size()
    for step in range(p - 1):
        send_c = (r - step) % p
        recv_c = (r - step - 1) % p
        recvs = [ctx.irecv(buf[a:b], left) for a, b in _segments(bounds[recv_c], bounds[recv_c + 1], elem)]
        sends = [ctx.isend(buf[a:b], right) for a, b in _segments(bounds[send_c], bounds[send_c + 1], elem)]
        for w in recvs + sends:
            ctx.wait(w)


def all_reduce(ctx: Ctx, buf: torch.Tensor, op: ReduceOp) -> None:
    """Ring all-reduce: reduce-scatter then all-gather over ``p`` near-equal chunks."""
    bounds = even_bounds(buf.numel(), ctx.size)
    reduce_scatter_bounds(ctx, buf, bounds, op)
    all_gather_bounds(ctx, buf, bounds)


def reduce_scatter(ctx: Ctx, buf: torch.Tensor, op: ReduceOp) -> None:
    """``buf`` holds p equal chunks; afterwards chunk ``rank`` holds the reduction of everyone's."""
    n = buf.numel() // ctx.size
    reduce_scatter_bounds(ctx, buf, [i * n for i in range(ctx.size + 1)], op)


def all_gather(ctx: Ctx, buf: torch.Tensor) -> None:
    """``buf`` holds p equal chunks, this rank's already in place; fills in the others."""
    n = buf.numel() // ctx.size
    all_gather_bounds(ctx, buf, [i * n for i in range(ctx.size + 1)])


def broadcast(ctx: Ctx, buf: torch.Tensor, root: int) -> None:
    """Pipelined chain from ``root`` around the ring, segment by segment."""
    p = ctx.size
    if p == 1:
        return
    vr = (ctx.rank - root) % p
    nxt, prv = (ctx.rank + 1) % p, (ctx.rank - 1) % p
    segs = _segments(0, buf.numel(), buf.element_size())
    recvs = [ctx.irecv(buf[a:b], prv) for a, b in segs] if vr != 0 else [None] * len(segs)
    sends = []
    for (a, b), w in zip(segs, recvs):
        if w is not None:
            ctx.wait(w)
        if vr != p - 1:
            sends.append(ctx.isend(buf[a:b], nxt))
    for w in sends:
        ctx.wait(w)


def reduce(ctx: Ctx, buf: torch.Tensor, op: ReduceOp, root: int) -> None:
    """Ring reduce-scatter, then every rank sends its reduced chunk to ``root``."""
    p, r = ctx.size, ctx.rank
    bounds = even_bounds(buf.numel(), p)
    reduce_scatter_bounds(ctx, buf, bounds, op)
    if r == root:
        works = [ctx.irecv(buf[bounds[i] : bounds[i + 1]], i) for i in range(p) if i != root]
        for w in works:
            ctx.wait(w)
    else:
        ctx.send(buf[bounds[r] : bounds[r + 1]], root)
