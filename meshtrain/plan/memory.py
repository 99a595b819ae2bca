"""Bytes one rank holds at its peak: parameters, gradients and optimizer state by ZeRO stage,
activations at the pipeline schedule's peak in flight, and buffers.

meshtrain (like torchtitan's FSDP2 setup) keeps fp32 master weights, fp32 gradients and AdamW's two
fp32 moments: 4 + 4 + 8 = 16 bytes per parameter, sharded over the dp x cp group by ZeRO stage
(1: optimizer state, 2: + gradients, 3: + parameters), so ZeRO-3 holds 16·N/(dp·cp) bytes.

Activations per block and token follow Korthikanti et al. 2022 (arXiv 2205.05198), sbh(34 + 5as/h)
bytes for GPT without parallelism, redone for what meshtrain's block keeps with a fused attention
(no s x s scores): the two norms' inputs and outputs (4h, split over tp only with sequence
parallelism), with sequence parallelism the all-gathered inputs of the attention and the MLP (2h,
whole: meshtrain's and torchtitan's column-parallel linears save the gathered input for their weight
gradient; Megatron saves its shard and gathers again in backward, not modelled), q, k, v and the
attention output (2h + 2·kv), and the MLP's inputs to its last matrix (3·ffn for SwiGLU, 2·ffn for
GELU), split over tp; times the activation's bytes. For GPT-3 this is
32h bytes per token, Korthikanti's 34h without the dropout masks.

A mixture-of-experts model's routed experts are held E/ep per rank, whole (not tp-split), and ZeRO
shards them over their own group, (dp_shard x cp / ep) x tp; its MoE layers keep, per routed row,
the dispatched input, the experts' SwiGLU inputs and their outputs (``moe.py``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from ..parallel.pipeline.schedule import Action, build_schedule, peak_in_flight
from .architectures import Arch
from .attention_unfused import saved_bytes_per_element, score_elements
from .compute import ACT_BYTES
from .layout import Layout
from .moe import block_param_split, moe_activations, stage_layer_mix, stage_param_split

MASTER, GRAD, ADAM = 4, 4, 8
# Gradient buckets cost no memory of their own: DataParallel's ``.grad`` tensors are views into them,
# and ZeRO-1/2's units are the parameters' own flat buffers (their sizes: ``buckets.py``).


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes of one rank, by what holds them."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    runtime: float = 0.0
    """What a training process holds besides the model (a host's interpreter, torch, data; 0 on GPUs)."""
    host: float = 0.0
    """Host memory ZeRO CPU offload holds for the rank (masters, AdamW state, gradient staging);
    not part of ``total``, the device's."""

    @property
    def total(self) -> float:
        """Sum of the device's parts (``host`` is not one)."""
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.runtime

    def as_dict(self) -> dict[str, float]:
        """The parts and the total, for JSON."""
        return {**asdict(self), "total": self.total}


def stage_params(arch: Arch, layout: Layout) -> float:
    """Parameters one rank holds before ZeRO: the busiest stage's blocks, plus the embedding and the
    head on the stages that hold them, split over tp (a MoE model's routed experts over ep instead:
    ``moe.stage_param_split``)."""
    return sum(stage_param_split(arch, layout))


def activation_bytes_per_token(arch: Arch, layout: Layout, moe: bool = False) -> float:
    """Bytes one block (a MoE block if ``moe``) keeps for backward per token on this rank, without
    checkpointing."""
    stream = 4 * arch.dim / (layout.tp if layout.sp else 1)
    if layout.sp and layout.tp > 1:  # the attention's (and a dense MLP's) all-gathered input, which its
        stream += arch.dim * (1 if moe else 2)  # column-parallel linears save whole for their weight gradient
    split = (arch.q_dim + arch.o_dim + 2 * arch.kv_dim) / layout.tp
    split += moe_activations(arch, layout)[0] if moe else (3 if arch.gated_mlp else 2) * arch.ffn_dim / layout.tp
    return (stream + split) * ACT_BYTES[layout.precision]


def _op_recomputed_bytes_per_token(arch: Arch, layout: Layout, moe: bool) -> float:
    """Of a MoE block's activations, the element-wise outputs ``op`` checkpointing recomputes: the
    norms' outputs and the SwiGLU products."""
    mlp = moe_activations(arch, layout)[1] if moe else arch.ffn_dim / layout.tp
    return (2 * arch.dim / (layout.tp if layout.sp else 1) + mlp) * ACT_BYTES[layout.precision]


def op_kept_bytes_per_token(arch: Arch, layout: Layout) -> float:
    """Bytes a dense block keeps per token under torchtitan's selective op checkpointing: its input
    (the residual stream), the attention kernel's output, and the outputs of every other matmul of
    ``compute.matmul_chain`` (the 1st, 3rd, ...: Llama's wq, wv, w1, w2; the policy recomputes the
    rest, ``compute.op_recomputed_matmul_share``). A column-parallel matmul's output is split over tp; a
    row-parallel one (attention's output projection, the MLP's last) is the full width on each rank
    before its reduction, whose output (reduce-scatter with sequence parallelism, also saved) adds dim/tp."""
    tp, d = layout.tp, arch.dim
    stream = d / (tp if layout.sp else 1)
    row = d + (d / tp if layout.sp else 0.0)
    if arch.mla is not None:
        m = arch.mla
        attn = [m.q_lora_rank, arch.q_dim / tp, m.kv_lora_rank + m.qk_rope_dim,
                arch.n_heads * (m.qk_nope_dim + m.v_head_dim) / tp, row]
    else:
        kv = arch.kv_dim / min(tp, arch.n_kv_heads)
        attn = [arch.q_dim / tp, kv, kv, row]
    mlp = [arch.ffn_dim / tp] * 2 + [row] if arch.gated_mlp else [arch.ffn_dim / tp, row]
    widths = attn + mlp
    return (stream + arch.o_dim / tp + sum(widths[0::2])) * ACT_BYTES[layout.precision]


def loss_bytes_per_vocab(precision: str, compiled: bool = False) -> float:
    """Bytes per token and vocabulary entry (of this rank's tp share) live at the loss's peak, the start
    of backward: with bf16 (or fp8) compute the logits come out in bf16 and are up-cast for the
    cross-entropy, whose log-softmax output (fp32) is saved; its backward then holds that output, the
    incoming gradient and the input gradient (fp32 each) while the bf16 gradient is written: 2 + 3 x 4 =
    14. fp32: the logits and their gradient, 8 (as validated on this host's runs). A compiled loss
    (``Layout.loss_compiled``) fuses the up-cast, the log-softmax and its backward: it saves the logits
    (and a per-token log-sum-exp) and writes their gradient from them in one kernel, 2 + 2 = 4 at bf16."""
    if precision == "fp32":
        return 8.0
    return 4.0 if compiled else 2.0 + 3 * 4.0


def block_input_bytes_per_token(arch: Arch, layout: Layout) -> float:
    """Bytes of a checkpointed block's input per token (the residual stream, split over tp with SP)."""
    return arch.dim / (layout.tp if layout.sp else 1) * ACT_BYTES[layout.precision]


@lru_cache(maxsize=8)
def built_schedule(schedule: str, pp: int, m: int, v: int) -> list[list[Action]]:
    """``build_schedule``'s lists, kept for the step-time model's simulation of the same layout (read
    only: one predict asks both; the search's schedules reach tens of thousands of actions)."""
    return build_schedule(schedule, pp, m, v)


@lru_cache(maxsize=4096)
def microbatches_in_flight(schedule: str, pp: int, m: int, v: int) -> float:
    """Micro-batches of a whole stage's activations rank 0 holds at its peak: ``peak_in_flight`` of the
    schedule (chunks of 1/v of the stage each under interleaving); 1 without a pipeline."""
    if pp == 1:
        return 1.0
    return peak_in_flight(built_schedule(schedule, pp, m, v)[0]) / v


def activation_memory(arch: Arch, layout: Layout, microbatch_seqs: int, seq: int, held_grad: float = 0.0) -> float:
    """Activation bytes at the rank's peak: stored blocks for the micro-batches in flight, one block
    being recomputed (checkpointing), and the loss on the last stage (``loss_bytes_per_vocab``) or,
    where larger, ``held_grad``: a gradient that lives from the head's backward on (ZeRO-3's root unit,
    ``root_gradient_bytes``), after the loss's temporaries are freed, so one or the other."""
    tokens = microbatch_seqs * seq / layout.cp
    inp = block_input_bytes_per_token(arch, layout)
    stored, transient = 0.0, 0.0
    for count, moe in zip(stage_layer_mix(arch, layout), (False, True)):
        if not count:
            continue
        full = activation_bytes_per_token(arch, layout, moe)
        if layout.attn_kernel == "unfused":  # the s x s scores kept for backward (cp = 1)
            full += score_elements(arch, layout, 1, seq) * saved_bytes_per_element(ACT_BYTES[layout.precision])
        # "op": torchtitan's policy keeps every other matmul output of a dense block; a MoE block's
        # element-wise results are recomputed (the norms' outputs and the SwiGLU products)
        op = full - _op_recomputed_bytes_per_token(arch, layout, moe) if moe else \
            min(full, op_kept_bytes_per_token(arch, layout))
        stored += count * {"none": full, "op": op, "full": inp, "selective": (full + inp) / 2}[layout.ac]
        transient = max(transient, full if layout.ac in ("full", "selective") else 0.0)
    flight = microbatches_in_flight(layout.schedule, layout.pp, layout.microbatches, layout.virtual)
    logits = loss_bytes_per_vocab(layout.precision, layout.loss_compiled) * arch.vocab_size / layout.tp
    return tokens * (flight * stored + transient) + max(tokens * logits, held_grad)


def sharded(arch: Arch, layout: Layout, nbytes: float, stage: int) -> float:
    """Bytes per rank of a state of ``nbytes`` per parameter that ZeRO shards from ``stage`` on: dense
    parameters over dp_shard x cp (HSDP: dp_replicate copies), experts over their (dp_shard x cp /
    ep) x tp shard group."""
    dense, experts = stage_param_split(arch, layout)
    if layout.zero_stage < stage:
        return nbytes * (dense + experts)
    return nbytes * (dense / layout.zero_shards + experts / layout.expert_shards)


def memory_per_rank(arch: Arch, layout: Layout, microbatch_seqs: int, seq: int) -> MemoryBreakdown:
    """Peak bytes of one rank under ``layout`` (without CPU offload: ``offload.offload_memory``)."""
    dense, experts = stage_param_split(arch, layout)
    z = layout.zero_stage
    params, grads, optimizer = (sharded(arch, layout, MASTER, 3), sharded(arch, layout, GRAD, 2),
                                sharded(arch, layout, ADAM, 1))
    block = sum(block_param_split(arch, layout))
    low = 0 if layout.precision == "fp32" else ACT_BYTES[layout.precision]  # the compute dtype's bytes
    held = 0.0
    if z >= 3:  # one block gathered (in the compute dtype) for compute, the next prefetched, the
        # current block's full gradient; the root unit gathered for the whole step (without a
        # pipeline: with one, the stage's weights stay gathered, ``step.predict`` adds them)
        buffers = 2 * block * (low or MASTER) + block * GRAD
        if layout.pp == 1:
            buffers += root_params(arch, layout) * (low or MASTER)
        held = root_gradient_bytes(arch, layout)
    else:  # autocast's low-precision weight copies alive at the peak (the gradients are the buckets)
        buffers = compute_copies_at_peak(arch, layout) * low
    act = activation_memory(arch, layout, microbatch_seqs, seq, held)
    return MemoryBreakdown(params, grads, optimizer, act, buffers)


def root_params(arch: Arch, layout: Layout) -> float:
    """Parameters of the stage outside its blocks, ZeRO-3's root unit: the embedding, the final norm
    and the head without a pipeline; with one, the busiest stage's end (as ``compute_copies_at_peak``).
    Split over tp. Both meshtrain's ZeRO-3 (``ZeroModel.forward``) and PyTorch FSDP2 (the root module is
    not resharded after forward) keep it gathered from the forward through the backward."""
    if layout.pp == 1:
        return (arch.embedding_params() + arch.head_params()) / layout.tp
    return max(arch.embedding_params(), arch.head_params()) / layout.tp


def root_gradient_bytes(arch: Arch, layout: Layout) -> float:
    """Bytes of ZeRO-3's root-unit gradient held through the backward: meshtrain's root unit takes the
    head's gradient into its full fp32 buffer and reduce-scatters it only once the embedding's arrives,
    last. FSDP2 holds only the head's gradient, in the compute dtype, until the same point: for a
    peer's run this overcounts, but in every published row the loss's temporaries are larger and
    ``activation_memory`` takes those."""
    return root_params(arch, layout) * GRAD if layout.zero_stage >= 3 else 0.0


def compute_copies_at_peak(arch: Arch, layout: Layout) -> float:
    """Parameters whose compute-dtype copy (autocast's cast of an fp32 weight) is alive at the peak, the
    start of backward: a copy lives as long as a saved activation needs it for its backward. Without
    checkpointing (or with ``op``, which saves matmul outputs and so the casts their backward reads)
    that is every block of the stage; ``selective`` keeps half the blocks' activations, so half their
    copies; ``full`` saves none, so only the block being recomputed holds its copy; the output head's
    copy is saved in every case. The embedding is a lookup (no cast)."""
    n_dense, n_moe = stage_layer_mix(arch, layout)
    n = n_dense + n_moe
    dense, experts = stage_param_split(arch, layout)
    if layout.pp == 1:  # both ends on this rank: only the head is cast
        held, cast = arch.embedding_params() + arch.head_params(), arch.head_params()
    else:  # the busiest stage's end (``stage_param_split``), taken as the head
        held = cast = max(arch.embedding_params(), arch.head_params())
    ends = cast / layout.tp
    blocks = dense + experts - held / layout.tp
    saved = {"none": n, "op": n, "selective": math.ceil(n / 2), "full": min(1, n)}[layout.ac]
    return blocks * saved / max(n, 1) + ends


def peer_gradient_bytes(arch: Arch, layout: Layout) -> float:
    """Bytes of the data-parallel peers' gradient buckets that one rank's resident set maps, on a host
    whose ranks share memory (the shm transport): without ZeRO the buckets are symmetric shared
    memory that the all-reduce reads in place, so rank i reads slice i of each of the g - 1 peers'
    buckets and then their own reduced slice: 2(g - 1)/g of the gradients. The pages are shared,
    not copied, but every rank's resident set counts them."""
    g = layout.dp * layout.cp
    if layout.zero_stage > 0 or g == 1:
        return 0.0
    return stage_params(arch, layout) * GRAD * peer_read_fraction(g)


def peer_read_fraction(group: int) -> float:
    """How much of one symmetric tensor's size a rank maps from its peers in an in-place shm
    all-reduce over ``group`` ranks: its own slice of each peer, then each peer's reduced slice."""
    return 2 * (group - 1) / group


def fits(mem: MemoryBreakdown, capacity: float) -> bool:
    """True if the peak fits in ``capacity`` bytes."""
    return mem.total <= capacity and math.isfinite(mem.total)
