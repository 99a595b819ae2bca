"""Recursive doubling, recursive halving-doubling (Rabenseifner) and Bruck's all-gather.

Non-power-of-two sizes use the standard fold (Thakur, Rabenseifner & Gropp 2005): with
p' = 2^floor(lg p) and rem = p - p', among the first 2·rem ranks each even rank hands its data to
the odd rank above it and sits out; the p' remaining ranks run the power-of-two algorithm; the
result is handed back. Partners always compute a⊕b and b⊕a, which are bitwise equal, so every rank
ends with identical results.
"""

from __future__ import annotations

import torch

from ..types import ReduceOp, combine_
from .base import Ctx, even_bounds


def _fold_in(ctx: Ctx, buf: torch.Tensor, op: ReduceOp) -> tuple[int, int, int]:
    """Fold p down to p' ranks. Returns (p', rem, newrank) with newrank -1 for ranks sitting out."""
    p, r = ctx.size, ctx.rank
    pp = 1 << (p.bit_length() - 1)
    rem = p - pp
    if r < 2 * rem:
        if r % 2 == 0:
            ctx.send(buf, r + 1)
            return pp, rem, -1
        tmp = ctx.scratch("rd_fold", buf.numel(), buf.dtype, buf.device)
        ctx.recv(tmp, r - 1)
        combine_(buf, tmp, op)
        return pp, rem, r // 2
    return pp, rem, r - rem


def _real(newrank: int, rem: int) -> int:
    return newrank * 2 + 1 if newrank < rem else newrank + rem


def _fold_out(ctx: Ctx, buf: torch.Tensor, rem: int) -> None:
    r = ctx.rank
    if r < 2 * rem:
        if r % 2 == 0:
            ctx.recv(buf, r + 1)
        else:
            ctx.send(buf, r - 1)


def all_reduce_doubling(ctx: Ctx, buf: torch.Tensor, op: ReduceOp) -> None:
    """Recursive doubling: lg p rounds exchanging the whole buffer: lg p·(α + nβ + nγ)."""
    if ctx.size == 1:
        return
    pp, rem, nr = _fold_in(ctx, buf, op)
    if nr >= 0:
        tmp = ctx.scratch("rd_xchg", buf.numel(), buf.dtype, buf.device)
        mask = 1
        while mask < pp:
            peer = _real(nr ^ mask, rem)
            ctx.sendrecv(buf, peer, tmp, peer)
            combine_(buf, tmp, op)
            mask <<= 1
    _fold_out(ctx, buf, rem)


def all_reduce_halving_doubling(ctx: Ctx, buf: torch.Tensor, op: ReduceOp) -> None:
    """Rabenseifner: reduce-scatter by recursive halving, all-gather by recursive doubling:
    2 lg p·α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ."""
    if ctx.size == 1:
        return
    pp, rem, nr = _fold_in(ctx, buf, op)
    if nr >= 0:
        bounds = even_bounds(buf.numel(), pp)
        tmp = ctx.scratch("hd_xchg", bounds[pp // 2], buf.dtype, buf.device)
        lo, hi = 0, pp  # chunk-index range this rank is still responsible for
        mask = pp >> 1
        while mask:
            peer = _real(nr ^ mask, rem)
            mid = lo + (hi - lo) // 2
            if nr & mask:  # keep the upper half
                keep, give = (mid, hi), (lo, mid)
            else:
                keep, give = (lo, mid), (mid, hi)
            ka, kb = bounds[keep[0]], bounds[keep[1]]
            ga, gb = bounds[give[0]], bounds[give[1]]
            t = tmp[: kb - ka]
            ctx.sendrecv(buf[ga:gb], peer, t, peer)
            combine_(buf[ka:kb], t, op)
            lo, hi = keep
            mask >>= 1
        # lo == nr now; all-gather back up by recursive doubling.
        mask = 1
        while mask < pp:
            peer = _real(nr ^ mask, rem)
            base = nr & ~(mask - 1)
            pbase = base ^ mask
            mine = (bounds[base], bounds[base + mask])
            theirs = (bounds[pbase], bounds[pbase + mask])
            ctx.sendrecv(buf[mine[0] : mine[1]], peer, buf[theirs[0] : theirs[1]], peer)
            mask <<= 1
    _fold_out(ctx, buf, rem)


def all_gather_bruck(ctx: Ctx, buf: torch.Tensor) -> None:
    """Bruck's all-gather (recursive doubling for any p): ceil(lg p)·α + ((p-1)/p)·nβ.

    ``buf`` holds p equal blocks with this rank's in place. Blocks are collected in an order
    rotated by this rank, then rotated back.
    """
    p, r = ctx.size, ctx.rank
    if p == 1:
        return
    n = buf.numel() // p
    rot = ctx.scratch("bruck", buf.numel(), buf.dtype, buf.device)
    rot[:n].copy_(buf[r * n : (r + 1) * n])  # rot block j = block (r + j) mod p
    have = 1
    while have < p:
        cnt = min(have, p - have)
        dst, src = (r - have) % p, (r + have) % p
        ctx.sendrecv(rot[: cnt * n], dst, rot[have * n : (have + cnt) * n], src)
        have += cnt
    for j in range(p):
        b = (r + j) % p
        buf[b * n : (b + 1) * n].copy_(rot[j * n : (j + 1) * n])
