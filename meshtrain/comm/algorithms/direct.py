"""Direct (naive) algorithms: everyone talks to everyone, or to the root, in one round.

These are the readable references: p-1 messages per rank of the full data. Every rank reduces
in rank order 0..p-1, so all ranks get bitwise identical results.
"""

from __future__ import annotations

import torch

from ..types import ReduceOp, combine_
from .base import Ctx


def _reduce_from_all(ctx: Ctx, buf: torch.Tensor, op: ReduceOp, name: str, sends=()) -> None:
    """Receive every peer's ``buf``-shaped data and reduce all p of them in rank order into ``buf``.
    ``sends`` (still reading ``buf``) are completed before ``buf`` is overwritten."""
    p, r = ctx.size, ctx.rank
    parts = ctx.scratch(name, buf.numel() * p, buf.dtype, buf.device)
    works = [ctx.irecv(parts[i * buf.numel() : (i + 1) * buf.numel()], i) for i in range(p) if i != r]
    for w in list(works) + list(sends):
        ctx.wait(w)
    n = buf.numel()
    parts[r * n : (r + 1) * n].copy_(buf)
    buf.copy_(parts[:n])
    for i in range(1, p):
        combine_(buf, parts[i * n : (i + 1) * n], op)


def all_reduce(ctx: Ctx, buf: torch.Tensor, op: ReduceOp) -> None:
    """Send the whole buffer to every peer; reduce all of them locally: α + (p-1)·nβ + (p-1)·nγ."""
    sends = [ctx.isend(buf, i) for i in range(ctx.size) if i != ctx.rank]
    _reduce_from_all(ctx, buf, op, "direct_ar", sends)


def reduce(ctx: Ctx, buf: torch.Tensor, op: ReduceOp, root: int) -> None:
    """Everyone sends to ``root``, which reduces in rank order."""
    if ctx.rank == root:
        _reduce_from_all(ctx, buf, op, "direct_reduce")
    else:
        ctx.send(buf, root)


def broadcast(ctx: Ctx, buf: torch.Tensor, root: int) -> None:
    """The root sends the whole buffer to every other rank."""
    if ctx.rank == root:
        for w in [ctx.isend(buf, i) for i in range(ctx.size) if i != root]:
            ctx.wait(w)
    else:
        ctx.recv(buf, root)


def all_gather(ctx: Ctx, buf: torch.Tensor) -> None:
    """``buf`` holds p equal blocks, own in place: send own block to all, receive all others."""
    p, r = ctx.size, ctx.rank
    n = buf.numel() // p
    mine = buf[r * n : (r + 1) * n]
    works = [ctx.irecv(buf[i * n : (i + 1) * n], i) for i in range(p) if i != r]
    works += [ctx.isend(mine, i) for i in range(p) if i != r]
    for w in works:
        ctx.wait(w)


def reduce_scatter(ctx: Ctx, buf: torch.Tensor, op: ReduceOp) -> None:
    """Block i goes to rank i, which reduces the p contributions in rank order into block r."""
    p, r = ctx.size, ctx.rank
    n = buf.numel() // p
    sends = [ctx.isend(buf[i * n : (i + 1) * n], i) for i in range(p) if i != r]
    _reduce_from_all(ctx, buf[r * n : (r + 1) * n], op, "direct_rs")
    for w in sends:
        ctx.wait(w)


def gather(ctx: Ctx, buf: torch.Tensor, root: int) -> None:
    """``buf`` holds p equal blocks in rank order, own in place; the root receives the others."""
    p, r = ctx.size, ctx.rank
    n = buf.numel() // p
    if r == root:
        for w in [ctx.irecv(buf[i * n : (i + 1) * n], i) for i in range(p) if i != r]:
            ctx.wait(w)
    else:
        ctx.send(buf[r * n : (r + 1) * n], root)


def scatter(ctx: Ctx, buf: torch.Tensor, root: int) -> None:
    """The root's ``buf`` holds p blocks in rank order; every rank receives its own block."""
    p, r = ctx.size, ctx.rank
    n = buf.numel() // p
    if r == root:
        for w in [ctx.isend(buf[i * n : (i + 1) * n], i) for i in range(p) if i != r]:
            ctx.wait(w)
    else:
        ctx.recv(buf[r * n : (r + 1) * n], root)


def all_to_all(ctx: Ctx, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
    """Pairwise exchange: ``sends[i]`` goes to rank i, ``recvs[i]`` comes from rank i."""
    p, r = ctx.size, ctx.rank
    recvs[r].copy_(sends[r])
    works = []
    for k in range(1, p):  # staggered partners spread the load over the ring
        dst, src = (r + k) % p, (r - k) % p
        works.append(ctx.irecv(recvs[src], src))
        works.append(ctx.isend(sends[dst], dst))
    for w in works:
        ctx.wait(w)
