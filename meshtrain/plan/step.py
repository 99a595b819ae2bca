"""One training step's time on a layout: compute, exposed communication per dimension, pipeline
bubble; with memory per rank and MFU, as a ``Prediction``.

Per micro-batch on the busiest stage: compute (``compute.stage_compute``), tensor-parallel
collectives (2 all-gathers + 2 reduce-scatters per block each way with sequence parallelism, 2
all-reduces without; recomputation repeats the forward's), ring-attention K/V exchange (each of cp-1
steps hidden behind that step's attention when shorter), the pipeline send to the next stage and,
for a mixture of experts, the ep all-to-alls of its MoE layers (``moe.py``).
Those per-action times go through the schedule simulator (``simulate``), whose makespan minus the
busy time is the bubble. Data-parallel / ZeRO collectives of the stage's parameters hide behind the
backward (ZeRO-3's gathers behind the forward too), except the last bucket (the runtime's buckets,
``buckets.py``; ZeRO-3: the last block's share); the exposed rest
and the optimizer's memory-bound update are added after the pipeline; with ZeRO CPU offload the
update runs on the host's CPUs and the exposed PCIe copies are added too (``offload.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..errors import ConfigError
from ..parallel.pipeline.schedule import bubble_fraction, simulate
from .architectures import Arch
from .clusters import Cluster
from .collectives import beside, collective, group_of, p2p
from .compute import (ACT_BYTES, StageCompute, attention_backward_ratio, attention_kv_width, layer_forward_parts,
                      matmul_chain, model_flops_per_token, stage_compute)
from .layout import Layout, validate
from .buckets import Buckets, bucket_plan, bucketed, registered_tensors, tail_seconds
from .memory import (GRAD, MASTER, MemoryBreakdown, built_schedule, memory_per_rank, peer_gradient_bytes, sharded,
                     stage_params)
from .moe import ep_exposed, ep_times, stage_layer_mix, stage_param_split
from .offload import offload_memory, offload_step
from .profile import MAX_PROFILED_ELEMENTS, optimizer_seconds, stage_tensor_sizes, threads_per_rank
from .profile_parallel import collective_latency


@dataclass
class Prediction:
    """Predicted step of one layout."""

    layout: Layout
    step_time: float
    parts: dict[str, float]
    """Seconds: compute, tp, cp, pp, ep, dp (exposed communication per dimension), bubble, optimizer (on
    the host's CPUs with offload), pcie (offload's exposed host <-> device copies) and sync (this host:
    the step's small collectives' measured fixed cost; 0 elsewhere)."""
    memory: MemoryBreakdown
    capacity: float
    """Bytes a rank may use on the cluster."""
    tokens_per_s_per_gpu: float
    mfu: float
    algorithms: dict[str, str] = field(default_factory=dict)
    """Collective -> the algorithm auto would pick for it."""
    host_capacity: float = math.inf
    """Host bytes a rank may hold (its share of the node's memory; inf where the cluster does not say)."""
    memory_margin: float = 0.0
    """Fraction of ``capacity`` kept free (``--memory-margin``): the peak must fit in the rest, since the
    prediction is a model and the allocator fragments (``search`` and the CLI set it; 0 elsewhere)."""

    @property
    def memory_limit(self) -> float:
        """Bytes the predicted peak may reach: ``capacity`` less the margin."""
        return self.capacity * (1.0 - self.memory_margin)

    @property
    def fits(self) -> bool:
        """True if the peak memory fits in a rank's capacity less the margin, and offload's host bytes
        in its share."""
        return self.memory.total <= self.memory_limit and self.memory.host <= self.host_capacity

    def as_dict(self) -> dict:
        """JSON-ready form."""
        host = self.host_capacity if math.isfinite(self.host_capacity) else None
        return {"layout": self.layout.label(), "step_time_s": self.step_time, "parts_s": self.parts,
                "memory_bytes": self.memory.as_dict(), "capacity_bytes": self.capacity, "host_capacity_bytes": host,
                "memory_margin": self.memory_margin, "memory_limit_bytes": self.memory_limit, "fits": self.fits,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu, "algorithms": self.algorithms}


DEFAULT_MEMORY_MARGIN = 0.10
"""``--memory-margin``'s default: a layout fits if its predicted peak is at most 90 % of a rank's memory."""


def check_memory_margin(margin: object) -> float:
    """``margin`` as a float, or ConfigError naming ``--memory-margin`` unless 0 <= margin < 1."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ConfigError(f"--memory-margin {margin!r}: must be a fraction from 0 (no margin) up to, not "
                          f"including, 1 (no memory left); use e.g. --memory-margin {DEFAULT_MEMORY_MARGIN}")
    return float(margin)


@lru_cache(maxsize=8192)
def simulated_bubble(schedule: str, pp: int, m: int, v: int) -> float:
    """Idle fraction of the schedule simulator's timeline (``simulate`` at b = 2f, then
    ``bubble_fraction``). For 1F1B and AFAB it does not depend on b/f; interleaved moves by under a
    percent point over the b/f of 2-3.3 that recomputation spans, so one simulation serves every layout."""
    return bubble_fraction(simulate(built_schedule(schedule, pp, m, v), 1.0, 2.0))


def pipeline_time(layout: Layout, f: float, b: float) -> float:
    """Seconds for all micro-batches through the pipeline, each action costing f (forward) or b
    (backward) per stage: every rank is busy m(f + b), stretched by the simulated bubble."""
    busy = layout.microbatches * (f + b)
    if layout.pp == 1:
        return busy
    return busy / (1.0 - simulated_bubble(layout.schedule, layout.pp, layout.microbatches, layout.virtual))


def predict(arch: Arch, cluster: Cluster, layout: Layout, global_batch: int, seq: int) -> Prediction:
    """The predicted step of ``layout`` (validated first: ConfigError names the fix)."""
    validate(layout, arch, layout.world, global_batch, seq)
    mb = global_batch // layout.dp // layout.microbatches
    sc = stage_compute(arch, layout, cluster, mb, seq)
    act = ACT_BYTES[layout.precision]
    tokens = mb * seq // layout.cp
    algos: dict[str, str] = {}

    # tensor parallel: per block, 2 collectives each way on the microbatch's hidden states
    recompute_share = {"none": 0.0, "op": 0.0, "selective": 0.5, "full": 1.0}[layout.ac]
    tp_f, tp_b = _tensor_parallel(arch, cluster, layout, tokens, seq, algos)
    tp_b += tp_f * recompute_share  # recomputation repeats the forward's collectives

    # context parallel: ring attention's K/V exchange, hidden behind each step's attention if shorter
    cp_f = cp_b = 0.0
    if layout.cp > 1:
        cp_f, cp_b = _context_parallel(arch, cluster, layout, tokens, seq, algos)
        cp_f, cp_b = sc.layers * cp_f, sc.layers * (cp_b + recompute_share * cp_f)

    # pipeline: each chunk sends its output forward and its input gradient back
    pp_f = pp_b = 0.0
    if layout.pp > 1:
        same = group_of(layout, cluster, ("pp",)).local > 1
        send = p2p(tokens * arch.dim / (layout.tp if layout.sp else 1) * act, same, cluster)
        pp_f = pp_b = send * layout.virtual
        if layout.p2p_overlap:  # each chunk's transfer runs beside the next chunk's compute
            pp_f = layout.virtual * max(0.0, send - sc.forward / layout.virtual)
            pp_b = layout.virtual * max(0.0, send - sc.backward / layout.virtual)
        algos["pp"] = "p2p"

    # expert parallelism: the MoE layers' token all-to-alls (exposed unless a peer's overlap hides them)
    ep_f, ep_b = ep_exposed(layout, *ep_times(arch, layout, cluster, tokens, algos), sc.forward, sc.backward,
                            cluster.sm_count)

    # a block timed with its collectives (this-host) already holds tp and cp: the breakdown below
    # still shows their analytic share, taken out of compute
    inner_f, inner_b = (0.0, 0.0) if sc.comm_measured else (tp_f + cp_f, tp_b + cp_b)
    f = sc.forward + inner_f + pp_f + ep_f
    b = sc.backward + inner_b + pp_b + ep_b
    makespan = pipeline_time(layout, f, b)
    m = layout.microbatches
    busy = m * (f + b)

    # data parallel / ZeRO over dp x cp, on this rank's stage parameters
    dp_exposed, opt_params = _data_parallel(arch, cluster, layout, sc, f - pp_f - ep_f, b - pp_b - ep_b, algos)
    # AdamW: read params, grads, two moments; write params and moments (fp32) at memory speed
    optimizer = opt_params * 28 / cluster.per_rank_bandwidth(layout.world)
    if cluster.profile_compute and not arch.is_moe:  # a host's AdamW loops over tensors: time it
        sizes = stage_tensor_sizes(arch, layout.tp, sc.layers, layout.zero_shards, layout.zero_stage)
        if sum(sizes) <= MAX_PROFILED_ELEMENTS:
            optimizer = optimizer_seconds(sizes, threads_per_rank(layout.world), layout.world)

    pcie = 0.0
    if layout.offload != "none":  # the update on the host's CPUs, pipelined with the PCIe copies per unit
        optimizer, pcie = offload_step(cluster, layout, opt_params, _units(arch, cluster, layout, sc), optimizer)

    sync = _step_collectives(arch, cluster, layout, sc) if cluster.profile_compute and layout.world > 1 else 0.0
    step = makespan + dp_exposed + optimizer + pcie + sync
    shown = m * (tp_f + tp_b + cp_f + cp_b) if sc.comm_measured else 0.0
    parts = {"compute": max(0.0, m * (sc.forward + sc.backward) - shown), "tp": m * (tp_f + tp_b),
             "cp": m * (cp_f + cp_b), "pp": m * (pp_f + pp_b), "ep": m * (ep_f + ep_b), "dp": dp_exposed,
             "bubble": max(0.0, makespan - busy), "optimizer": optimizer, "pcie": pcie, "sync": sync}
    mem = offload_memory(memory_per_rank(arch, layout, mb, seq), layout, sharded(arch, layout, 1.0, 3),
                         sharded(arch, layout, 1.0, 1), staged=not cluster.memory_shared)
    if layout.zero_stage == 3 and layout.pp > 1:  # the stage's weights stay gathered across micro-batches
        mem = replace(mem, buffers=mem.buffers + stage_params(arch, layout) * act)
        if layout.fsdp_pp:  # PyTorch FSDP2 under a pipeline: and its unsharded fp32 gradients, until the last
            mem = replace(mem, buffers=mem.buffers + stage_params(arch, layout) * GRAD)
    if cluster.memory_shared:
        mem = replace(mem, buffers=mem.buffers + peer_gradient_bytes(arch, layout))
    if cluster.memory_shared:  # a host's offload moves nothing: the host memory is the rank's memory
        mem = replace(mem, buffers=mem.buffers + mem.host, host=0.0)
    mem = replace(mem, runtime=cluster.base_memory_bytes)
    tok = global_batch * seq / step / layout.world
    mfu = tok * model_flops_per_token(arch, seq) / cluster.per_rank_peak(layout.world, "bf16")
    host_capacity = cluster.host_memory_bytes / cluster.ranks_per_node(layout.world) if cluster.host_memory_bytes \
        else math.inf
    return Prediction(layout, step, parts, mem, cluster.memory_per_rank(layout.world), tok, mfu, algos,
                      host_capacity)


def _tensor_parallel(arch: Arch, cluster: Cluster, layout: Layout, tokens: int, seq: int,
                     algos: dict[str, str]) -> tuple[float, float]:
    """(forward, backward) exposed seconds of the stage's tensor-parallel collectives per micro-batch,
    recomputation not included. With sequence parallelism a block all-gathers its input before
    attention's and the MLP's first matmuls and reduce-scatters after their last ones; without, it
    all-reduces twice. A MoE block with SP routes its own 1/tp of the tokens: only attention (and
    tp-split shared experts) gather and scatter.

    Async TP (``atp=1``) splits each forward collective into tp pieces passed around the group while
    the adjacent matmul runs on the pieces already there (a collective matmul): the piece the rank holds
    starts at once, so (tp - 1)/tp of the matmul hides the collective and only what exceeds it is
    exposed: a gather beside attention's q, k, v projections, a reduce-scatter beside its output
    projection, the same pair in the MLP (w1 and w3; w2). Recomputation repeats the forward, overlapped
    alike. The backward's collectives stay whole: PyTorch's async TP reports "up to ~29% forward pass
    speedup and ~8% E2E speedup" for Llama 3 (discuss.pytorch.org/t/209487, "Introducing Async Tensor
    Parallelism in PyTorch"), an end-to-end gain only a forward-only overlap accounts for.

    Transformer Engine's userbuffers (``atpb=1``: Megatron's ``--tp-comm-overlap``, TE's default methods
    in ``initialize_ub``, TE 8e039fd of July 2024 and since) overlap the backward as well: the output
    gradient's gather beside the row-parallel dgrad GEMM (a ring exchange, like the forward's gathers);
    the saved input's gather beside the column-parallel dgrad GEMMs, and their input gradient's
    reduce-scatter beside their wgrad GEMMs ("bulk": the whole collective at once). The forward's
    reduce-scatters are pipelined in ``TE_PIPELINE_SPLITS`` pieces; they and the bulk ones run on
    ``TE_COMM_SMS`` SMs, which the GEMM beside them loses meanwhile (``beside``); the ring exchanges on one."""
    tp_group = group_of(layout, cluster, ("tp",))
    h_bytes = tokens * arch.dim * ACT_BYTES[layout.precision]
    n_dense, n_moe = stage_layer_mix(arch, layout)
    if not layout.sp:
        ar, algos["tp all_reduce"] = collective("all_reduce", h_bytes, tp_group, cluster)
        t = (n_dense + n_moe) * 2 * ar
        return t, t
    ag, algos["tp all_gather"] = collective("all_gather", h_bytes, tp_group, cluster)
    rs, algos["tp reduce_scatter"] = collective("reduce_scatter", h_bytes, tp_group, cluster)
    moe_mlp = 1.0 if arch.shared_ffn > 0 else 0.0  # a MoE block's MLP pair: only for shared experts
    if not layout.async_tp:
        per_block = 2 * (ag + rs)
        t = n_dense * per_block + n_moe * (ag + rs) * (1 + moe_mlp)
        return t, t
    algos["tp"] = "async (collective matmul)"
    hide = (layout.tp - 1) / layout.tp
    chain = matmul_chain(arch)
    n_mlp = 3 if arch.gated_mlp else 2
    attn, mlp = chain[:-n_mlp], chain[-n_mlp:]
    mm, _, _ = layer_forward_parts(arch, layout, cluster, tokens, seq)
    per_param = mm / sum(chain)  # forward matmul seconds per weight of the dense block

    # TE's pipelined and bulk collectives hold SMs beside their GEMM; PyTorch's use the copy engines
    # and cut the forward's reduce-scatter into TE_PIPELINE_SPLITS pieces, not tp
    share = TE_COMM_SMS / cluster.sm_count if layout.async_tp_backward and cluster.sm_count else 0.0
    rs_hide = (TE_PIPELINE_SPLITS - 1) / TE_PIPELINE_SPLITS if layout.async_tp_backward else hide

    def exposed(group: list[float], factor: float) -> float:
        """A gather beside the group's first matmuls, a reduce-scatter beside its last."""
        return max(0.0, ag - factor * per_param * sum(group[:-1]) * hide) + \
            beside(rs, factor * per_param * group[-1] * rs_hide, share)

    shared = moe_mlp * (ag + rs)  # a MoE block's shared experts: priced without overlap
    if layout.async_tp_backward:  # TE's userbuffers: the backward overlapped too

        def exposed_backward(group: list[float]) -> float:
            """The output gradient's gather beside the last matmul's dgrad (ring exchange); the saved
            input's gather beside the first matmuls' dgrad, their input gradient's scatter beside their
            wgrad (bulk; a dgrad or wgrad GEMM has the forward's FLOPs)."""
            first, last = per_param * sum(group[:-1]), per_param * group[-1]
            return beside(ag, last * hide) + beside(ag, first, share) + beside(rs, first, share)

        b = n_dense * (exposed_backward(attn) + exposed_backward(mlp)) + n_moe * (exposed_backward(attn) + shared)
    else:
        b = n_dense * 2 * (ag + rs) + n_moe * (ag + rs) * (1 + moe_mlp)  # backward: not decomposed
    f = n_dense * (exposed(attn, 1) + exposed(mlp, 1)) + n_moe * (exposed(attn, 1) + shared)
    return f, b


TE_COMM_SMS = 16
"""SMs Transformer Engine's pipelined and bulk userbuffers collectives hold beside a GEMM: ``num_sm``'s
default for every method but the ring exchange (1), with no SM margin kept for the GEMM
(``initialize_ub`` in ``transformer_engine/pytorch/module/base.py``, TE 8e039fd, July 2024)."""
TE_PIPELINE_SPLITS = 4
"""Pieces TE's pipelined reduce-scatter cuts a forward GEMM into (``num_splits``'s default there): the
first piece's GEMM runs before any of it can be scattered."""


def _context_parallel(arch: Arch, cluster: Cluster, layout: Layout, tokens: int, seq: int,
                      algos: dict[str, str]) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one block's ring-attention exchange per micro-batch.

    Load-balanced causal ring attention (torchtitan, Megatron and meshtrain give each rank chunks i and
    2cp-1-i) splits the rank's attention into cp equal steps; each step computes on the K/V block it
    holds while the next one travels (forward: K and V in the compute dtype; backward: K, V and the
    dK, dV accumulated in fp32 going round). A step's transfer is exposed only where it exceeds that
    step's attention: exposed = (cp - 1) x max(0, transfer - attention / cp). The accumulated dK, dV
    make one hop more, back to their owner after the last step, with nothing left to hide it (PyTorch's
    final ``dkv_rotater.next_buffer()``, meshtrain's last ``irecv``). With ``cpag=1`` (PyTorch's
    all-gather rotation) the K/V of every rank arrive in one all-gather hidden behind the first step
    only; the backward's dK, dV still go round step by step. K and V are as wide as the attention call
    gets them (``attention_kv_width``: full width under ``kvrep=1``). Ring members on different nodes
    move at the inter-node speed (each GPU its own NIC)."""
    act = ACT_BYTES[layout.precision]
    group = group_of(layout, cluster, ("cp",))
    same = group.nodes == 1
    kv = tokens * 2 * attention_kv_width(arch, layout) * act  # this rank's K and V
    grad_kv = kv / act * 4
    _, attn, _ = layer_forward_parts(arch, layout, cluster, tokens, seq)
    step_f = attn / layout.cp
    step_b = attention_backward_ratio(cluster, layout, seq) * attn / layout.cp
    steps = layout.cp - 1
    home = p2p(grad_kv, same, cluster)  # the last hop of the dK, dV accumulators
    if layout.cp_allgather:
        ag, algos["cp"] = collective("all_gather", kv * layout.cp, group, cluster)
        return max(0.0, ag - step_f), max(0.0, ag - step_b) + steps * max(0.0, home - step_b) + home
    algos["cp"] = "ring p2p"
    back = steps * max(0.0, p2p(kv + grad_kv, same, cluster) - step_b) + home
    return steps * max(0.0, p2p(kv, same, cluster) - step_f), back


def _gradient_sets(arch: Arch, layout: Layout) -> list[tuple[float, tuple[str, ...], tuple[str, ...], int, str]]:
    """The stage's gradient sets, each reduced with its own collectives: (parameters, all-reduce group,
    ZeRO shard group, shard size, label). Dense parameters over dp x cp (ZeRO shards over dp_shard x
    cp); a MoE model's routed experts over their expert-data-parallel group (dp x cp / ep) x tp."""
    dense, experts = stage_param_split(arch, layout)
    sets = [(dense, ("dp", "cp"), ("dp_shard", "cp"), layout.zero_shards, "dp")]
    if experts:
        sets.append((experts, ("edp",), ("edp_shard",), layout.expert_shards, "edp"))
    return sets


def gradient_buckets(arch: Arch, cluster: Cluster, layout: Layout, call_s: float = 0.0) -> list[Buckets]:
    """Per gradient set (``_gradient_sets``), the buckets ZeRO-0's all-reduce (DataParallel) or
    ZeRO-1/2's reduce-scatter cut its fp32 gradients into (``buckets.bucket_plan``: the runtime's
    ``bucket_cap_mb = "auto"`` rule); ZeRO-1/2's units are these buckets. On a stage holding the
    embedding (pp = 1) its gradient, produced last, is the last bucket when larger than the cap."""
    out = []
    for i, (p, full, shard_dims, _, _) in enumerate(_gradient_sets(arch, layout)):
        op = "all_reduce" if layout.zero_stage == 0 else "reduce_scatter"
        group = group_of(layout, cluster, full if op == "all_reduce" else shard_dims)
        tensors = registered_tensors(arch, layout, GRAD) if i == 0 else None
        out.append(bucket_plan(cluster, layout, p * GRAD, group, op, elem_bytes=GRAD, tensors=tensors,
                               call_s=call_s))
    return out


def _data_parallel(arch: Arch, cluster: Cluster, layout: Layout, sc: StageCompute, f: float, b: float,
                   algos: dict[str, str]) -> tuple[float, float]:
    """(exposed seconds of the dp/ZeRO collectives, parameters this rank's optimizer updates), per
    gradient set (``_gradient_sets``), one set after the other in the same windows.

    ZeRO-0 and ZeRO-1/2 reduce in buckets (``gradient_buckets``), each bucket one collective behind the
    backward, the last one exposed; ZeRO-1/2 then gather the updated weights unit by unit (a unit is
    a bucket). ZeRO-3's units are blocks, its gathers before each forward and backward."""
    z = layout.zero_stage
    layers = max(sc.layers, 1)
    rs = ag = rep_t = ar = tail = ag_tail = 0.0
    opt_params = 0.0
    buckets = gradient_buckets(arch, cluster, layout) if z < 3 else []
    for i, (p, full, shard_dims, shard, name) in enumerate(_gradient_sets(arch, layout)):
        if z == 0:  # every rank of the group a replica: one all-reduce per bucket
            group = group_of(layout, cluster, full)
            t, algo = bucketed("all_reduce", buckets[i], p * GRAD, group, cluster)
            ar += t
            if t:
                algos[f"{name} all_reduce"] = algo
                tail = max(tail, tail_seconds("all_reduce", buckets[i], group, cluster))
            opt_params += p
            continue
        g = group_of(layout, cluster, shard_dims)
        units = buckets[i] if z < 3 else Buckets(1, 1, p * GRAD)  # ZeRO-3: priced whole (units are blocks)
        t, algo = bucketed("reduce_scatter", units, p * GRAD, g, cluster)
        rs += t
        if t:
            algos[f"{name} reduce_scatter"] = algo
            tail = max(tail, tail_seconds("reduce_scatter", units, g, cluster))
        # HSDP: each shard's gradient is then all-reduced over the replicas, unit by unit, at the step (exposed)
        if layout.dp_replicate > 1:
            rep = group_of(layout, cluster, ("dp_replicate",))
            t, algos[f"{name}_replicate all_reduce"] = bucketed(
                "all_reduce", units if z < 3 else Buckets(1, layers + 1, 0.0), p * GRAD / shard, rep, cluster)
            rep_t += t
        # ZeRO-1/2 gather the updated fp32 weights after the step (a peer's opg: the compute dtype,
        # behind the next forward); ZeRO-3 gathers them in the compute dtype before each pass
        weight = MASTER if z in (1, 2) and not layout.overlap_param_gather else \
            (MASTER if layout.precision == "fp32" else 2)
        t, algo = bucketed("all_gather", units, p * weight, g, cluster)
        ag += t
        if t:
            algos[f"{name} all_gather"] = algo
            ag_tail = max(ag_tail, collective("all_gather", units.tail / GRAD * weight, g, cluster)[0])
        opt_params += p / shard
    if z == 0:  # bucketed behind the backward; the last bucket cannot overlap
        return (max(0.0, ar - b) + tail, opt_params) if ar else (0.0, opt_params)
    if z in (1, 2):  # gradients reduce-scatter behind the last backward, then the weights are gathered
        grads_exposed = max(0.0, rs - b) + tail + rep_t
        if layout.overlap_param_gather:  # behind the next forward, but for its first bucket
            return grads_exposed + max(0.0, ag - f) + ag_tail, opt_params
        return grads_exposed + ag, opt_params
    # ZeRO-3: weights gathered in the compute dtype before each forward and again before each backward
    # (once per step under a pipeline, which keeps them gathered across micro-batches)
    if sc.comm_measured:  # this-host timed each block as a ZeRO-3 unit, its gathers included
        return rep_t, opt_params
    times = layout.microbatches if layout.pp == 1 else 1
    exposed = times * (max(0.0, ag - f) + ag / layers + max(0.0, ag + rs / times - b) + rs / times / layers)
    return exposed + rep_t, opt_params


def _units(arch: Arch, cluster: Cluster, layout: Layout, sc: StageCompute, call_s: float = 0.0) -> int:
    """ZeRO's units of the stage's dense parameters: ZeRO-3 one per block and the root; ZeRO-1/2 the
    buckets (``gradient_buckets``); 0 without ZeRO."""
    if layout.zero_stage == 3:
        return sc.layers + 1
    return gradient_buckets(arch, cluster, layout, call_s)[0].count if layout.zero_stage else 0


def _step_collectives(arch: Arch, cluster: Cluster, layout: Layout, sc: StageCompute) -> float:
    """This host: the fixed cost of the small collectives a meshtrain step makes outside its blocks,
    beyond the alpha the analytic terms already charge: the loss (over pp, over dp x cp), the grad
    norm (one per axis it sums over), the data-parallel buckets, ZeRO-1/2's per-unit reduce-scatter
    and all-gather (units are buckets), ZeRO-3's root unit, HSDP's per-unit replica all-reduce. Each
    costs ``collective_latency`` of the layout's ranks (measured), which also sizes the buckets as the
    runtime's measured call does (``buckets.runtime_link``)."""
    lat = collective_latency(layout.world, threads_per_rank(layout.world))
    shards = layout.zero_shards > 1 and layout.zero_stage > 0
    count = (layout.pp > 1) + (layout.dp * layout.cp > 1)  # the loss
    count += (layout.pp > 1) + (layout.tp > 1) + shards  # the grad norm's axes
    units = _units(arch, cluster, layout, sc, lat)
    if layout.zero_stage == 0 and layout.dp * layout.cp > 1:
        count += gradient_buckets(arch, cluster, layout, lat)[0].count
    elif layout.zero_stage in (1, 2) and shards:
        count += 2 * units
    elif layout.zero_stage == 3 and shards:
        count += 3  # the root unit's gathers and reduce-scatter (the blocks' are in the profile)
    if layout.dp_replicate > 1 and layout.zero_stage:
        count += units
    return count * max(0.0, lat - cluster.intra.latency)
