"""``this-host``: one meshtrain block under the layout's tensor, sequence and context parallelism,
timed in the layout's ranks with real collectives.

A plain block narrowed to 1/tp (``profile.py``) misses what meshtrain's parallel layers add on a
CPU: their autograd functions, the gathers and scatters of sequence parallelism, ring attention's
loop, ZeRO-3's per-unit gather and free and, above all, the waits at each of a block's
collectives, where every rank stops until the slowest arrives. So for tp > 1, cp > 1 or ZeRO-3
the block is built as ``parallelize`` builds it
(``apply_tensor_parallel``, ``apply_context_parallel``) on a mesh of the copies (``corun``), which
join one shm communicator as a training run's ranks do, on the layout's mesh: every pipeline and
data-parallel rank runs its own block at the same time, sharing the cores. Under ZeRO-3 the block
is one ZeRO unit (gathered before forward and backward, its gradient reduce-scattered); the other
data-parallel collectives (bucketed all-reduce, ZeRO-1/2, the HSDP replicas) and the pipeline's
sends stay with the analytic model. Every copy runs the same
fixed number of repetitions, as their collectives must match.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from functools import lru_cache

from .architectures import Arch
from .corun import at_stop, started, together
from .profile import wall_scaled

REPEATS = 20
"""Timed repetitions (after 3 warm-up ones) of the block's forward and backward."""

_joined: tuple[int, int] | None = None  # (world, port) of this copy's communicator


def _join(rank: int, world: int, port: int) -> None:
    """Join (once) the copies' shm communicator, as a training rank joins its run's."""
    global _joined
    if _joined == (world, port):
        return
    from .. import comm

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    comm.init(transport="shm", timeout=120.0)
    _joined = (world, port)
    at_stop(_leave)


def _leave() -> None:
    """When the copies stop (every copy is told at once): leave together, so that no copy's heartbeat
    reaches for the store of a copy already gone."""
    import torch.distributed as dist

    from .. import comm

    try:
        comm.barrier()
        comm.destroy()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a copy already gone: exit anyway
        pass


def _block(arch: Arch, degrees: tuple[int, int, int, int, int], sp: bool, zero3: bool, batch: int, seq: int,
           threads: int, port: int, rank: int) -> tuple[float, float]:
    import torch

    from ..mesh import Mesh
    from ..models.llama import Llama, LlamaConfig, rotary_table
    from ..parallel.context import cp_positions
    from ..parallel.parallelize import ZERO_VIEW, apply_context_parallel, apply_tensor_parallel, materialize
    from ..parallel.zero import ZeroModel

    dp, rep, pp, cp, tp = degrees
    torch.set_num_threads(threads)
    _join(rank, dp * pp * cp * tp, port)
    mesh = Mesh(dp=dp, pp=pp, cp=cp, tp=tp, dp_replicate=rep)
    # one block (the vocabulary only has to split over tp: the embedding and head are not timed)
    cfg = LlamaConfig(vocab_size=64 * tp, dim=arch.dim, n_layers=1, n_heads=arch.n_heads,
                      n_kv_heads=arch.n_kv_heads, ffn_dim=arch.ffn_dim, max_seq_len=seq)
    with torch.device("meta"):
        model = Llama(cfg)
    if tp > 1:
        apply_tensor_parallel(model, mesh.tp_group, sp)
    if cp > 1:
        apply_context_parallel(model, mesh.cp_group)
    materialize(model, "cpu", seed=0)
    block = next(iter(model.layers.values()))
    if zero3:  # the block is one ZeRO-3 unit: gathered before its forward and its backward, its
        # gradient reduce-scattered after (the replicas' all-reduce waits for the step: analytic)
        block = ZeroModel(block, 3, mesh.reduction_group(ZERO_VIEW), units=[block])
    positions = cp_positions(seq, mesh.cp_group) if cp > 1 else torch.arange(seq)
    cos, sin = rotary_table(cfg.head_dim, positions, cfg.rope_theta)
    x = torch.randn(batch, seq // cp // (tp if sp else 1), arch.dim, requires_grad=True)
    grad = torch.randn_like(x)
    for _ in range(3):
        block(x, cos, sin).backward(grad)
    fwd, bwd = [], []
    start = time.perf_counter()
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        out = block(x, cos, sin)
        t1 = time.perf_counter()
        out.backward(grad)
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return wall_scaled(fwd, bwd, (time.perf_counter() - start) / REPEATS)


_ports: dict[int, int] = {}


def _port(world: int) -> int:
    """A free loopback port for the store of the ``world`` copies: one per start of the set (a
    restarted set joins a new communicator)."""
    serial = started(world)
    if serial not in _ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            _ports[serial] = s.getsockname()[1]
    return _ports[serial]


def measures_collectives(tp: int, cp: int, zero_shards: int, zero_stage: int) -> bool:
    """True if a block of this layout is profiled here, with its collectives (else ``profile.py``)."""
    return tp > 1 or cp > 1 or (zero_stage == 3 and zero_shards > 1)


@lru_cache(maxsize=256)
def parallel_block_seconds(arch: Arch, degrees: tuple[int, int, int, int, int], sp: bool, zero3: bool, batch: int,
                           seq: int, threads: int) -> tuple[float, float]:
    """(forward, backward) seconds of one block on the mesh of ``degrees`` (dp, dp_replicate, pp, cp,
    tp): tensor (``sp``: and sequence) parallelism over tp, ring attention over cp, with ``zero3`` a
    ZeRO-3 unit over dp_shard x cp; collectives included, on ``batch`` sequences of ``seq`` tokens;
    the median over the ranks timing it at once."""
    world = math.prod(degrees) // degrees[1]
    results = together(world, _block, arch, degrees, sp, zero3, batch, seq, threads, _port(world), ranked=True)
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)


def _small_all_reduce(world: int, threads: int, port: int, rank: int) -> float:
    import torch

    from .. import comm

    torch.set_num_threads(threads)
    _join(rank, world, port)
    t = torch.ones(16)
    a, b = torch.randn(192, 192), torch.randn(192, 192)

    def work() -> None:  # about a millisecond of compute, as a step has between its collectives
        for _ in range(16):
            a @ b

    for _ in range(3):
        work()
        comm.all_reduce(t)
    n = 3 * REPEATS
    comm.barrier()
    start = time.perf_counter()
    for _ in range(n):
        work()
    alone = time.perf_counter() - start
    comm.barrier()
    start = time.perf_counter()
    for _ in range(n):
        work()
        comm.all_reduce(t)
    together = time.perf_counter() - start
    comm.barrier()
    start = time.perf_counter()  # compute alone again: the faster of the two (a busy moment only slows one)
    for _ in range(n):
        work()
    alone = min(alone, time.perf_counter() - start)
    # what a collective adds between stretches of compute: its own cost, and waiting for ranks that
    # are computing (or, with more ranks than cores, not running at all)
    return max(0.0, together - alone) / n


@lru_cache(maxsize=64)
def collective_latency(world: int, threads: int) -> float:
    """Seconds one small all-reduce adds between stretches of compute over ``world`` ranks of this
    host (the median over ranks of: a loop of compute and all-reduce, less the same compute alone):
    a collective's fixed cost, with the wait for ranks the scheduler has put aside when they
    outnumber the cores, which the calibrated alpha (fitted on point-to-point messages) leaves out."""
    return statistics.median(together(world, _small_all_reduce, world, threads, _port(world), ranked=True))

