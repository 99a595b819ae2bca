"""ZeRO CPU offload in the plan (``parallel.offload``; meshtrain/parallel/offload.py does it).

Memory. The fp32 masters (4 bytes) and AdamW's moments (8) of this rank's shard move to the host,
with a pinned buffer the shard gradient is copied into (4): 16 bytes per parameter of the shard.
The device keeps the compute copy in the compute dtype: the full weights at stages 1 and 2 (which
the rest of the model counts as fp32 weights plus autocast's low-precision copy: offloaded, that
pair is this one copy), ZeRO-3's shard for "optimizer", nothing for "params"; the gradients stay
as they are (they are reduced, unscaled and clipped on the device, and copied at the step).

Time. The optimizer step runs on the node's CPUs, a memory-bound fused AdamW at the cluster's
``host_adam_rate`` shared by the node's ranks, instead of on the GPU. The shard gradient crosses
PCIe to the host (4 bytes per parameter) and the updated master back (4; cast on the device), at
``pcie_bandwidth``, pipelined with the CPU unit by unit: the step takes the slowest of the three
streams plus one unit's copies to fill and drain the pipeline; what exceeds the CPU's time is the
exposed PCIe time (``parts["pcie"]``). With "params" every ZeRO-3 all-gather (before each forward
and each backward; once per step under a pipeline) first copies the shard over on the compute
stream: exposed too. On a host (``memory_shared``) nothing crosses a bus: the gradient is read in
place and the master copy is a memory copy, and the host memory is the same memory.
"""

from __future__ import annotations

from dataclasses import replace

from .clusters import Cluster
from .layout import Layout
from .memory import ADAM, GRAD, MASTER, MemoryBreakdown


def compute_bytes(layout: Layout) -> float:
    """Bytes per weight of the compute copy (the ZeRO units' compute dtype)."""
    return MASTER if layout.precision == "fp32" else 2.0


def offload_memory(mem: MemoryBreakdown, layout: Layout, params_held: float, shard_params: float,
                   staged: bool = True) -> MemoryBreakdown:
    """``mem`` (the model without offload) with the masters and AdamW state on the host.
    ``params_held``: the parameters whose weights the rank keeps (all of them below ZeRO-3, its
    shard at 3); ``shard_params``: the parameters of its shard; ``staged``: the gradient is copied
    into a host buffer (not on a host, where it is used in place)."""
    if layout.offload == "none":
        return mem
    w = compute_bytes(layout)
    params = 0.0 if layout.offload == "params" else params_held * w
    # below ZeRO-3 the model's fp32 weights + autocast copy are, offloaded, the one compute copy
    buffers = mem.buffers if layout.zero_stage == 3 else 0.0
    host = shard_params * (MASTER + ADAM + (GRAD if staged else 0.0))
    return replace(mem, params=params, optimizer=0.0, buffers=buffers, host=host)


def transfer_bandwidth(cluster: Cluster, world: int) -> float:
    """Bytes/s of one rank's host <-> device copies: PCIe, or on a host a memory copy (read + write)."""
    if cluster.memory_shared or not cluster.pcie_bandwidth:
        return cluster.per_rank_bandwidth(world) / 2
    return cluster.pcie_bandwidth


def offload_step(cluster: Cluster, layout: Layout, shard_params: float, units: int,
                 device_optimizer: float) -> tuple[float, float]:
    """(optimizer seconds on the CPU, exposed host <-> device seconds) of one step.
    ``device_optimizer``: what the optimizer step costs where it would run without offload (on a
    host that is already its CPU time)."""
    bw = transfer_bandwidth(cluster, layout.world)
    if cluster.memory_shared or not cluster.host_adam_rate:
        cpu = device_optimizer
    else:
        cpu = shard_params / (cluster.host_adam_rate / cluster.ranks_per_node(layout.world))
    d2h = 0.0 if cluster.memory_shared else shard_params * GRAD / bw
    h2d = shard_params * MASTER / bw if layout.offload == "optimizer" else 0.0
    exposed = max(cpu, d2h, h2d) - cpu + (d2h + h2d) / max(units, 1)
    if layout.offload == "params":  # each ZeRO-3 gather copies the shard first, on the compute stream
        gathers = 2 * (layout.microbatches if layout.pp == 1 else 1)
        exposed += gathers * shard_params * MASTER / bw
    return cpu, exposed
