"""Mixture-of-experts pricing: which layers of the busiest stage are MoE layers, how the experts'
parameters split over expert parallelism (ep) and ZeRO, the experts' element-wise work and
activations, and the ep all-to-alls.

The layout is torchtitan's (and meshtrain's): ep is carved out of dp_shard x cp; each rank holds
E/ep routed experts, whole (experts are not tensor-parallel: with tp > 1 each tp rank routes 1/tp of
the tokens, the sequence split). Attention, the dense MLPs and the shared experts are tp-split as in
a dense model. Expert gradients are averaged over the expert-data-parallel group
(dp_replicate x dp_shard x cp / ep, times tp) and ZeRO shards the experts over its dp_shard x cp / ep
x tp part; dense parameters keep their dp x cp group.

Per MoE layer and micro-batch the dispatch is a count exchange (a tiny all-to-all), the token
all-to-all over the ep group (each rank sends its tokens/tp x top_k rows of dim activations), the
experts, and the reverse all-to-all of the same size; backward runs the two big ones again and
recomputation repeats the forward's. Routing is taken as balanced (what the published benchmarks
force): every rank computes tokens/tp x top_k (x the capacity factor when below 1) expert rows.
"""

from __future__ import annotations

from .architectures import Arch
from .clusters import Cluster
from .collectives import Group, beside, group_of
from .compute import ACT_BYTES, stage_layers
from .layout import Layout

COUNT_BYTES = 8
"""Bytes per expert of the count exchange (one int64 token count per expert)."""
GEMM_K_REF = 4096
"""Reduction dimension at and above which a GEMM runs at the cluster's ``matmul_efficiency``: the
smallest model width (Llama 3 8B) among the dense runs that efficiency was set on."""


def stage_layer_mix(arch: Arch, layout: Layout) -> tuple[int, int]:
    """(dense layers, MoE layers) of the busiest pipeline stage: as many MoE layers as it can hold
    (a MoE layer holds and computes at least what a dense one does)."""
    n = stage_layers(arch, layout)
    moe = min(n, arch.moe_layers)
    return n - moe, moe


def stage_param_split(arch: Arch, layout: Layout) -> tuple[float, float]:
    """(dense, routed-expert) parameters one rank holds before ZeRO: the busiest stage's blocks and
    ends split over tp; its MoE layers' routed experts split over ep (not over tp)."""
    n_dense, n_moe = stage_layer_mix(arch, layout)
    blocks = n_dense * arch.params_per_layer() + n_moe * (arch.params_per_layer(True) - arch.routed_params_per_layer())
    ends = arch.embedding_params() + arch.head_params() if layout.pp == 1 else \
        max(arch.embedding_params(), arch.head_params())
    return (blocks + ends) / layout.tp, n_moe * arch.routed_params_per_layer() / layout.ep


def block_param_split(arch: Arch, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters of one block on one rank (a MoE block where the model has them):
    the unit ZeRO-3 gathers."""
    if arch.moe_layers == 0:
        return arch.params_per_layer() / layout.tp, 0.0
    routed = arch.routed_params_per_layer()
    return (arch.params_per_layer(True) - routed) / layout.tp, routed / layout.ep


def routed_rows(arch: Arch, layout: Layout) -> float:
    """Expert rows (token, expert pairs) one rank computes per token of its micro-batch: each tp
    rank routes 1/tp of the tokens, top_k each, and ep ranks swap them evenly."""
    return arch.moe_top_k * arch.routed_share() / layout.tp


def expert_rows(arch: Arch, layout: Layout, tokens: float) -> float:
    """Rows one local expert computes per micro-batch (balanced routing): the ep group's routed rows
    spread over the n_experts (``tokens``: the rank's micro-batch share before the tp split)."""
    return tokens * routed_rows(arch, layout) * layout.ep / arch.n_experts


def grouped_gemm_slowdown(arch: Arch, layout: Layout, cluster: Cluster, tokens: float) -> float:
    """How much longer the routed experts' grouped GEMMs take than ``matmul_efficiency`` prices (>= 1).

    Grouping costs little by itself: DeepGEMM's table has 8 groups of 4096 rows at 1288 TFLOPS
    against 1304 for one GEMM of the same N and K. What costs is the expert's small reduction
    dimension: a GEMM with reduction K runs at K / (K + k0) of its long-K rate (``gemm_k0``), taken
    relative to ``GEMM_K_REF``. Each expert runs six GEMMs: fc1 (gate and up, dim -> 2 x width) and
    fc2 (width -> dim), each forward (K = its input width), input gradient (K = its output width)
    and weight gradient (K = the expert's rows); FLOP-weighted 2:1."""
    if not cluster.gemm_k0 or not arch.is_moe:
        return 1.0
    k0 = cluster.gemm_k0 / (1.0 if layout.precision == "fp8" else cluster.fp8_speedup)

    def rate(k: float) -> float:
        return min(1.0, (k / (k + k0)) / (GEMM_K_REF / (GEMM_K_REF + k0)))

    d, f, rows = arch.dim, arch.expert_ffn, max(1.0, expert_rows(arch, layout, tokens))
    gemms = [(2, d), (2, 2 * f), (2, rows), (1, f), (1, d), (1, rows)]
    return sum(w / rate(k) for w, k in gemms) / sum(w for w, _ in gemms)


def moe_elementwise(arch: Arch, layout: Layout) -> float:
    """Elements a MoE layer's MLP part reads and writes per token on this rank besides the matmuls
    (the dense layer's counterpart is its SwiGLU): the shared experts' SwiGLU (3 x width, tp-split);
    per routed row the experts' SwiGLU (3 x expert width) and its dim-wide copies: the gather into
    expert order (read, write) and the weighted combine (read), plus, with ep > 1 and several local
    experts, the re-sort by local expert after the dispatch and its undoing before the combine (read,
    write each): 3 or 7 x dim; plus the router's fp32 scores, softmax and top-k (about 6 x
    n_experts element-equivalents per token routed here) and the combined output (dim)."""
    rows = routed_rows(arch, layout)
    moves = 7 if layout.ep > 1 and arch.n_experts > layout.ep else 3
    shared = 3 * arch.shared_ffn / layout.tp
    return shared + rows * (3 * arch.expert_ffn + moves * arch.dim) + (arch.dim + 6 * arch.n_experts) / layout.tp


def moe_activations(arch: Arch, layout: Layout) -> tuple[float, float]:
    """(elements kept for backward per token by a MoE layer's MLP part, of them the element-wise
    outputs that ``op`` checkpointing recomputes): the shared experts' SwiGLU inputs (3 x width);
    per routed row the dispatched input (dim), the SwiGLU's inputs (3 x expert width) and the
    expert's output that the weighted combine needs (dim); the router's fp32 scores (2 x n_experts
    in 2-byte elements)."""
    rows = routed_rows(arch, layout)
    kept = 3 * arch.shared_ffn / layout.tp + rows * (2 * arch.dim + 3 * arch.expert_ffn) + \
        2 * arch.n_experts / layout.tp
    recomputed = arch.shared_ffn / layout.tp + rows * arch.expert_ffn  # the SwiGLU products
    return kept, recomputed


def all_to_all(nbytes: float, group: Group, cluster: Cluster) -> tuple[float, str]:
    """(seconds, algorithm) of an all-to-all in which each member sends ``nbytes`` in all, an equal
    share to every member (its own share stays put). The shares to members on the same node go over
    ``intra``, the rest over ``inter``, each at its level's bus bandwidth (nccl-tests' all-to-all
    busbw = algbw x (p-1)/p, so a one-node all-to-all costs (p-1)/p x n / busbw). On NCCL the two
    levels move at once (NVLink and the NICs are separate links) and a grouped send/recv pays one
    latency per level; a host transport pays one latency per message and shares its memory
    bandwidth between the levels, as the comm library's cost model charges direct algorithms."""
    p = group.size
    if p <= 1 or nbytes <= 0:
        return 0.0, "none"
    k = min(group.local, p)
    near, far = nbytes * (k - 1) / p, nbytes * (p - k) / p
    t_near, t_far = near / cluster.intra.bandwidth, far / cluster.inter.bandwidth
    if cluster.backend == "nccl":
        latency = (cluster.intra.latency if k > 1 else 0.0) + (cluster.inter.latency if p > k else 0.0)
        return latency + max(t_near, t_far), "direct" if p == k else "direct (NVLink + NIC)"
    latency = (k - 1) * cluster.intra.latency + (p - k) * cluster.inter.latency
    return latency + t_near + t_far, "direct"


def ep_dispatch_bytes(arch: Arch, layout: Layout, tokens: float) -> float:
    """Bytes one rank sends in one token all-to-all of a MoE layer: its routed rows of dim
    activations (``tokens`` is the rank's micro-batch share before the tp split)."""
    return tokens * routed_rows(arch, layout) * arch.dim * ACT_BYTES[layout.precision]


def ep_times(arch: Arch, layout: Layout, cluster: Cluster, tokens: float, algos: dict[str, str]) -> tuple[float, float]:
    """(forward, backward) seconds of the busiest stage's ep all-to-alls for one micro-batch:
    per MoE layer the count exchange and two token all-to-alls forward, two backward, and the
    forward's again in the backward as far as recomputation repeats the forward (``full``: all,
    ``selective``: half the blocks; ``op`` recomputes element-wise ops only)."""
    if layout.ep <= 1 or arch.moe_layers == 0:
        return 0.0, 0.0
    group = group_of(layout, cluster, ("ep",))
    big, algos["ep all_to_all"] = all_to_all(ep_dispatch_bytes(arch, layout, tokens), group, cluster)
    count, _ = all_to_all(COUNT_BYTES * arch.n_experts, group, cluster)
    _, n_moe = stage_layer_mix(arch, layout)
    forward = n_moe * (count + 2 * big)
    recompute = {"none": 0.0, "op": 0.0, "selective": 0.5, "full": 1.0}[layout.ac]
    return forward, n_moe * 2 * big + recompute * forward


EP_COMM_SMS = 20
"""SMs the ep all-to-all's kernels hold while they run beside compute: DeepEP's normal kernels at
Megatron-Core's default ``moe_deepep_num_sms`` = 20 (``TransformerConfig``; DeepEP's own
``Buffer.set_num_sms``), the dispatcher the overlapped published run uses."""


def ep_exposed(layout: Layout, ep_f: float, ep_b: float, compute_f: float, compute_b: float,
               sm_count: int = 0) -> tuple[float, float]:
    """The ep all-to-all seconds left on the critical path of one micro-batch (forward, backward):
    all of them in meshtrain (the dispatch waits for its tokens); under a peer's overlap
    (``ep_overlap``, Megatron's ``overlap_moe_expert_parallel_comm``, which runs one micro-batch's
    forward beside another's backward) what exceeds the compute they hide behind, or, where larger,
    what the compute loses to the SMs the all-to-all holds meanwhile (``EP_COMM_SMS`` of
    ``sm_count``): compute W beside a transfer of T on a share s of the SMs takes max(T, W + s T)."""
    if not layout.ep_overlap:
        return ep_f, ep_b
    total = ep_f + ep_b
    share = EP_COMM_SMS / sm_count if sm_count else 0.0
    exposed = beside(total, compute_f + compute_b, share)
    return (exposed * ep_f / total, exposed * ep_b / total) if total > 0 else (0.0, 0.0)
