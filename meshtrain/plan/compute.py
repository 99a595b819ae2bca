"""Per-layer roofline: the time one rank spends computing one micro-batch on its pipeline stage.

Three kinds of work, each at its own roof: matmuls with weights (FLOPs at ``matmul_efficiency`` of
peak, float8 ``fp8_speedup`` faster), causal attention (FLOPs at ``attention_efficiency``) and
element-wise ops (norms, rotary, SwiGLU, residual adds: bytes at ``hbm_efficiency`` of the memory
bandwidth, ``eager_elementwise_passes`` times more bytes unless compiled). Backward is twice the
forward's matmuls (input and weight gradients), 2.5x its attention (flash-attention's backward
recomputes the scores) and twice its element-wise traffic. Activation checkpointing adds forward
work to the backward: ``full`` all of it, ``selective`` (meshtrain: every 2nd block) half of it,
``op`` (torchtitan) the element-wise part only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..train.metrics import flops_per_token
from .architectures import Arch
from .clusters import Cluster
from .layout import Layout
from .profile import block_seconds, head_seconds, profileable, threads_per_rank
from .profile_parallel import measures_collectives, parallel_block_seconds

ACT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2}
"""Bytes per activation element: fp8 training keeps bf16 activations between the linear layers."""


@dataclass(frozen=True)
class StageCompute:
    """Seconds one rank computes one micro-batch on the busiest pipeline stage."""

    forward: float
    backward: float
    """Backward including any recomputation."""
    recompute: float
    """The part of ``backward`` that recomputes the forward (activation checkpointing)."""
    layers: int
    """Transformer blocks on the busiest stage."""
    comm_measured: bool = False
    """True if forward and backward were timed with the block's tp / cp collectives in them
    (``this-host``'s parallel profile), so the step must not add their analytic times again."""


def model_flops_per_token(arch: Arch, seq: int) -> float:
    """Training FLOPs per token for MFU: 6N + 12·L·d·S (meshtrain's ``flops_per_token``, the PaLM
    and torchtitan convention: attention counted as if not causal, recomputation not counted). N is
    the active parameters of a MoE model; attention's d is (q width + output width) / 2, which is d
    unless heads are wider than d / n_heads (Qwen3) or queries and values differ (MLA)."""
    if arch.q_dim == arch.dim == arch.o_dim:
        return flops_per_token(arch, arch.flop_params(), seq)  # type: ignore[arg-type]  # reads n_layers, dim
    return 6.0 * arch.flop_params() + 6.0 * arch.n_layers * (arch.q_dim + arch.o_dim) * seq


def layer_forward_parts(arch: Arch, layout: Layout, cluster: Cluster, tokens: int, seq: int,
                        moe: bool = False) -> tuple[float, float, float]:
    """Forward seconds of one block (a MoE block if ``moe``) on ``tokens`` tokens of this rank:
    (matmul, attention, element-wise)."""
    peak = cluster.per_rank_peak(layout.world, layout.precision)
    # a MoE block's active weights: each tp rank routes 1/tp of the tokens to top_k whole experts,
    # so its routed FLOPs split over tp like the tp-split attention and shared experts
    mm_flops = 2.0 * arch.active_matmul_params_per_layer(moe) / layout.tp * tokens
    if moe:  # the routed experts' grouped GEMMs run slower than large GEMMs (small reduction dims)
        from .moe import grouped_gemm_slowdown  # moe builds on this module

        routed = 2.0 * arch.moe_top_k * arch.routed_share() * arch.expert_params() / layout.tp * tokens
        mm_flops += routed * (grouped_gemm_slowdown(arch, layout, cluster, tokens) - 1.0)
    mm_rate = peak * cluster.matmul_efficiency * (cluster.fp8_speedup if layout.precision == "fp8" else 1.0)
    # causal: each query attends to half the keys on average; QK^T and AV are 2·S·q and 2·S·o FLOPs
    # per token when not causal (q = o = d but for wide heads or MLA). With cp each rank holds S/cp
    # queries against all S keys.
    attn_flops = seq * (arch.q_dim + arch.o_dim) / layout.tp * tokens
    attn_rate = peak * cluster.attention_efficiency
    act = ACT_BYTES[layout.precision]
    # residual-stream ops (2 norms read+write, 2 residual adds read 2 write 1) are split over tp
    # only with sequence parallelism; the head-split ones (rotary on q and k, SwiGLU) always are.
    stream = 10 * arch.dim / (layout.tp if layout.sp else 1)
    split = 2 * (arch.q_dim + arch.kv_dim) / layout.tp
    if moe:
        from .moe import moe_elementwise  # moe builds on this module

        split += moe_elementwise(arch, layout)
    else:
        split += (3 if arch.gated_mlp else 2) * arch.ffn_dim / layout.tp
    passes = 1.0 if layout.compile else cluster.eager_elementwise_passes
    elem_bytes = (stream + split) * act * passes * tokens
    elem_rate = cluster.per_rank_bandwidth(layout.world)
    return mm_flops / mm_rate, attn_flops / attn_rate, elem_bytes / elem_rate


def head_forward(arch: Arch, layout: Layout, cluster: Cluster, tokens: int) -> float:
    """Forward seconds of the output head and the loss (vocabulary split over tp) on ``tokens``."""
    peak = cluster.per_rank_peak(layout.world, layout.precision)
    flops = 2.0 * arch.vocab_size * arch.dim / layout.tp * tokens
    loss_bytes = 3 * 4 * arch.vocab_size / layout.tp * tokens  # fp32 logits: softmax read, write, read
    return flops / (peak * cluster.matmul_efficiency) + loss_bytes / cluster.per_rank_bandwidth(layout.world)


def stage_layers(arch: Arch, layout: Layout) -> int:
    """Blocks on the busiest pipeline rank (all its virtual chunks together)."""
    return math.ceil(arch.n_layers / layout.pp)


def _pipeline_share(layout: Layout, cores: int) -> float:
    """The profile times every rank computing at once; in a pipeline each rank idles for the bubble's
    share of the step and leaves the cores to the others. With more ranks than cores, the time one
    rank's work takes scales with the ranks busy at once: world x (1 - bubble) rather than world."""
    if layout.pp == 1 or layout.world <= cores:
        return 1.0
    from .step import simulated_bubble  # step builds on this module

    busy = layout.world * (1.0 - simulated_bubble(layout.schedule, layout.pp, layout.microbatches, layout.virtual))
    return max(1.0, busy / cores) / (layout.world / cores)


def _mean_block(arch: Arch, layout: Layout, cluster: Cluster, tokens: int, seq: int) -> tuple[float, float, float]:
    """(matmul, attention, element-wise) forward seconds of the busiest stage's mean block: its
    dense and MoE blocks mixed (all dense for a dense model)."""
    from .moe import stage_layer_mix  # moe builds on this module

    n_dense, n_moe = stage_layer_mix(arch, layout)
    dense = layer_forward_parts(arch, layout, cluster, tokens, seq)
    if n_moe == 0:
        return dense
    moe = layer_forward_parts(arch, layout, cluster, tokens, seq, moe=True)
    mean = tuple((n_dense * d + n_moe * m) / (n_dense + n_moe) for d, m in zip(dense, moe))
    return mean  # type: ignore[return-value]


def stage_compute(arch: Arch, layout: Layout, cluster: Cluster, microbatch_seqs: int, seq: int) -> StageCompute:
    """Forward, backward and recompute seconds of one micro-batch on the busiest stage (the last:
    its blocks plus the head)."""
    tokens = microbatch_seqs * seq // layout.cp
    n = stage_layers(arch, layout)
    mm, attn, elem = _mean_block(arch, layout, cluster, tokens, seq)
    fwd_layer = mm + attn + elem
    bwd_layer = 2 * mm + 2.5 * attn + 2 * elem
    head_f = head_forward(arch, layout, cluster, tokens)
    head_b = 2 * head_f
    measured = False
    if cluster.profile_compute and layout.precision == "fp32" and profileable(arch, layout.tp, tokens):
        threads = threads_per_rank(layout.world)  # measured, not a roofline: see profile.py
        # timed while every rank of the layout does the same: they share the host's cores and caches
        if measures_collectives(layout.tp, layout.cp, layout.zero_shards, layout.zero_stage):
            measured = True  # meshtrain's parallel block, its collectives included
            degrees = (layout.dp, layout.dp_replicate, layout.pp, layout.cp, layout.tp)
            zero3 = layout.zero_stage == 3 and layout.zero_shards > 1
            fwd_layer, bwd_layer = parallel_block_seconds(arch, degrees, layout.sp, zero3, microbatch_seqs, seq,
                                                          threads)
        else:
            fwd_layer, bwd_layer = block_seconds(arch, microbatch_seqs, seq, threads, layout.world)
        head_f, head_b = head_seconds(arch, layout.tp, tokens, threads, layout.world)
        share = _pipeline_share(layout, cluster.cores)
        fwd_layer, bwd_layer, head_f, head_b = (t * share for t in (fwd_layer, bwd_layer, head_f, head_b))
    recompute_layer = {"none": 0.0, "full": fwd_layer, "selective": fwd_layer / 2, "op": elem}[layout.ac]
    forward = n * fwd_layer + head_f
    recompute = n * recompute_layer
    backward = n * bwd_layer + recompute + head_b
    return StageCompute(forward, backward, recompute, n, measured)
