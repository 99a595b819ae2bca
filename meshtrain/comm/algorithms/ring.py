"""Ring algorithms: bandwidth-optimal reduce-scatter + all-gather, and a pipelined chain broadcast.

Ring all-reduce costs 2(p-1)·α + 2((p-1)/p)·n·β + ((p-1)/p)·n·γ. Chunks are cut into segments
and every segment is forwarded as soon as it has arrived and been reduced (see ``_pipelined``), so
reductions and the 2(p-1) steps overlap with the transfers.
"""

from __future__ import annotations

import torch

from ..types import ReduceOp, combine_
from .base import Ctx, even_bounds

SEGMENT_BYTES = 4 << 20  # 4 MiB: a gloo p2p message costs ~100 us, so few large segments win (docs/benchmarks.md)


def _segments(lo: int, hi: int, elem: int) -> list[tuple[int, int]]:
    seg = max(SEGMENT_BYTES // elem, 1)
    return [(s, min(s + seg, hi)) for s in range(lo, hi, seg)]  # empty range: no message


def _pipelined(ctx: Ctx, buf: torch.Tensor, bounds: list[int], op: ReduceOp | None,
               reduce_steps: int, gather_steps: int) -> None:
    """The ring engine: ``reduce_steps`` reduce-scatter steps, then ``gather_steps`` all-gather steps.

    At every step t a rank receives chunk rc(t) from the left and sends chunk sc(t) to the right,
    and sc(t+1) == rc(t) in both phases (and across the phase boundary). So each segment is
    forwarded the moment it has been received (and reduced): steps overlap instead of waiting
    for one another. Receives are posted one step ahead; reduce-scatter receives alternate
    between two scratch slots, all-gather receives land in ``buf`` directly.
    """
    p, r = ctx.size, ctx.rank
    total = reduce_steps + gather_steps
    if p == 1 or total == 0:
        return
    right, left = (r + 1) % p, (r - 1) % p
    elem = buf.element_size()
    biggest = max(bounds[i + 1] - bounds[i] for i in range(p))
    slots = ctx.scratch("ring_rs", 2 * biggest, buf.dtype, buf.device) if reduce_steps else None
    # Chunk indices: the reduce-scatter ends with chunk r complete on rank r.
    rc = [(r - t - 2) % p if t < reduce_steps else (r - (t - reduce_steps) - 1) % p for t in range(total)]
    sc0 = (r - 1) % p if reduce_steps else r
    pending: dict[int, list] = {}  # chunk -> sends still reading it

    def post_recvs(t: int) -> list:
        lo, hi = bounds[rc[t]], bounds[rc[t] + 1]
        if t < reduce_steps:
            base = (t % 2) * biggest - lo
            return [ctx.irecv(slots[a + base : b + base], left) for a, b in _segments(lo, hi, elem)]
        for w in pending.pop(rc[t], []):  # never overwrite data a send still reads
            ctx.wait(w)
        return [ctx.irecv(buf[a:b], left) for a, b in _segments(lo, hi, elem)]

    recvs = post_recvs(0)
    pending[sc0] = [ctx.isend(buf[a:b], right) for a, b in _segments(bounds[sc0], bounds[sc0 + 1], elem)]
    for t in range(total):
        nxt = post_recvs(t + 1) if t + 1 < total else []
        c = rc[t]
        lo = bounds[c]
        forward = []
        for (a, b), w in zip(_segments(lo, bounds[c + 1], elem), recvs):
            ctx.wait(w)
            if t < reduce_steps:
                base = (t % 2) * biggest - lo
                combine_(buf[a:b], slots[a + base : b + base], op)
            if t + 1 < total:
                forward.append(ctx.isend(buf[a:b], right))
        if forward:
            pending.setdefault(c, []).extend(forward)
        recvs = nxt
    for works in pending.values():
        for w in works:
            ctx.wait(w)


def reduce_scatter_bounds(ctx: Ctx, buf: torch.Tensor, bounds: list[int], op: ReduceOp) -> None:
    """Ring reduce-scatter: afterwards chunk ``ctx.rank`` of ``buf`` (by ``bounds``) holds the result."""
    _pipelined(ctx, buf, bounds, op, ctx.size - 1, 0)


def all_gather_bounds(ctx: Ctx, buf: torch.Tensor, bounds: list[int]) -> None:
    """Ring all-gather: rank i's chunk ``i`` (by ``bounds``) ends up on every rank."""
    _pipelined(ctx, buf, bounds, None, 0, ctx.size - 1)


def all_reduce(ctx: Ctx, buf: torch.Tensor, op: ReduceOp) -> None:
    """Ring all-reduce: reduce-scatter then all-gather over ``p`` near-equal chunks."""
    _pipelined(ctx, buf, even_bounds(buf.numel(), ctx.size), op, ctx.size - 1, ctx.size - 1)


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
