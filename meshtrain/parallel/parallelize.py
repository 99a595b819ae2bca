"""Apply parallelism to a parallel-agnostic Llama (stage): TP -> CP -> activation checkpointing ->
materialise and initialise by name -> ZeRO / data parallel, in torchtitan's order.

Pipeline splitting happens before (``pipeline.partition.split_stages``); ``ParallelModel`` in
``parallel_model.py`` puts the pieces together for one training step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..comm import Group
from ..config.parallel import AC_MODES, PRECISIONS, ParallelConfig, check_tensor_parallel  # noqa: F401 (moved; re-exported)
from ..errors import ConfigError
from ..mesh import Mesh
from ..models.llama import Llama, LlamaConfig, RMSNorm, init_weights
from .context import ring_attention
from .data import DataParallel
from .tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .tensor_comm import CopyToTP
from .precision import MixedPrecision
from .zero import ZeroModel

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16}


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


def _column(lin: nn.Linear, group: Group, sp: bool) -> ColumnParallelLinear:
    with torch.device(lin.weight.device):
        return ColumnParallelLinear(lin.in_features, lin.out_features, group, bias=lin.bias is not None,
                                    sequence_parallel=sp)


def _row(lin: nn.Linear, group: Group, sp: bool) -> RowParallelLinear:
    with torch.device(lin.weight.device):
        return RowParallelLinear(lin.in_features, lin.out_features, group, bias=lin.bias is not None,
                                 sequence_parallel=sp)


def apply_tensor_parallel(model: Llama, group: Group, sequence_parallel: bool = False) -> None:
    """Replace the linears by column/row-parallel ones (q, k, v, w1, w3 by output; wo, w2 by input),
    the embedding and head by vocab-parallel ones, and with sequence parallelism the norms by
    ``SequenceParallelRMSNorm``. Heads split with the projections: rank r holds q heads
    r*hq/tp.. and the KV heads they use."""
    check_tensor_parallel(model.cfg, group.size)
    sp = sequence_parallel
    for block in model.layers.values():
        at, mlp = block.attn, block.mlp
        at.wq, at.wk, at.wv = (_column(m, group, sp) for m in (at.wq, at.wk, at.wv))
        at.wo = _row(at.wo, group, sp)
        mlp.w1, mlp.w3, mlp.w2 = _column(mlp.w1, group, sp), _column(mlp.w3, group, sp), _row(mlp.w2, group, sp)
        if sp:
            block.attn_norm = SequenceParallelRMSNorm(block.attn_norm, group)
            block.mlp_norm = SequenceParallelRMSNorm(block.mlp_norm, group)
    if model.tok_emb is not None:
        with torch.device(model.tok_emb.weight.device):
            model.tok_emb = VocabParallelEmbedding(model.cfg.vocab_size, model.cfg.dim, group, sequence_parallel=sp)
    if model.norm is not None and sp:
        model.norm = SequenceParallelRMSNorm(model.norm, group)
    if model.head is not None:
        model.head = _column(model.head, group, sp)
        if model.cfg.tie_embeddings and model.tok_emb is not None:
            model.head.weight = model.tok_emb.weight  # both split the vocabulary the same way


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
    """Allocate a meta-device model on ``device`` and initialise it by name (``init_weights``);
    a model already materialised is left as it is. Shard metadata survives ``to_empty``."""
    if not any(p.is_meta for p in model.parameters()):
        return
    shards = {n: p.shard for n, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "shard")}
    model.to_empty(device=device)
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in shards:
            p.shard = shards[n]
    if model.cfg.tie_embeddings and model.head is not None and model.tok_emb is not None:
        model.head.weight = model.tok_emb.weight
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
    apply_activation_checkpointing(model, config.activation_checkpointing, config.checkpoint_every)
    if config.compile:
        apply_compile(model)
    materialize(model, device, seed)
    if config.zero_stage:
        # bf16: the units gather and compute in bf16 (half the all-gather bytes), reduce in fp32
        mp = MixedPrecision(param_dtype=autocast_dtype(config.precision)) if config.precision != "fp32" else None
        return ZeroModel(model, config.zero_stage, mesh.dp_cp, units=list(model.layers.values()), mixed_precision=mp)
    if mesh.dp_cp.size > 1:
        return DataParallel(model, mesh.dp_cp, bucket_cap_mb=config.bucket_cap_mb)
    return model
