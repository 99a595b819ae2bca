"""The seed API: ``AllReduceOperator``, ``BroadcastOperator``, ``AllGatherOperator``,
``ReduceScatterOperator``, ``DistributedCommunicator`` and ``create_ring_topology``, with the seed
module's names, so code written against it runs unchanged on meshtrain.comm.

Each rank's calls must run on that rank's own thread (or process): a blocking collective waits for
the other ranks, so the seed's sequential loop over ranks cannot work. Two ways to run its examples::

    comms = create_ring_topology(4)
    ops = [AllReduceOperator(c) for c in comms]
    grads = [torch.randn(1000) for _ in range(4)]
    synced = run_threads([lambda r=r: ops[r].all_reduce(grads[r]) for r in range(4)])

    # or, inside meshtrain.comm.run_local, build each rank's communicator on its thread:
    synced = run_local(4, lambda rank: AllReduceOperator(DistributedCommunicator(rank, 4)).all_reduce(grads[rank]))
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import torch

from . import collectives, p2p
from .communicator import Communicator, current
from .personalized import barrier as _barrier
from .transport.local import LocalTransport, LocalWorld
from .types import parse_op


class DistributedCommunicator:
    """One rank's endpoint: ``send``, ``recv``, ``barrier`` (and the group the operators use).

    ``DistributedCommunicator(rank, world_size)`` on a ``run_local`` thread (or after
    ``meshtrain.comm.init()``) uses that rank's communicator; ``create_ring_topology`` builds a
    standalone set over one shared thread world.
    """

    def __init__(self, rank: int, world_size: int, _comm: Communicator | None = None) -> None:
        comm = _comm if _comm is not None else current()
        if comm.rank != rank or comm.world_size != world_size:
            raise ValueError(
                f"DistributedCommunicator({rank}, {world_size}) does not match this thread's "
                f"communicator (rank {comm.rank} of {comm.world_size}): pass the rank and world "
                "size run_local gave this thread, or use create_ring_topology(world_size)"
            )
        self.rank, self.world_size, self.comm = rank, world_size, comm
        self.group = comm.world

    def send(self, data: torch.Tensor, dst_rank: int, tag: int = 0) -> None:
        """Send ``data`` to ``dst_rank``."""
        p2p.send(data.contiguous(), dst_rank, group=self.group, tag=tag)

    def recv(self, src_rank: int, shape: torch.Size | Sequence[int], dtype: torch.dtype, tag: int = 0) -> torch.Tensor:
        """Receive a new tensor of ``shape`` and ``dtype`` from ``src_rank``."""
        out = torch.empty(tuple(shape), dtype=dtype)
        p2p.recv(out, src_rank, group=self.group, tag=tag)
        return out

    def barrier(self) -> None:
        """Wait until every rank reached the barrier."""
        _barrier(group=self.group)


def create_ring_topology(world_size: int, timeout: float = 60.0) -> list[DistributedCommunicator]:
    """``world_size`` communicators over one thread world (run each rank's calls on its own thread)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    world = LocalWorld(world_size)
    hosts = ["localhost"] * world_size  # given, so building them needs no collective exchange
    return [DistributedCommunicator(r, world_size, Communicator(LocalTransport(world, r), timeout=timeout, hosts=hosts))
            for r in range(world_size)]


class _Operator:
    def __init__(self, comm: DistributedCommunicator) -> None:
        if not isinstance(comm, DistributedCommunicator):
            raise TypeError(f"expected a DistributedCommunicator, got {type(comm).__name__}")
        self.comm = comm


class AllReduceOperator(_Operator):
    """Ring-by-default all-reduce that returns a new tensor (the input is left unchanged)."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks with "sum", "max", "min" or "mean"."""
        out = tensor.detach().clone()
        collectives.all_reduce(out, op=parse_op(op), group=self.comm.group)
        return out

    def benchmark(self, shapes: Sequence[Sequence[int]], num_trials: int = 10) -> dict[tuple, dict[str, float]]:
        """Time ``all_reduce`` per shape (collective: every rank calls it). Returns, per shape tuple,
        mean/min/max seconds and the bus bandwidth 2(p-1)/p·bytes/mean in GB/s."""
        p = self.comm.world_size
        out: dict[tuple, dict[str, float]] = {}
        for shape in shapes:
            t = torch.randn(tuple(shape))
            self.all_reduce(t)  # warm-up (and calibration for 'auto')
            times = []
            for _ in range(num_trials):
                t0 = time.perf_counter()
                self.all_reduce(t)
                times.append(time.perf_counter() - t0)
            mean = sum(times) / len(times)
            nbytes = t.numel() * t.element_size()
            out[tuple(shape)] = {"mean_s": mean, "min_s": min(times), "max_s": max(times),
                                 "busbw_GBps": 2 * (p - 1) / p * nbytes / mean / 1e9 if mean > 0 else 0.0}
        return out


class BroadcastOperator(_Operator):
    """Broadcast that returns the root's tensor on every rank."""

    def broadcast(self, tensor: torch.Tensor, root_rank: int = 0) -> torch.Tensor:
        """Every rank gets a copy of ``tensor`` from ``root_rank``."""
        out = tensor.detach().clone()
        collectives.broadcast(out, root_rank, group=self.comm.group)
        return out


class AllGatherOperator(_Operator):
    """All-gather concatenated on dim 0."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, concatenated along dim 0 in rank order."""
        t = tensor.detach().contiguous()
        shape = (t.shape[0] * self.comm.world_size,) + tuple(t.shape[1:]) if t.dim() else (self.comm.world_size,)
        out = torch.empty(shape, dtype=t.dtype)
        collectives.all_gather_into_tensor(out, t, group=self.comm.group)
        return out


class ReduceScatterOperator(_Operator):
    """Reduce-scatter along dim 0: rank i gets the i-th of world_size equal parts."""

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """This rank's part of the reduction of ``tensor`` over all ranks."""
        p = self.comm.world_size
        if tensor.dim() == 0 or tensor.shape[0] % p:
            raise ValueError(f"reduce_scatter needs dim 0 divisible by the world size {p}, "
                             f"got shape {tuple(tensor.shape)}: pad dim 0 to a multiple of {p}")
        out = torch.empty((tensor.shape[0] // p,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
        collectives.reduce_scatter_tensor(out, tensor.detach().contiguous(), op=parse_op(op), group=self.comm.group)
        return out


def run_threads(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run each function on its own thread (rank i = fns[i]); results in order. The first
    failure is re-raised with its rank; the seed communicators' timeouts bound every wait."""
    results: list[Any] = [None] * len(fns)
    errors: list[tuple[float, int, BaseException]] = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append((time.monotonic(), i, exc))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        _, rank, exc = min(errors, key=lambda e: e[0])
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f"[rank {rank}] {exc.args[0]}",) + exc.args[1:]
        raise exc
    return results
