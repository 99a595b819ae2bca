"""Alpha-beta times of the collectives a layout runs, with the algorithm the comm library's
``auto`` would choose on the cluster's topology.

Prices come from the comm library's own formulas (``meshtrain.comm.select.CostModel.predict``) for
the flat algorithms (ring, tree, halving-doubling, recursive doubling), evaluated on the slowest
link the group crosses, plus a two-level hierarchical algorithm priced per level (a step inside
each node on ``intra``, a ring of nodes on ``inter``, one NIC per GPU so every rail runs in
parallel). ``auto`` is the cheapest of them: what ``select.choose`` does from its cost model; on
NCCL clusters it takes NCCL's native collectives, whose ring/tree choice these same formulas
describe (NCCL's hierarchies serve all-reduce only: its reduce-scatter and all-gather cross nodes
as rings). The mesh is ordered (dp_replicate, dp_shard, pp, cp, tp) with tp innermost, as in
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
    best = _flat(op, nbytes, group.size, inter)  # a flat ring runs at the slowest link's speed
    k, nodes = group.local, group.nodes
    # NCCL's reduce-scatter and all-gather across nodes are rings (its tree and NVLS-tree
    # hierarchies serve all-reduce only); meshtrain's hierarchical runs where auto picks it itself
    if k > 1 and (cluster.backend != "nccl" or op == "all_reduce"):
        # hierarchical: inside the node on the full buffer, across nodes (k rails at once) on 1/k of it
        if op == "all_reduce":
            t = (intra.predict("reduce_scatter", "ring", int(nbytes), k)
                 + _flat("all_reduce", nbytes / k, nodes, inter)[0]
                 + intra.predict("all_gather", "ring", int(nbytes), k))
        else:
            t = intra.predict(op, "ring", int(nbytes), k) + _flat(op, nbytes / k, nodes, inter)[0]
        best = min(best, (t, "hierarchical"))
    return best


def p2p(nbytes: float, same_node: bool, cluster: Cluster) -> float:
    """Seconds to send ``nbytes`` to one peer (pipeline stages, ring-attention neighbours)."""
    level = cluster.intra if same_node else cluster.inter
    return level.latency + nbytes / level.bandwidth
