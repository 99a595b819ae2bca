"""Apply parallelism to a parallel-agnostic Llama (stage): TP -> CP -> activation checkpointing ->
materialise and initialise by name -> ZeRO / data parallel, in torchtitan's order.

Pipeline splitting happens before (``pipeline.partition.split_stages``); ``ParallelModel`` in
``parallel_model.py`` puts the pieces together for one training step.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..comm import Group
from ..config.parallel import AC_MODES, PRECISIONS, ParallelConfig, check_tensor_parallel  # noqa: F401 (moved; re-exported)
from ..errors import ConfigError
from ..mesh import Mesh
from ..models.llama import Llama, RMSNorm, init_weights
from ..models.llama_plan import TP_PLAN, tie_weights
from ..placement import attach_placements, placement_of
from .context import ring_attention
from .data import DataParallel
from .expert import apply_expert_parallel
from .grad_groups import ReduceGroup
from .tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, prepare_shared_input
from .tensor_comm import CopyToTP
from .precision import MixedPrecision
from .zero import ZeroModel

ZERO_VIEW = "dp_shard_cp"
"""The mesh view ZeRO shards over: dp_shard x cp (dp_replicate holds replicas of the shards)."""
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype forwards autocast to under ``ParallelConfig.precision`` (None: plain fp32)."""
    return _AUTOCAST[precision]


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm on this rank's sequence slice: the scale's gradient is partial, so it passes through
    ``CopyToTP`` (identity forward, all-reduce over tp backward) and arrives whole on every rank."""

    def __init__(self, norm: RMSNorm, group: Group) -> None:
        nn.Module.__init__(self)
        self.eps, self.weight, self.group = norm.eps, norm.weight, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised slice times the (tp-summed-gradient) scale."""
        return self.normalize(x) * CopyToTP.apply(self.weight, self.group)


def _column(lin: nn.Linear, group: Group, sp: bool) -> nn.Module:
    with torch.device(lin.weight.device):
        return ColumnParallelLinear(lin.in_features, lin.out_features, group, bias=lin.bias is not None,
                                    sequence_parallel=sp)


def _row(lin: nn.Linear, group: Group, sp: bool) -> nn.Module:
    with torch.device(lin.weight.device):
        return RowParallelLinear(lin.in_features, lin.out_features, group, bias=lin.bias is not None,
                                 sequence_parallel=sp)


def _vocab(emb: nn.Embedding, group: Group, sp: bool) -> nn.Module:
    with torch.device(emb.weight.device):
        return VocabParallelEmbedding(emb.num_embeddings, emb.embedding_dim, group, sequence_parallel=sp)


def _sequence_norm(norm: RMSNorm, group: Group, sp: bool) -> nn.Module:
    return SequenceParallelRMSNorm(norm, group) if sp else norm


TP_STYLES: dict[str, Callable[[Any, Group, bool], nn.Module]] = {
    "colwise": _column, "rowwise": _row, "vocab": _vocab, "sequence_norm": _sequence_norm,
    "shared_input": prepare_shared_input}
"""The styles a tensor-parallel plan (``models.llama_plan.TP_PLAN``) may name: module -> its
tp-split replacement, given the tp group and whether sequence parallelism is on. ``shared_input``
applies after the others (it marks the column-parallel children they made)."""


def apply_tensor_parallel(model: Llama, group: Group, sequence_parallel: bool = False,
                          plan: dict[str, str] | None = None) -> None:
    """Replace every module a tensor-parallel plan names (default: Llama's ``TP_PLAN``) by its
    style's tp-split version; modules a pipeline stage does not hold (``None``) are skipped."""
    plan = TP_PLAN if plan is None else plan
    check_tensor_parallel(model.cfg, group.size)
    unknown = sorted(set(plan.values()) - set(TP_STYLES))
    if unknown:
        raise ConfigError(f"tensor-parallel plan names unknown styles {unknown}; use {sorted(TP_STYLES)}")
    matched = [(name, next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None))
               for name, _ in model.named_modules()]
    for last in (False, True):  # shared_input last: it marks the column-parallel children made first
        for name, style in matched:
            if style is None or (style == "shared_input") != last:
                continue
            parent, _, leaf = name.rpartition(".")
            module = model.get_submodule(name)
            setattr(model.get_submodule(parent), leaf, TP_STYLES[style](module, group, sequence_parallel))
    tie_weights(model)


def apply_context_parallel(model: Llama, group: Group) -> None:
    """Attention becomes ring attention over the cp group (inputs are load-balanced shares)."""
    for block in model.layers.values():
        block.attn.attention_fn = functools.partial(ring_attention, group=group)


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: Llama, mode: str, every: int = 2) -> None:
    """Recompute blocks' forwards in backward: every block ("full") or those whose layer index is a
    multiple of ``every`` ("selective"; by global index, so the choice does not depend on pp)."""
    if mode == "none":
        return
    for key, block in model.layers.items():
        if mode == "full" or int(key) % every == 0:
            block.forward = functools.partial(_checkpointed, block.forward)


def apply_compile(model: Llama) -> None:
    """``torch.compile`` each block's forward (as torchtitan does: per block, so one graph is
    reused by every layer; tp/cp collectives inside a block run eagerly between graphs)."""
    for block in model.layers.values():
        block.forward = torch.compile(block.forward)


def materialize(model: nn.Module, device: torch.device | str, seed: int) -> None:
    """Allocate a meta-device model on ``device`` and initialise it by name (``init_weights``),
    each parameter its slice of the global value (``placement``); a model already materialised
    keeps its values and gets its placements."""
    if not any(p.is_meta for p in model.parameters()):
        attach_placements(model)
        return
    model.to_empty(device=device)
    tie_weights(model)
    attach_placements(model)  # to_empty made new parameters: derive their placements again
    init_weights(model, seed)


def parallelize(model: Llama, mesh: Mesh, config: ParallelConfig, seed: int = 0,
                device: torch.device | str = "cpu") -> nn.Module:
    """TP -> CP -> activation checkpointing -> materialise -> ZeRO / DP, for one (stage) model.

    Returns the module to call: a ``ZeroModel`` (zero_stage > 0), a ``DataParallel`` (dp x cp > 1),
    or the model itself."""
    if config.sequence_parallel and mesh.tp == 1:
        raise ConfigError("sequence_parallel=true needs tp > 1 (it splits the sequence over the tp group); "
                          "set tp >= 2 or sequence_parallel=false")
    if mesh.tp > 1 or config.sequence_parallel:
        apply_tensor_parallel(model, mesh.tp_group, config.sequence_parallel)
    if mesh.cp > 1:
        apply_context_parallel(model, mesh.cp_group)
    if model.cfg.n_experts:
        apply_expert_parallel(model, mesh, config.sequence_parallel)
    apply_activation_checkpointing(model, config.activation_checkpointing, config.checkpoint_every)
    if config.compile:
        apply_compile(model)
    materialize(model, device, seed)
    groups = reduce_groups(mesh, model, zero=bool(config.zero_stage))
    if config.zero_stage:
        # bf16 / fp16: the units gather and compute in it (half the all-gather bytes), reduce in fp32;
        # buffers (the experts' routing bias) stay fp32
        mp = MixedPrecision(param_dtype=autocast_dtype(config.precision), buffer_dtype=torch.float32) \
            if config.precision != "fp32" else None
        # ZeRO shards over dp_shard x cp; with dp_replicate > 1 (HSDP) each shard is also averaged
        # over the replicas
        return ZeroModel(model, config.zero_stage, mesh.reduction_group(ZERO_VIEW), units=list(model.layers.values()),
                         mixed_precision=mp, replicate_group=mesh.reduction_group("dp_replicate"), view=ZERO_VIEW,
                         reduce_groups=groups, offload=config.offload, bucket_cap_mb=config.bucket_cap_mb)
    if mesh.dp_cp.size > 1 or groups:
        # buffers are equal on every rank by construction (the routing bias is updated from
        # all-reduced counts): no broadcast before each forward
        return DataParallel(model, mesh.reduction_group("dp_cp"), bucket_cap_mb=config.bucket_cap_mb,
                            broadcast_buffers=False,
                            reduce_groups=groups)
    return model


def reduce_groups(mesh: Mesh, model: nn.Module, zero: bool) -> dict[str, ReduceGroup]:
    """The groups of the views parameters' placements name for their gradients (``grad_groups``):
    averaged over the view and scaled by its size over dp x cp; under ZeRO reduce-scattered over
    the view without dp_replicate, whose ranks then hold replicas (HSDP). The mesh's reduction
    groups, never the computation's (``Mesh.reduction_group``)."""
    out: dict[str, ReduceGroup] = {}
    shares = mesh.size("dp_cp")
    for view in sorted({placement_of(p).reduce for p in model.parameters()} - {None}):
        scale = mesh.size(view) / shares
        if zero:
            shard = mesh.name_of([a for a in mesh.views[view] if a != "dp_replicate"])
            out[view] = ReduceGroup(mesh.reduction_group(shard), scale, mesh.reduction_group("dp_replicate"), shard)
        else:
            out[view] = ReduceGroup(mesh.reduction_group(view), scale, None, view)
    return out
