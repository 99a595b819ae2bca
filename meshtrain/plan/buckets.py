"""Gradient buckets as the runtime cuts them: the size, how many, and the last one's bytes.

meshtrain's DataParallel and ZeRO-1/2 reduce gradients in buckets of ``bucket_cap_mb`` ("auto" by
default): ``parallel.bucket_size.auto_bucket_bytes``, imported here, is the one rule, the smallest
bucket whose latency is ``ALPHA_SHARE`` of its ring transfer, capped at a quarter of the gradients and
clamped to 1-256 MiB. What it is fed is what ``resolve_bucket_cap`` feeds it on the cluster:

* NCCL: groups are not measured (``bucket_size.measures``) and their cost model is never fitted (NCCL's
  own collectives are picked before any calibration), so the rule sees the torch transport's registry
  model (``select.default_model("torch")``: a generic network link) and no call latency;
* a host: the calibrated shm model (the cluster's link, ``host.cached_cost_model``) and the measured
  time of one small collective (``collective_latency``, the planner's stand-in for ``call_latency``).

A peer's run (``opg=1``: Megatron's distributed optimizer) keeps Megatron's default instead:
``max(40e6, 1e6 x dp)`` parameters a bucket (``DistributedDataParallelConfig.bucket_size``).

Each bucket is one collective (its own latency); the last bucket backward completes cannot overlap
backward. Both wrappers fill buckets in reverse registration order, whole tensors only (a tensor
larger than the cap is a bucket of its own), DataParallel after a 1 MiB first one: ``pack`` replays
that on the stage's tensors (``registered_tensors``), so on a stage holding the embedding (the first
parameter registered, the last gradient produced) the last bucket is at least the embedding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..comm.select import CostModel, default_model
from ..parallel.bucket_size import MiB, auto_bucket_bytes
from .architectures import Arch
from .clusters import Cluster
from .collectives import Group, collective
from .layout import Layout

FIRST_BUCKET = 1 * MiB
"""DataParallel's first bucket (``first_bucket_mb``), so the first reduction starts early."""
MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PER_RANK = 40_000_000, 1_000_000
"""Megatron-LM's default bucket, parameters: max(40e6, 1e6 x the data-parallel size)."""


@dataclass(frozen=True)
class Buckets:
    """How one set of gradients is cut for its reduction."""

    cap: int
    """Bytes a bucket holds at most."""
    count: int
    """Buckets (one collective each)."""
    tail: float
    """Bytes of the last bucket backward completes: its reduction is exposed."""


def runtime_link(cluster: Cluster, call_s: float = 0.0) -> tuple[CostModel, float]:
    """(cost model, seconds of one near-empty call) that ``bucket_cap_mb = "auto"`` sizes buckets from
    on ``cluster``: on NCCL the torch transport's unfitted registry model and no call; on a host the
    calibrated link and ``call_s``, the measured small collective."""
    if cluster.backend == "nccl":
        return default_model("torch"), 0.0
    return cluster.intra.cost_model(gamma=cluster.reduce_gamma), call_s


def registered_tensors(arch: Arch, layout: Layout, elem_bytes: int = 4) -> list[float] | None:
    """Bytes of each gradient of the busiest stage (``stage_param_split``'s: all of it without a
    pipeline, else the last stage's blocks, final norm and head), in meshtrain's registration order
    (``models/llama.py``: embedding; per block attn_norm, wq, wk, wv, wo, mlp_norm, w1, w3, w2; norm;
    head unless tied), matrices split over tp. None for a mixture of experts (not replayed)."""
    if arch.is_moe or arch.mla is not None:
        return None
    from .compute import stage_layers  # compute builds on collectives, as this module does

    d, tp = arch.dim, layout.tp
    block = [d, d * arch.q_dim / tp, d * arch.kv_dim / tp, d * arch.kv_dim / tp, arch.o_dim * d / tp, d,
             *[d * arch.ffn_dim / tp] * (3 if arch.gated_mlp else 2)]
    emb = arch.vocab_size * d / tp
    head = [] if arch.tie_embeddings else [emb]
    first = [emb] if layout.pp == 1 else []
    sizes = first + block * stage_layers(arch, layout) + [d] + head
    return [n * elem_bytes for n in sizes]


def pack(tensors: Sequence[float], cap: float, first: float) -> list[float]:
    """Bucket sizes as the runtime fills them: tensors in reverse order, whole, a new bucket when the
    next would overflow (the first bucket at ``first``, the rest at ``cap``): ``build_buckets`` for
    DataParallel (its 1 MiB first bucket), ``split_by_bytes`` for ZeRO-1/2 (``first`` = ``cap``). In
    the order backward completes them: the last holds the first tensor registered."""
    out: list[float] = []
    cur, n = 0.0, 0
    for size in reversed(tensors):
        if n and cur + size > (first if not out else cap):
            out.append(cur)
            cur, n = 0.0, 0
        cur, n = cur + size, n + 1
    if n:
        out.append(cur)
    return out


def bucket_plan(cluster: Cluster, layout: Layout, grad_bytes: float, group: Group, op: str, *,
                elem_bytes: int = 4, tensors: Sequence[float] | None = None, call_s: float = 0.0) -> Buckets:
    """The buckets ``grad_bytes`` of gradients make when ``op`` ("all_reduce": DataParallel,
    "reduce_scatter": ZeRO-1/2) reduces them over ``group``: the runtime's rule (``auto_bucket_bytes``
    on ``runtime_link``) or, for a Megatron run (``opg=1``), Megatron's default. With the gradients'
    ``tensors`` (bytes, registration order) the runtime's fill is replayed (``pack``); without, they
    are taken as even buckets of the cap."""
    if grad_bytes <= 0:
        return Buckets(1, 0, 0.0)
    if layout.overlap_param_gather:
        cap = int(max(MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PER_RANK * group.size) * elem_bytes)
        first = cap
    else:
        model, call = runtime_link(cluster, call_s)
        cap, _ = auto_bucket_bytes(model, int(grad_bytes), group.size, op, call_s=call)
        first = min(FIRST_BUCKET, cap) if op == "all_reduce" else cap
    if tensors:
        filled = pack(tensors, cap, first)
        return Buckets(cap, len(filled), filled[-1])
    count = 1 + math.ceil(max(0.0, grad_bytes - first) / cap)
    return Buckets(cap, count, min(float(cap), grad_bytes))


def bucketed(op: str, buckets: Buckets, grad_bytes: float, group: Group, cluster: Cluster) -> tuple[float, str]:
    """(seconds, algorithm) of ``op`` over every bucket: ``count`` collectives of an even share of
    ``grad_bytes`` each, so each pays its own latency."""
    if buckets.count <= 0:
        return 0.0, "none"
    t, algo = collective(op, grad_bytes / buckets.count, group, cluster)
    return buckets.count * t, algo


def tail_seconds(op: str, buckets: Buckets, group: Group, cluster: Cluster) -> float:
    """Seconds of the last bucket's ``op``, which waits for the end of backward."""
    return collective(op, buckets.tail, group, cluster)[0] if buckets.count else 0.0
