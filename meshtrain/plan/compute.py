"""Per-layer roofline: the time one rank spends computing one micro-batch on its pipeline stage.

Three kinds of work, each at its own roof:

* matmuls with weights: FLOPs at ``matmul_efficiency`` of peak (float8 ``fp8_speedup`` faster);
* causal attention: FLOPs at the attention kernel's measured rate (``attention_rate``: torch's flash
  attention, FlashAttention-2, or cuDNN's fused attention; forward and backward apart, slower on short
  sequences by the kernel's published length curve);
* element-wise ops (norms, rotary, SwiGLU, residual adds): bytes at ``hbm_efficiency`` of the memory
  bandwidth. What ``torch.compile`` saves is counted per op class (``ELEMENTWISE``): the bytes the
  eager kernels of each class move against the one fused kernel's, so compile speeds up only the
  element-wise part and only where eager runs several kernels (RMSNorm, rotary, SwiGLU), never the
  matmuls or attention.

Backward is twice the forward's matmuls (input and weight gradients), the attention kernel's backward
(2.5x the forward's FLOPs, at its own rate) and twice its element-wise traffic. Ring attention (cp > 1)
adds its per-step merge of partial outputs (``ring_merge_bytes``). Activation checkpointing adds forward
work to the backward: ``full`` all of it, ``selective`` (meshtrain: every 2nd block) half of it, ``op``
(torchtitan's selective op policy) the element-wise part and every second matmul of a block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..models.flops import flops_per_token
from .architectures import Arch
from .attention_unfused import unfused_attention_seconds
from .clusters import FA2_OVER_FA1, Cluster
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


# Attention kernels' measured length curves on an H100 SXM5, head dim 128, causal forward and
# backward, TFLOP/s at 512 ... 16K tokens (Shah et al., FlashAttention-3, arXiv 2407.08608, the figures
# "Attention forward/backward speed, head dim 128 (H100 80GB SXM5)"). Only their shape is used: the
# rate at L tokens over the rate at 16K (short causal sequences waste more of each tile on the mask
# and leave a tail of idle SMs); the level is the cluster's efficiency.
ATTN_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
ATTN_CURVES = {("sdpa", "fwd"): (191, 260, 298, 319, 333, 335), ("sdpa", "bwd"): (214, 260, 291, 310, 318, 322),
               ("cudnn", "fwd"): (315, 410, 484, 518, 529, 539), ("cudnn", "bwd"): (305, 408, 465, 499, 518, 516)}


@lru_cache(maxsize=8192)
def attention_rate(cluster: Cluster, layout: Layout, length: float, backward: bool = False) -> float:
    """FLOP/s the attention kernel reaches on causal calls of ``length`` query tokens (for ring attention
    a step's block, S/cp): the cluster's long-sequence efficiency (forward or backward) times the
    kernel's length curve, times ``fused_attention_speedup`` for cuDNN's kernel (``attn=cudnn``);
    ``fa1_attention_efficiency`` for a FlashAttention-1-class kernel (``attn=triton``, on
    FlashAttention-2's curve). A host (profiled or its roofline) takes its efficiency flat."""
    peak = cluster.per_rank_peak(layout.world, layout.precision)
    eff = cluster.attention_bwd_efficiency if backward else cluster.attention_efficiency
    if layout.attn_kernel == "cudnn":
        eff *= cluster.fused_attention_speedup
    elif layout.attn_kernel == "triton":  # FlashAttention-1 class: its own level, FA2's length curve
        eff = cluster.fa1_attention_efficiency or eff / FA2_OVER_FA1
    if cluster.memory_shared:
        return peak * eff
    kernel = "cudnn" if layout.attn_kernel == "cudnn" else "sdpa"
    curve = ATTN_CURVES[(kernel, "bwd" if backward else "fwd")]
    x = math.log2(min(max(length, ATTN_LENGTHS[0]), ATTN_LENGTHS[-1]))
    i = min(int(x) - 9, len(ATTN_LENGTHS) - 2)  # 2^9 = 512
    rate = curve[i] + (curve[i + 1] - curve[i]) * (x - 9 - i)
    return peak * eff * rate / curve[-1]


def attention_backward_ratio(cluster: Cluster, layout: Layout, seq: int) -> float:
    """Seconds of the attention backward per second of its forward: 2.5x the FLOPs (flash attention's
    backward recomputes the scores: five matmuls to the forward's two) at the backward kernel's rate."""
    length = seq / layout.cp
    return 2.5 * attention_rate(cluster, layout, length) / attention_rate(cluster, layout, length, backward=True)


def _upcast(a: int) -> int:
    """Bytes an eager fp32 up-cast and the matching down-cast move per element of an ``a``-byte tensor
    (x.float(): read a, write 4; .type_as(x): read 4, write a); nothing for fp32 tensors."""
    return 2 * (a + 4) if a < 4 else 0


def elementwise_bytes(op: str, a: int, eager: bool) -> float:
    """Bytes one element-wise op class moves per element of its tensor (activation bytes ``a``), eager
    or fused (one compiled kernel: read its inputs once, write its output once). Counted from the
    kernels eager PyTorch launches for the code torchtitan and meshtrain run:

    * rmsnorm: x.float() and .type_as() (``_upcast``), pow (r4 w4), mean (r4), x * rsqrt (r4 w4),
      * weight (r a, w a): 36 bytes at bf16; fused r a + w a = 4;
    * layernorm: ``F.layer_norm`` is one kernel even eagerly: 2a both ways;
    * rotary (on q and k): up-cast, complex (or cos/sin) multiply r4 w4, down-cast: 20 at bf16; fused 2a;
    * swiglu: silu (r a, w a) then the product (r 2a, w a): 5a; fused r 2a w a = 3a;
    * gelu: one kernel, 2a both; residual add: r 2a w a = 3a both (nothing to fuse it with here)."""
    counts = {"rmsnorm": (_upcast(a) + 20 + 2 * a, 2 * a), "layernorm": (2 * a, 2 * a),
              "rotary": (_upcast(a) + 8, 2 * a), "swiglu": (5 * a, 3 * a), "gelu": (2 * a, 2 * a),
              "residual": (3 * a, 3 * a)}
    return counts[op][0 if eager else 1]


def attention_kv_width(arch: Arch, layout: Layout) -> float:
    """Elements per token of one of K, V as this rank's attention call gets it: its kv heads (at least
    one per tp rank), or every query head's under ``kvrep=1`` (the peer repeats them first)."""
    if layout.kv_repeat:
        return arch.n_heads * arch.kv_dim / arch.n_kv_heads / layout.tp
    return arch.kv_dim / min(layout.tp, arch.n_kv_heads)


def ring_merge_bytes(arch: Arch, layout: Layout) -> tuple[float, float]:
    """(forward, backward) bytes per token of a block that ring attention's bookkeeping moves on top of
    the attention kernel, counted from PyTorch's ``_templated_ring_attention`` and its backward (torch
    ``distributed/tensor/experimental/_attention.py``; eager, in fp32, even under compile). Per element
    of the output (= query) width q and of K and V together (2 x ``attention_kv_width``), activation
    bytes a, u = a + 4 for an up- or down-cast (0 in fp32):

    * forward: the first block's output up-cast (u); each of the cp - 1 steps after it merges
      (``_SDPAMerger``): up-cast (u) and ``out - sigmoid(lse_b - lse) * (out - out_b)``, three fp32
      passes (32); the steps that take half the queries (half of them on average) do that on their
      half and then re-concatenate the whole output (r4 w4): 0.75 u + 28 a step on average; each step
      but the last concatenates K and V for the rotation (r a w a); the result is cast back once (u);
    * backward: fp32 accumulators for dq, dk, dv zeroed (4) and cast back at the end (u); each of the
      cp steps adds the kernel's gradients into them (r4 ra w4), the half-size steps through
      ``_partial_update`` (half the add, then a whole r4 w4 copy): 8 + a + (8 - a)/4 on average;
      each step concatenates dK and dV for the pass (r4 w4) and, but the last, K and V (r a w a)."""
    if layout.cp == 1:
        return 0.0, 0.0
    a = ACT_BYTES[layout.precision]
    u = a + 4 if a < 4 else 0
    cp, steps = layout.cp, layout.cp - 1
    q, kv = arch.o_dim / layout.tp, 2 * attention_kv_width(arch, layout)
    fwd = steps * (q * (0.75 * u + 28) + kv * 2 * a) + q * 2 * u
    add = 8 + a + (8 - a) / 4
    bwd = (q + kv) * (4 + u) + cp * (q + kv) * add + cp * kv * 8 + steps * kv * 2 * a
    return fwd, bwd


@lru_cache(maxsize=8192)
def elementwise_per_token(arch: Arch, layout: Layout, cluster: Cluster, moe: bool = False) -> float:
    """Forward bytes of one block's element-wise ops per token on this rank: two norms and two residual
    adds on the residual stream (split over tp only with sequence parallelism), rotary on q and k, the
    MLP's activation (tp-split); for a MoE block its SwiGLUs and row copies (``moe_elementwise``). Eager
    counts times ``eager_elementwise_passes`` (1.0 on the presets), unless compiled."""
    a, eager = ACT_BYTES[layout.precision], not layout.compile
    stream = arch.dim / (layout.tp if layout.sp else 1)
    total = 2 * stream * (elementwise_bytes(arch.norm, a, eager) + elementwise_bytes("residual", a, eager))
    if arch.rotary:
        total += (arch.q_dim + arch.kv_dim) / layout.tp * elementwise_bytes("rotary", a, eager)
    if layout.kv_repeat:  # K and V copied to every query head (r a, w a; compile cannot skip it: SDPA reads them)
        total += 2 * (attention_kv_width(arch, layout) + arch.kv_dim / min(layout.tp, arch.n_kv_heads)) * a
    if moe:
        from .moe import moe_elementwise, routed_rows  # moe builds on this module

        swiglu = 3 * arch.shared_ffn / layout.tp + routed_rows(arch, layout) * 3 * arch.expert_ffn
        # the SwiGLUs fuse like a dense one; the row copies (gathers, sorts, the combine) are one kernel each
        total += swiglu / 3 * elementwise_bytes("swiglu", a, eager) + (moe_elementwise(arch, layout) - swiglu) * a
    else:
        total += arch.ffn_dim / layout.tp * elementwise_bytes("swiglu" if arch.gated_mlp else "gelu", a, eager)
    if layout.precision == "fp8":
        total += fp8_cast_bytes_per_token(arch, layout, moe)
    return total * (cluster.eager_elementwise_passes if eager else 1.0)


FP8_CAST_BYTES = 2 * 2 + 1 + 2
"""Bytes per element of one float8 operand with dynamic per-tensor ("tensorwise", TE's current)
scaling, bf16 in: its amax (read 2), the scaled cast (read 2, write 1), and the transposed fp8 copy
Hopper's fp8 GEMM needs for the other gradient (read 1, write 1). The amax must finish before the
cast, so compile cannot fold the passes into one (torchao's float8 training, which torchtitan runs)."""


def fp8_cast_bytes_per_token(arch: Arch, layout: Layout, moe: bool = False) -> float:
    """Bytes per token of one block that float8 training's casts move on top of the bf16 element-wise
    work: every linear casts its input in forward and its output gradient in backward (counted in the
    forward's budget at a third, since the element-wise backward is priced at twice the forward).
    Under tensor parallelism each rank casts its own share: the sequence-parallel shard of a
    column-parallel input before the all-gather (torchao's ``Float8ColwiseParallel``), the tp-split
    widths elsewhere. Each matmul of ``matmul_chain`` is taken as dim on one side (MLA's low-rank
    projections approximately so). A MoE block adds its experts' rows: fc1 (dim in, 2 x width out)
    and fc2 (width in, dim out)."""
    stream = arch.dim / (layout.tp if layout.sp else 1)
    # per matmul: its dim-wide side (tp-split with sequence parallelism) and its other, tp-split side
    elements = sum(params / arch.dim / layout.tp + stream for params in matmul_chain(arch, moe))
    if moe:
        from .moe import routed_rows  # moe builds on this module

        rows = routed_rows(arch, layout) + (arch.n_shared_experts > 0) / layout.tp
        elements += rows * (2 * arch.dim + 3 * arch.expert_ffn)
    return elements / 3 * FP8_CAST_BYTES


def layer_forward_parts(arch: Arch, layout: Layout, cluster: Cluster, tokens: int, seq: int,
                        moe: bool = False) -> tuple[float, float, float]:
    """Forward seconds of one block (a MoE block if ``moe``) on ``tokens`` tokens of this rank:
    (matmul, attention, element-wise). Ring attention's forward merge is in the element-wise part."""
    peak = cluster.per_rank_peak(layout.world, layout.precision)
    # a MoE block's active weights: each tp rank routes 1/tp of the tokens to top_k whole experts,
    # so its routed FLOPs split over tp like the tp-split attention and shared experts
    mm_flops = 2.0 * arch.active_matmul_params_per_layer(moe) / layout.tp * tokens
    # narrow matmuls (small reduction dims: tp-split widths, small models) run slower (``dense_gemm_factors``)
    chain_flops = 2.0 * sum(matmul_chain(arch, moe)) / layout.tp * tokens
    mm_flops += chain_flops * (dense_gemm_factors(arch, layout, cluster, tokens, moe)[0] - 1.0)
    if moe:  # the routed experts' grouped GEMMs run slower than large GEMMs (small reduction dims)
        from .moe import grouped_gemm_slowdown  # moe builds on this module

        routed = 2.0 * arch.moe_top_k * arch.routed_share() * arch.expert_params() / layout.tp * tokens
        mm_flops += routed * (grouped_gemm_slowdown(arch, layout, cluster, tokens) - 1.0)
    mm_rate = peak * cluster.matmul_efficiency * (cluster.fp8_speedup if layout.precision == "fp8" else 1.0)
    # causal: each query attends to half the keys on average; QK^T and AV are 2·S·q and 2·S·o FLOPs
    # per token when not causal (q = o = d but for wide heads or MLA). With cp each rank holds S/cp
    # queries against all S keys (load-balanced: each ring step does 1/cp of the rank's work).
    attn_flops = seq * (arch.q_dim + arch.o_dim) / layout.tp * tokens
    if layout.attn_kernel == "unfused":  # every score computed and moved through memory (cp = 1)
        attn = unfused_attention_seconds(arch, layout, cluster, tokens, seq, ACT_BYTES[layout.precision])[0]
    else:
        attn = attn_flops / attention_rate(cluster, layout, seq / layout.cp)
    merge_f, _ = ring_merge_bytes(arch, layout)
    elem_bytes = (elementwise_per_token(arch, layout, cluster, moe) + merge_f) * tokens
    return mm_flops / mm_rate, attn, elem_bytes / cluster.per_rank_bandwidth(layout.world)


@lru_cache(maxsize=256)
def matmul_chain(arch: Arch, moe: bool = False) -> tuple[float, ...]:
    """A dense block's weight matmuls in the order its forward runs them (parameters each): attention's
    q, k, v and output projections (MLA: q down, q up, kv down, kv up, output), then the MLP's w1, w3,
    w2 (SwiGLU) or fc1, fc2. A MoE block: its attention projections only (the grouped expert GEMMs are
    not ``aten.mm`` calls, which torchtitan's policy below counts)."""
    d = arch.dim
    if arch.mla is not None:
        m = arch.mla
        attn = [d * m.q_lora_rank, m.q_lora_rank * arch.q_dim, d * (m.kv_lora_rank + m.qk_rope_dim),
                m.kv_lora_rank * arch.n_heads * (m.qk_nope_dim + m.v_head_dim), arch.o_dim * d]
    else:
        attn = [d * arch.q_dim, d * arch.kv_dim, d * arch.kv_dim, arch.o_dim * d]
    if moe:
        return tuple(attn)
    mlp = [d * arch.ffn_dim] * 3 if arch.gated_mlp else [d * arch.ffn_dim] * 2
    return tuple(attn + mlp)


def op_recomputed_matmul_share(arch: Arch, moe: bool = False) -> float:
    """Of a block's forward matmul FLOPs, the share torchtitan's selective op checkpointing recomputes:
    its policy saves every ``aten.mm`` output but every second one of each block (torchtitan
    ``parallelize_llama._apply_ac_to_transformer_block``: ``mm_count % 2 == 0`` recomputed), so the 2nd,
    4th, 6th ... matmuls of ``matmul_chain`` run again in backward (Llama: wk, wo, w3). 0 for a MoE block
    (its experts' grouped GEMMs are kept; only its element-wise work is recomputed)."""
    if moe:
        return 0.0
    chain = matmul_chain(arch)
    return sum(chain[1::2]) / arch.matmul_params_per_layer()


@lru_cache(maxsize=8192)
def dense_gemm_factors(arch: Arch, layout: Layout, cluster: Cluster, tokens: float,
                       moe: bool = False) -> tuple[float, float]:
    """(forward, backward) time factors (>= 1) of a block's weight matmuls (a MoE block: its attention
    projections) from their small reduction dimensions, the law ``moe.grouped_gemm_slowdown`` applies to
    experts: a GEMM reducing over K runs at K / (K + k0) of its long-K rate (``gemm_k0``, fitted to
    DeepGEMM's kernel table), relative to K = ``GEMM_K_REF`` (4096) and never faster than
    ``matmul_efficiency``. Per matmul of ``matmul_chain`` on this rank: forward K = its input width
    (the full dim for a column-parallel one, its tp share for a row-parallel one), input gradient K =
    its output width, weight gradient K = the tokens; FLOP-weighted."""
    if not cluster.gemm_k0:
        return 1.0, 1.0
    from .moe import GEMM_K_REF  # moe builds on this module

    k0 = cluster.gemm_k0 / (1.0 if layout.precision == "fp8" else cluster.fp8_speedup)

    def slow(k: float) -> float:
        return max(1.0, (GEMM_K_REF / (GEMM_K_REF + k0)) / (k / (k + k0)))

    chain = matmul_chain(arch, moe)
    n_mlp = 0 if moe else (3 if arch.gated_mlp else 2)
    rows = (len(chain) - n_mlp - 1, len(chain) - 1)  # attention's output projection, the MLP's last
    fwd = bwd = 0.0
    for i, params in enumerate(chain):
        if i in rows:  # row-parallel: reads its tp share, writes the full dim
            k_in, k_out = params / arch.dim / layout.tp, arch.dim
        else:
            k_in, k_out = arch.dim, params / arch.dim / layout.tp
        fwd += params * slow(k_in)
        bwd += params * (slow(k_out) + slow(tokens)) / 2
    total = sum(chain)
    return fwd / total, bwd / total


def loss_bytes_per_logit(precision: str, compiled: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes the cross-entropy moves per logit, counted from the kernels PyTorch's
    eager ``F.cross_entropy(logits.float(), labels)`` launches (torchtitan's and meshtrain's loss) for a
    vocabulary row too long for shared memory (128K fp32 logits are 512 KB), so each pass goes to memory:

    * forward: the up-cast (read a, write 4; none in fp32), log-softmax's max pass (r4), sum-of-exp
      pass (r4) and output pass (r4 w4): 22 bytes at bf16;
    * backward: nll_loss's zero-filled fp32 gradient (w4), log-softmax's backward, a sum pass over the
      gradient (r4) and the output pass (r4 gradient, r4 saved output, w4), the down-cast (r4 w a):
      26 bytes at bf16 (48 a logit in all; Megatron's unfused vocab-parallel loss, counted alike from
      ``cross_entropy.py``, moves 52);
    * compiled (``Layout.loss_compiled``): one kernel each way, reading the logits once forward and once
      backward and writing their gradient: a and 2a."""
    a = ACT_BYTES[precision]
    if compiled:
        return float(a), 2.0 * a
    cast = _upcast(a) / 2  # one way
    return cast + 16.0, 4.0 + 16.0 + cast


def head_seconds_analytic(arch: Arch, layout: Layout, cluster: Cluster, tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds of the output head and the loss (vocabulary split over tp) on
    ``tokens``: the logits' matmul (its backward twice the FLOPs) and the loss's passes over the logits
    (``loss_bytes_per_logit``)."""
    peak = cluster.per_rank_peak(layout.world, layout.precision)
    gemm = 2.0 * arch.vocab_size * arch.dim / layout.tp * tokens / (peak * cluster.matmul_efficiency)
    fwd, bwd = loss_bytes_per_logit(layout.precision, layout.loss_compiled)
    per_byte = arch.vocab_size / layout.tp * tokens / cluster.per_rank_bandwidth(layout.world)
    return gemm + fwd * per_byte, 2 * gemm + bwd * per_byte


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


def _backward_gemm_ratio(arch: Arch, layout: Layout, cluster: Cluster, tokens: float) -> float:
    """Backward matmul seconds over twice the forward's, for the busiest stage's dense blocks: their
    backward GEMMs reduce over other dimensions (``dense_gemm_factors``); 1 for MoE blocks and hosts."""
    n_dense, n_moe = _layer_mix(arch, layout)
    if n_moe or cluster.memory_shared:
        return 1.0
    fwd, bwd = dense_gemm_factors(arch, layout, cluster, tokens)
    return bwd / fwd


def _layer_mix(arch: Arch, layout: Layout) -> tuple[int, int]:
    """(dense, MoE) blocks of the busiest stage (``moe.stage_layer_mix``)."""
    from .moe import stage_layer_mix  # moe builds on this module

    return stage_layer_mix(arch, layout)


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
    merge_f, merge_b = ring_merge_bytes(arch, layout)  # ring attention: forward merge is in elem
    elem_b = 2 * (elem - merge_f * tokens / cluster.per_rank_bandwidth(layout.world)) + \
        merge_b * tokens / cluster.per_rank_bandwidth(layout.world)
    if layout.attn_kernel == "unfused":  # the same in a dense and a MoE block
        attn_b = unfused_attention_seconds(arch, layout, cluster, tokens, seq, ACT_BYTES[layout.precision])[1]
    else:
        attn_b = attention_backward_ratio(cluster, layout, seq) * attn
    bwd_layer = 2 * mm * _backward_gemm_ratio(arch, layout, cluster, tokens) + attn_b + elem_b
    head_f, head_b = head_seconds_analytic(arch, layout, cluster, tokens)
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
    n_dense, n_moe = _layer_mix(arch, layout)
    op_share = n_dense * op_recomputed_matmul_share(arch) / max(n_dense + n_moe, 1)
    recompute_layer = {"none": 0.0, "full": fwd_layer, "selective": fwd_layer / 2,
                       "op": elem + op_share * mm}[layout.ac]
    forward = n * fwd_layer + head_f
    recompute = n * recompute_layer
    backward = n * bwd_layer + recompute + head_b
    return StageCompute(forward, backward, recompute, n, measured)
