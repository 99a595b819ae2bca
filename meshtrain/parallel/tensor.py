"""Tensor (and sequence) parallel layers: Megatron's column/row-parallel linears, a vocab-parallel
embedding and a vocab-parallel cross-entropy that never gathers the full logits.

Each layer holds only its shard of the weight. ``from_full`` builds it from an ordinary layer
(tests, loading), so every tp degree starts from the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import Group
from ..errors import ConfigError
from .tensor_comm import (CopyToTP, GatherFromSP, GatherFromTP, ReduceFromTP, ReduceScatterToSP, ScatterToTP,
                          VocabParallelCrossEntropy)


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ConfigError(f"{what} = {n} is not divisible by tp = {tp}; choose a tp degree that divides it")
    return n // tp


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W split by output rows: each rank computes ``out_features / tp`` outputs.

    Input: the full activation (its gradient is all-reduced: ``CopyToTP``), or with
    ``sequence_parallel`` this rank's sequence slice, all-gathered first (``GatherFromSP``); or, with
    ``input_prepared`` (set by ``prepare_shared_input``), an input its parent module already passed
    through that op once for all its column-parallel children.
    Output: this rank's columns, or all of them with ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.input_prepared = False
        self.out_local = _divide(out_features, group.size, "out_features")
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features))
        self.bias = nn.Parameter(torch.zeros(self.out_local)) if bias else None
        self.shard_dims = {"weight": 0, "bias": 0}  # read by placement.attach_placements

    @classmethod
    def from_full(cls, full: nn.Linear, group: Group, **kw) -> "ColumnParallelLinear":
        """This rank's shard of an ordinary ``nn.Linear``."""
        m = cls(full.in_features, full.out_features, group, bias=full.bias is not None, **kw)
        r, n = group.rank, m.out_local
        with torch.no_grad():
            m.weight.copy_(full.weight[r * n : (r + 1) * n])
            if m.bias is not None:
                m.bias.copy_(full.bias[r * n : (r + 1) * n])
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features) -> (..., out_features / tp) or (..., out_features)."""
        if not self.input_prepared:
            x = prepare_input(x, self.group, self.sequence_parallel)
        y = F.linear(x, self.weight, self.bias)
        return GatherFromTP.apply(y, self.group) if self.gather_output else y


def prepare_input(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """What a column-parallel linear's input goes through: all-gathered along the sequence (its
    gradient reduce-scattered back) with sequence parallelism, else identity (its gradient
    all-reduced)."""
    return GatherFromSP.apply(x, group, 1) if sequence_parallel else CopyToTP.apply(x, group)


def prepare_shared_input(module: nn.Module, group: Group, sequence_parallel: bool) -> nn.Module:
    """Have ``module`` prepare its first input once (``prepare_input``) for the column-parallel linears
    among its children, which all read it (attention's q, k, v; the MLP's w1, w3), as Megatron and
    torchtitan's ``PrepareModuleInput`` do: one all-gather forward and one reduce-scatter (or
    all-reduce) backward for the sub-block instead of one per linear, and one gathered copy of the
    input saved for backward instead of one per linear. A module without such children is left as
    it is (a MoE layer routes its own sequence slice)."""
    columns = [c for c in module.children() if isinstance(c, ColumnParallelLinear)]
    if not columns:
        return module
    for c in columns:
        c.input_prepared = True

    def hook(_: nn.Module, args: tuple) -> tuple:
        return (prepare_input(args[0], group, sequence_parallel), *args[1:])

    module.register_forward_pre_hook(hook)
    return module


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W split by input columns: each rank multiplies its slice of the input and
    the partial sums are all-reduced (``ReduceFromTP``), or with ``sequence_parallel``
    reduce-scattered along the sequence (``ReduceScatterToSP``). The bias is added once, after."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.in_local = _divide(in_features, group.size, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.shard_dims = {"weight": 1}
        # under sequence parallelism the bias is added to this rank's sequence slice only
        self.partial_grads = ("bias",) if sequence_parallel else ()

    @classmethod
    def from_full(cls, full: nn.Linear, group: Group, **kw) -> "RowParallelLinear":
        """This rank's shard of an ordinary ``nn.Linear``."""
        m = cls(full.in_features, full.out_features, group, bias=full.bias is not None, **kw)
        r, n = group.rank, m.in_local
        with torch.no_grad():
            m.weight.copy_(full.weight[:, r * n : (r + 1) * n])
            if m.bias is not None:
                m.bias.copy_(full.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features / tp), or the full input if not ``input_is_parallel``."""
        if not self.input_is_parallel:
            x = ScatterToTP.apply(x, self.group)
        y = F.linear(x, self.weight)
        y = ReduceScatterToSP.apply(y, self.group, 1) if self.sequence_parallel else ReduceFromTP.apply(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (token ids) are split over tp: each rank looks up the ids it owns,
    zeros the others, and the partial results are all-reduced (or reduce-scattered along the
    sequence with ``sequence_parallel``)."""

    def __init__(self, num_embeddings: int, dim: int, group: Group, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.rows = _divide(num_embeddings, group.size, "vocab_size")
        self.start = group.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))
        self.shard_dims = {"weight": 0}

    @classmethod
    def from_full(cls, full: nn.Embedding, group: Group, **kw) -> "VocabParallelEmbedding":
        """This rank's rows of an ordinary ``nn.Embedding``."""
        m = cls(full.num_embeddings, full.embedding_dim, group, **kw)
        with torch.no_grad():
            m.weight.copy_(full.weight[m.start : m.start + m.rows])
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (batch, seq) -> (batch, seq, dim) (seq / tp with sequence parallel)."""
        inside = (ids >= self.start) & (ids < self.start + self.rows)
        out = F.embedding((ids - self.start).clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1)
        if self.sequence_parallel:
            return ReduceScatterToSP.apply(out, self.group, 1)
        return ReduceFromTP.apply(out, self.group)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits split along the vocabulary (this rank's equal share, in rank
    order) against full targets; the full logits are never gathered."""
    vocab_start = group.rank * logits.shape[-1]
    loss = VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def allreduce_sequence_parallel_grads(module: nn.Module, group: Group) -> None:
    """Sum over tp the partial gradients of the parameters a layer declares in ``partial_grads``
    (replicated over tp but applied to this rank's sequence slice only: a row-parallel bias under
    sequence parallelism). Call after backward, before the optimizer, as Megatron does."""
    from .tensor_comm import _all_reduce

    for m in module.modules():
        for name in getattr(m, "partial_grads", ()):
            p = getattr(m, name)
            if p is not None and p.grad is not None:
                p.grad.copy_(_all_reduce(p.grad, group))
