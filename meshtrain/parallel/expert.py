"""Expert parallelism: a mixture-of-experts layer's experts split over the mesh's ``ep`` view, its
tokens sent to them by all-to-all, and the groups its gradients and statistics are summed over.

Layout (torchtitan's): ep is carved out of dp_shard x cp, so the ranks of one expert-parallel
group see different tokens and each holds E / ep experts. Routed experts are not
tensor-parallel: with tp > 1 each tp rank routes its own 1/tp slice of the sequence (the slice
sequence parallelism already holds, else cut here and gathered after), so the whole layer,
router and shared experts included, is replicated over tp with partial gradients. Hence:

* router and shared experts: reduced over dp x cp x tp (``dp_cp_tp``);
* experts: reduced over the ranks holding the same experts (``edp_tp``: dp_replicate x
  dp_shard / (ep / cp) x tp); ZeRO shards each over that view without dp_replicate.

Each is a sum divided by dp x cp (``grad_groups``). One dispatch (``AllToAllDispatcher``): count
exchange, token all-to-all with uneven splits, permute to expert-major order; the combine runs
the reverse. Zero-token experts and ranks work: empty splits are plain all-to-all parts.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .. import comm
from ..comm import Group
from ..mesh import Mesh
from ..models.moe import GatherTokens, GroupedExperts, MoE
from .tensor_comm import GatherFromTP, ScatterToTP

EXPERT_VIEWS: dict[str, tuple[str, ...]] = {
    "cp_tp": ("cp", "tp"),
    "dp_cp_tp": ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp"),
    "dp_shard_cp_tp": ("dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp"),
    "edp_tp": ("dp_replicate", "dp_shard_mod_ep", "tp"),
    "edp_shard_tp": ("dp_shard_mod_ep", "tp"),
}
"""The views a mixture-of-experts model needs beyond the training mesh's: the ranks that hold
other tokens of a sequence (cp_tp) or of the batch (dp_cp_tp), and the experts' reduce group with
its ZeRO shard group (edp_tp, edp_shard_tp)."""
ROUTER_VIEW = "dp_cp_tp"
EXPERT_VIEW = "edp_tp"
EXPERT_REDUCTION_VIEWS = ("dp_cp_tp", "dp_shard_cp_tp", "edp_tp", "edp_shard_tp")
"""The views the router's and the experts' gradients are reduced (ZeRO: sharded) over: each gets a
reduction group of its own (``Mesh.reduction_group``), never the group the all-to-all or the
statistics use, so that the buckets' reductions and backward's all-to-all cannot interleave."""


def add_expert_views(mesh: Mesh) -> None:
    """Add ``EXPERT_VIEWS`` and their reduction groups to the mesh (collective: every rank, before
    any stage is built)."""
    mesh.add_views(EXPERT_VIEWS, reduction=EXPERT_REDUCTION_VIEWS)


@torch.compiler.disable
def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` cut by ``in_splits`` go to the group's ranks; ``out_splits`` rows come back from
    each. Backward sends the gradients the reverse way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _all_to_all(g, in_splits, out_splits, ctx.group), None, None, None


def expert_major(matrix: list[list[int]]) -> torch.Tensor:
    """For rows received as [source][local expert] blocks of sizes ``matrix`` (sources x experts,
    on the host), the row indices in [local expert][source] order (a CPU tensor: no device sync)."""
    starts, at = [], 0
    for row in matrix:
        starts.append([])
        for n in row:
            starts[-1].append(at)
            at += n
    parts = [torch.arange(starts[s][e], starts[s][e] + matrix[s][e])
             for e in range(len(matrix[0]) if matrix else 0) for s in range(len(matrix))]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class AllToAllDispatcher:
    """Tokens to the experts of an expert-parallel group, and back (``MoE.dispatcher``)."""

    def __init__(self, group: Group, n_experts: int) -> None:
        self.group, self.n_experts = group, n_experts
        self.n_local = n_experts // group.size

    def dispatch(self, x: torch.Tensor, expert_idx: torch.Tensor) -> tuple[torch.Tensor, list[int], Any]:
        """x: (T, dim), expert_idx: (T, k) global expert ids (-1: dropped). Returns this rank's
        experts' tokens, expert-major, their counts per local expert, and the combine's state."""
        T, k = expert_idx.shape
        ep = self.group.size
        key = torch.where(expert_idx.reshape(-1) >= 0, expert_idx.reshape(-1), self.n_experts)
        order = torch.argsort(key, stable=True)  # by expert, then position: deterministic
        counts = torch.bincount(key, minlength=self.n_experts + 1)[: self.n_experts]
        recv = _all_to_all(counts, [self.n_local] * ep, [self.n_local] * ep, self.group)
        sent, got = torch.stack([counts, recv]).view(2, ep, self.n_local).tolist()  # the one host read
        send_splits, recv_splits = [sum(r) for r in sent], [sum(r) for r in got]
        kept = order[: sum(send_splits)]
        tokens = GatherTokens.apply(x, kept, k)  # (its backward sums a token's k gradients in order)
        received = AllToAll.apply(tokens, recv_splits, send_splits, self.group)
        perm = expert_major(got).to(x.device, non_blocking=True)
        counts_local = [sum(col) for col in zip(*got)]
        return received.index_select(0, perm), counts_local, (kept, T, k, perm, send_splits, recv_splits)

    def combine(self, y: torch.Tensor, state: Any) -> torch.Tensor:
        """The experts' outputs (dispatch order) back at their tokens: (T * k, dim) in assignment
        order, zero rows for dropped assignments."""
        kept, T, k, perm, send_splits, recv_splits = state
        by_source = y.new_zeros(y.shape).index_copy(0, perm, y)
        back = AllToAll.apply(by_source, send_splits, recv_splits, self.group)
        return y.new_zeros((T * k,) + tuple(y.shape[1:])).index_copy(0, kept, back)


def _summed_over(group: Group) -> Callable[[torch.Tensor], torch.Tensor]:
    """A statistics reducer: the sum of a detached tensor over ``group`` (identity alone)."""
    if group.size == 1:
        return lambda t: t

    @torch.compiler.disable
    def reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        comm.all_reduce(out, op="sum", group=group)
        return out
    return reduce


def _tp_sliced(forward: Callable[[torch.Tensor], torch.Tensor], group: Group, x: torch.Tensor) -> torch.Tensor:
    """Run a token-wise layer on this tp rank's slice of the sequence and gather the result."""
    return GatherFromTP.apply(forward(ScatterToTP.apply(x, group, 1)), group, 1)


def apply_expert_parallel(model: Any, mesh: Mesh, sequence_parallel: bool) -> None:
    """Make every mixture-of-experts layer of a (meta-device) Llama stage expert-parallel over the
    mesh: experts split over ep with an all-to-all dispatcher, statistics summed over the ranks
    that hold other tokens, gradient views declared, and with tp > 1 (no sequence parallelism)
    each tp rank routing its slice of the sequence. ``add_expert_views`` must have run."""
    ep, tp = mesh.size("ep"), mesh.tp
    for block in model.layers.values():
        moe = block.mlp
        if not isinstance(moe, MoE):
            continue
        n = moe.router.gate.out_features
        if ep > 1:
            old = moe.experts
            with torch.device(old.w1.device):
                moe.experts = GroupedExperts(n // ep, old.w1.shape[2], old.w1.shape[1])
            moe.experts.shard_dims = {"w1": 0, "w3": 0, "w2": 0}
            moe.experts.shard_axis, moe.experts.group = "ep", mesh.group("ep")
            moe.dispatcher = AllToAllDispatcher(mesh.group("ep"), n)
        moe.grad_reduce = ROUTER_VIEW
        moe.experts.grad_reduce = EXPERT_VIEW
        moe.reduce_seq_stats = _summed_over(mesh.group("cp_tp"))
        moe.reduce_batch_stats = _summed_over(mesh.group("dp_cp_tp"))
        if tp > 1 and not sequence_parallel:  # (with it, the layer's input is already this rank's slice)
            moe.forward = functools.partial(_tp_sliced, moe.forward, mesh.tp_group)
