"""Alpha-beta times of the collectives a layout runs, with the algorithm the comm library's
``auto`` would choose on the cluster's topology.

Prices come from the comm library's own formulas (``meshtrain.comm.select.CostModel.predict``) for
the flat algorithms (ring, tree, halving-doubling, recursive doubling). On NCCL clusters (``auto``
takes NCCL's native collectives) a group inside a node runs on NVLink; a group across nodes runs
its rings on every NIC its members own at once (``cross_node_level``: k members a node drive k NICs),
for all-reduce, reduce-scatter and all-gather alike. On meshtrain's own backend the flat algorithms
run at the slowest link the group crosses, or its two-level hierarchical algorithm (a step inside
each node on ``intra``, a ring of nodes on ``inter`` on each rail); ``auto`` is the cheapest. The mesh is ordered (dp_replicate, dp_shard, pp, cp, tp) with tp innermost, as in
``meshtrain.mesh`` (Megatron's pipeline-outermost order on request, to price its runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..comm.select import CostModel
from .clusters import Cluster, Level
from .layout import Layout

FLAT = {"all_reduce": ("ring", "tree", "halving_doubling", "recursive_doubling"),
        "all_gather": ("ring", "recursive_doubling"),
        "reduce_scatter": ("ring",)}
ORDER = ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "pp", "cp", "tp")
"""The mesh's axes, slowest first (``meshtrain.mesh``): dp_shard is cut into the part outside and the
part inside an expert-parallel group (both 1 and dp_shard without ep)."""
MEGATRON_ORDER = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
"""Megatron-LM's order (tp-cp-ep-dp-pp, pipeline outermost), for ``rank_order="megatron"``."""
GROUPS = {"dp": ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep"),
          "dp_shard": ("dp_shard_mod_ep", "dp_shard_in_ep"),
          "ep": ("dp_shard_in_ep", "cp"),
          "edp": ("dp_replicate", "dp_shard_mod_ep", "tp"),
          "edp_shard": ("dp_shard_mod_ep", "tp")}
"""Names of groups spanning several axes: dp (the batch rows), dp_shard (ZeRO's dp part), ep (the
expert-parallel group), edp / edp_shard (the experts' data-parallel group and its ZeRO shards)."""


@dataclass(frozen=True)
class Group:
    """A process group's size and how its members lie on nodes."""

    size: int
    local: int
    """Members on one node (1: every member on its own node)."""

    @property
    def nodes(self) -> int:
        """Nodes the group spans."""
        return math.ceil(self.size / self.local)


def group_of(layout: Layout, cluster: Cluster, dims: tuple[str, ...]) -> Group:
    """The group of mesh dimensions ``dims`` (e.g. ("tp",), ("dp", "cp"), ("ep",)): its size and
    members per node."""
    if layout.rank_order == "megatron" and dims in (("ep",), ("edp",), ("edp_shard",)):
        return _megatron_expert_group(layout, cluster, dims[0])
    size, local = 1, 1
    order = MEGATRON_ORDER if layout.rank_order == "megatron" else ORDER
    dims = tuple(a for d in dims for a in GROUPS.get(d, (d,)))
    for d in dims:
        deg = getattr(layout, d)
        inner = math.prod(getattr(layout, e) for e in order[order.index(d) + 1:])
        # members of this dimension sit ``inner`` ranks apart; a node holds gpus_per_node ranks
        local *= max(1, min(deg, cluster.gpus_per_node // inner)) if inner < cluster.gpus_per_node else 1
        size *= deg
    return Group(size, min(local, size))


def _megatron_expert_group(layout: Layout, cluster: Cluster, dim: str) -> Group:
    """An expert group in Megatron's expert mesh ("parallel folding" with expert tensor parallelism
    1: its own order etp-ep-dp-pp), where each ep group is ep consecutive ranks and the experts'
    data-parallel replicas sit ep ranks apart."""
    per_node = cluster.gpus_per_node
    if dim == "ep":
        return Group(layout.ep, max(1, min(layout.ep, per_node)))
    size = layout.expert_shards * (layout.dp_replicate if dim == "edp" else 1)
    local = max(1, min(size, per_node // layout.ep)) if layout.ep < per_node else 1
    return Group(size, local)


def _model(level: Level, cluster: Cluster) -> CostModel:
    return level.cost_model(gamma=cluster.reduce_gamma)


def _flat(op: str, nbytes: float, p: int, model: CostModel) -> tuple[float, str]:
    return min((model.predict(op, a, int(nbytes), p), a) for a in FLAT[op])


def collective(op: str, nbytes: float, group: Group, cluster: Cluster) -> tuple[float, str]:
    """(seconds, algorithm) of ``op`` on ``nbytes`` (the full buffer: the all-reduced tensor, the
    all-gather's output, the reduce-scatter's input) over ``group``, as ``auto`` would run it."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0, "none"
    intra, inter = _model(cluster.intra, cluster), _model(cluster.inter, cluster)
    if group.nodes == 1:
        return _flat(op, nbytes, group.size, intra)
    k, nodes = group.local, group.nodes
    if cluster.backend == "nccl":
        # NCCL builds one ring (channel) per NIC: a group with k members on each node crosses each node
        # boundary on k NICs at once, so its rings (and trees) move k x the inter-node bus bandwidth,
        # up to the NVLink's (``cross_node_level``). All-reduce, reduce-scatter and all-gather alike.
        return _flat(op, nbytes, group.size, _model(cross_node_level(cluster, k), cluster))
    best = _flat(op, nbytes, group.size, inter)  # a flat ring runs at the slowest link's speed
    if k > 1:  # meshtrain's own backend: its hierarchical algorithm where auto picks it
        # hierarchical: inside the node on the full buffer, across nodes (k rails at once) on 1/k of it
        if op == "all_reduce":
            t = (intra.predict("reduce_scatter", "ring", int(nbytes), k)
                 + _flat("all_reduce", nbytes / k, nodes, inter)[0]
                 + intra.predict("all_gather", "ring", int(nbytes), k))
        else:
            t = intra.predict(op, "ring", int(nbytes), k) + _flat(op, nbytes / k, nodes, inter)[0]
        best = min(best, (t, "hierarchical"))
    return best


def cross_node_level(cluster: Cluster, members_per_node: int) -> Level:
    """The link a ring (or tree) of NCCL channels sees when its group spans nodes with
    ``members_per_node`` members on each: NCCL opens a channel per NIC and, with one NIC per GPU
    (rail-aligned), the group's k members drive k NICs, so the bus bandwidth is k x the per-NIC one,
    capped by the NVLink the ring also runs through inside each node. nccl-tests shows this: all_reduce
    across 8-GPU H100 nodes with a 400 Gb/s NDR NIC per GPU reaches a bus bandwidth of 400-450 GB/s
    (Saturn Cloud, "Validating Multi-Node GPU Clusters with NCCL Tests",
    https://saturncloud.io/blog/crusoe-nccl-cluster-validation), about 8 x the 45-50 GB/s of one NIC,
    where one ring at one NIC's speed would reach 45. Latency: the inter-node one."""
    bw = min(cluster.intra.bandwidth, max(1, members_per_node) * cluster.inter.bandwidth)
    return Level(cluster.inter.latency, bw)


def beside(comm: float, compute: float, sm_share: float = 0.0) -> float:
    """Seconds a transfer of ``comm`` adds to ``compute`` it runs beside, its kernels holding a share
    ``sm_share`` of the SMs meanwhile: compute W beside a transfer T takes max(T, W + s T), so what
    exceeds the compute, or where larger what the compute loses to the transfer's SMs."""
    return max(0.0, comm - compute, sm_share * comm)


def p2p(nbytes: float, same_node: bool, cluster: Cluster) -> float:
    """Seconds to send ``nbytes`` to one peer (pipeline stages, ring-attention neighbours)."""
    level = cluster.intra if same_node else cluster.inter
    return level.latency + nbytes / level.bandwidth
