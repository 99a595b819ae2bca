"""Hierarchical all-reduce: reduce inside each node, all-reduce across node leaders, broadcast back.

A node is a set of ranks sharing a host (``Ctx.hosts``) or, when a node size is given, each run of
``node_size`` consecutive group ranks. Only leaders (one per node) cross the slow link, so the
inter-node traffic is that of a p/node_size-rank all-reduce.
"""

from __future__ import annotations

import torch

from ..types import ReduceOp
from . import ring, tree
from .base import Ctx


def nodes_of(ctx: Ctx, node_size: int | None) -> list[list[int]]:
    """Group ranks 0..p-1 into nodes: by host id, or in runs of ``node_size``."""
    if node_size is not None:
        if node_size < 1:
            raise ValueError(f"node_size must be >= 1, got {node_size}")
        return [list(range(i, min(i + node_size, ctx.size))) for i in range(0, ctx.size, node_size)]
    order: dict[str, list[int]] = {}
    for i, h in enumerate(ctx.hosts):
        order.setdefault(h, []).append(i)
    return list(order.values())


def all_reduce(ctx: Ctx, buf: torch.Tensor, op: ReduceOp, node_size: int | None = None) -> None:
    """Tree reduce to each node's leader, ring all-reduce among leaders, tree broadcast in nodes."""
    nodes = nodes_of(ctx, node_size)
    mine = next(n for n in nodes if ctx.rank in n)
    local = ctx.sub(mine)
    tree.reduce(local, buf, op, 0)
    if local.rank == 0 and len(nodes) > 1:
        ring.all_reduce(ctx.sub([n[0] for n in nodes]), buf, op)
    tree.broadcast(local, buf, 0)
