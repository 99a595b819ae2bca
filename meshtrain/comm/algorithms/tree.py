"""Binomial trees: reduce, broadcast, gather and scatter in ceil(lg p) rounds.

Positions are relative to the root (``vr = (rank - root) mod p``). In round ``k`` a rank whose bit
``k`` is set talks to ``vr - 2^k``. Reduce costs lg p·(α + nβ + nγ), broadcast lg p·(α + nβ).
"""

from __future__ import annotations

import torch

from ..types import ReduceOp, combine_
from .base import Ctx


def _abs(vr: int, root: int, p: int) -> int:
    return (vr + root) % p


def _top(p: int) -> int:
    return 1 << max(p - 1, 0).bit_length()  # smallest power of two >= p


def reduce(ctx: Ctx, buf: torch.Tensor, op: ReduceOp, root: int) -> None:
    """Binomial reduce into ``buf`` on ``root`` (other ranks' ``buf`` is used as scratch)."""
    p = ctx.size
    vr = (ctx.rank - root) % p
    tmp = ctx.scratch("tree_reduce", buf.numel(), buf.dtype, buf.device) if p > 1 else None
    mask = 1
    while mask < p:
        if vr & mask:
            ctx.send(buf, _abs(vr - mask, root, p))
            return
        if vr + mask < p:
            ctx.recv(tmp, _abs(vr + mask, root, p))
            combine_(buf, tmp, op)
        mask <<= 1


def broadcast(ctx: Ctx, buf: torch.Tensor, root: int) -> None:
    """Binomial broadcast of ``buf`` from ``root``."""
    p = ctx.size
    vr = (ctx.rank - root) % p
    low = (vr & -vr) if vr else _top(p)
    if vr:
        ctx.recv(buf, _abs(vr - low, root, p))
    mask = low >> 1
    sends = []
    while mask:
        if vr + mask < p:
            sends.append(ctx.isend(buf, _abs(vr + mask, root, p)))
        mask >>= 1
    for w in sends:
        ctx.wait(w)


def all_reduce(ctx: Ctx, buf: torch.Tensor, op: ReduceOp) -> None:
    """Binomial reduce to rank 0, then binomial broadcast: 2 lg p·α + 2 lg p·nβ + lg p·nγ."""
    reduce(ctx, buf, op, 0)
    broadcast(ctx, buf, 0)


def gather(ctx: Ctx, rel: torch.Tensor, root: int) -> None:
    """Binomial gather. ``rel`` holds p equal blocks in root-relative order, this rank's block
    (relative position ``vr``) already filled; on return the root's ``rel`` is complete."""
    p = ctx.size
    n = rel.numel() // p if p else 0
    vr = (ctx.rank - root) % p
    mask = 1
    while mask < p:
        if vr & mask:
            hi = min(vr + mask, p)
            ctx.send(rel[vr * n : hi * n], _abs(vr - mask, root, p))
            return
        child = vr + mask
        if child < p:
            hi = min(child + mask, p)
            ctx.recv(rel[child * n : hi * n], _abs(child, root, p))
        mask <<= 1


def scatter(ctx: Ctx, rel: torch.Tensor, root: int) -> None:
    """Binomial scatter. The root's ``rel`` holds p equal blocks in root-relative order; on return
    every rank's ``rel`` holds its own block at relative position ``vr``."""
    p = ctx.size
    n = rel.numel() // p if p else 0
    vr = (ctx.rank - root) % p
    low = (vr & -vr) if vr else _top(p)
    if vr:
        hi = min(vr + low, p)
        ctx.recv(rel[vr * n : hi * n], _abs(vr - low, root, p))
    mask = low >> 1
    sends = []
    while mask:
        child = vr + mask
        if child < p:
            hi = min(child + mask, p)
            sends.append(ctx.isend(rel[child * n : hi * n], _abs(child, root, p)))
        mask >>= 1
    for w in sends:
        ctx.wait(w)
