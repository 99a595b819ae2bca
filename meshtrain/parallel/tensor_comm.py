"""The collectives of tensor and sequence parallelism as named autograd functions (Megatron's f/g).

Each function's docstring says what its forward and its backward do. Every one takes the tp group
explicitly; nothing reads a global.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm
from ..comm import Group

# The helpers that call the communicator are left out of ``torch.compile`` graphs (train.compile):
# dynamo would otherwise try to trace into its locks and queues; it breaks the graph here instead.


@torch.compiler.disable
def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in group-rank order."""
    if group.size == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((group.size * moved.shape[0],) + moved.shape[1:], dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim``."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not divide by tp={group.size}")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


@torch.compiler.disable
def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    out = x.contiguous().clone()
    comm.all_reduce(out, op="sum", group=group)
    return out


@torch.compiler.disable
def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum over the group, then keep this rank's slice along ``dim``."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not divide by tp={group.size}")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // group.size,) + moved.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, moved, op="sum", group=group)
    return out.movedim(0, dim)


class CopyToTP(torch.autograd.Function):
    """f: forward identity; backward all-reduce of the gradient (before a column-parallel linear)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(g, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce (after a row-parallel linear); backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class GatherFromTP(torch.autograd.Function):
    """Forward all-gather along ``dim`` (default the last); backward keeps this rank's slice of
    the gradient (which every tp rank holds whole)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(g, ctx.dim, ctx.group), None, None


class ScatterToTP(torch.autograd.Function):
    """Forward keeps this rank's slice along ``dim`` (default the last); backward all-gathers the
    gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(g, ctx.dim, ctx.group), None, None


class GatherFromSP(torch.autograd.Function):
    """Sequence parallel, entering a tp region: forward all-gather along the sequence dim;
    backward reduce-scatter of the gradient along it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        # contiguous once here: every linear reading the gathered input would otherwise flatten the
        # strided view into a copy of its own (and save that copy for its weight gradient)
        return _all_gather(x, dim, group).contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(g, ctx.dim, ctx.group), None, None


class ReduceScatterToSP(torch.autograd.Function):
    """Sequence parallel, leaving a tp region: forward reduce-scatter along the sequence dim;
    backward all-gather of the gradient along it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(g, ctx.dim, ctx.group), None, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, without gathering them: the max, the
    sum of exponentials and the target's logit are all-reduced (three small all-reduces of one
    number per token); backward is softmax minus one-hot on this rank's columns only."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Group, vocab_start: int) -> torch.Tensor:
        x = logits.float()
        local_max = x.max(dim=-1).values
        gmax = local_max.clone()
        if group.size > 1:
            comm.all_reduce(gmax, op="max", group=group)
        x = x - gmax.unsqueeze(-1)
        n = x.shape[-1]
        inside = (target >= vocab_start) & (target < vocab_start + n)
        local_t = (target - vocab_start).clamp(0, n - 1)
        picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside
        exp = x.exp()
        sums = torch.stack([exp.sum(-1), picked])
        if group.size > 1:
            comm.all_reduce(sums, op="sum", group=group)
        loss = sums[0].log() - sums[1]
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local_t, inside)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_t, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        return (grad * g.unsqueeze(-1)).to(ctx.dtype), None, None, None
