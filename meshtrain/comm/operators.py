"""The seed API: ``AllReduceOperator``, ``BroadcastOperator``, ``AllGatherOperator``,
``ReduceScatterOperator``, ``DistributedCommunicator`` and ``create_ring_topology``, with the seed
module's names, so code written against it runs unchanged on meshtrain.comm.

On a topology from ``create_ring_topology`` (the seed's simulated backend: ranks as threads of
this process) an operator call starts its rank's part of the collective and:

* on the thread that created the topology, or on any thread that has called for another rank of
  it, returns at once. A collective completes when its last rank calls it: that call returns
  only once every rank's result is complete, so the results handed to earlier callers are filled
  by then. The seed's examples, one thread calling every rank in a ``for`` loop, run as written::

      comms = create_ring_topology(4)
      ops = [AllReduceOperator(c) for c in comms]
      grads = [torch.randn(1000) for _ in range(4)]
      synced = [op.all_reduce(grads[i]) for i, op in enumerate(ops)]   # all filled after the loop

  Read a result only after the last rank's call of that collective.
* on any other thread (one thread per rank, e.g. ``run_threads``), blocks until the collective is
  done, as torch.distributed does.

A call that fails its argument checks while other ranks' parts of a collective are open aborts
the topology (they fail at once, instead of at the timeout); so does the interpreter's exit for a
collective left open. ``DistributedCommunicator(rank,
world_size)`` on a ``run_local`` thread (or after ``init()``) uses that rank's communicator, and
every call blocks: ``run_local(4, lambda rank: AllReduceOperator(DistributedCommunicator(rank,
4)).all_reduce(grads[rank]))``.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch

from . import collectives, p2p
from .communicator import Communicator, current
from .personalized import barrier as _barrier
from .transport.local import LocalTransport, LocalWorld
from .types import parse_op
from .work import Work


class DistributedCommunicator:
    """One rank's endpoint: ``send``, ``recv``, ``barrier`` (and the group the operators use).

    ``DistributedCommunicator(rank, world_size)`` on a ``run_local`` thread (or after
    ``meshtrain.comm.init()``) uses that rank's communicator; ``create_ring_topology`` builds a
    standalone set over one shared thread world.
    """

    def __init__(self, rank: int, world_size: int, _comm: Communicator | None = None,
                 _topology: "_Topology | None" = None) -> None:
        comm = _comm if _comm is not None else current()
        if comm.rank != rank or comm.world_size != world_size:
            raise ValueError(
                f"DistributedCommunicator({rank}, {world_size}) does not match this thread's "
                f"communicator (rank {comm.rank} of {comm.world_size}): pass the rank and world "
                "size run_local gave this thread, or use create_ring_topology(world_size)"
            )
        self.rank, self.world_size, self.comm = rank, world_size, comm
        self.group = comm.world
        self.topology = _topology  # None: every call blocks (run_local / init)

    def _run(self, launch: Callable[[bool], Work | None], out: Any) -> Any:
        """Run a collective (``launch(async_op)``) with the topology's semantic; return ``out``."""
        if self.topology is None:
            launch(False)
            return out
        return self.topology.run(self.rank, launch, out)

    def send(self, data: torch.Tensor, dst_rank: int, tag: int = 0) -> None:
        """Send ``data`` to ``dst_rank``."""
        p2p.send(data.contiguous(), dst_rank, group=self.group, tag=tag)

    def recv(self, src_rank: int, shape: torch.Size | Sequence[int], dtype: torch.dtype, tag: int = 0) -> torch.Tensor:
        """Receive a new tensor of ``shape`` and ``dtype`` from ``src_rank``."""
        out = torch.empty(tuple(shape), dtype=dtype)
        p2p.recv(out, src_rank, group=self.group, tag=tag)
        return out

    def barrier(self) -> None:
        """Wait until every rank reached the barrier (on a topology: see the module docstring)."""
        self._run(lambda async_op: _barrier(group=self.group, async_op=async_op), None)


_LIVE: "weakref.WeakSet[_Topology]" = weakref.WeakSet()


def _abort_open_at_exit() -> None:
    # A loop that never called some rank leaves its other ranks' parts waiting on the groups'
    # worker threads, which the interpreter joins at exit: without this, exit waits out the timeout.
    for topo in list(_LIVE):
        if topo.has_open():
            topo.world.abort("the interpreter is exiting with this collective still open")


# Runs before concurrent.futures joins its workers (threading's exit hooks run in reverse order).
threading._register_atexit(_abort_open_at_exit)  # type: ignore[attr-defined]


class _Topology:
    """The ranks of one ``create_ring_topology`` world and its open collectives: the works of the
    ranks that have called the n-th collective, until its last rank does."""

    def __init__(self, world: LocalWorld) -> None:
        self.world = world
        self.size = world.world_size
        self.creator = threading.get_ident()
        self.comms: list[DistributedCommunicator] = []
        self._lock = threading.Lock()
        self._calls = [0] * self.size
        self._open: dict[int, list[Work]] = {}
        self._first_rank: dict[int, int] = {}  # thread -> the first rank it called for
        _LIVE.add(self)

    def has_open(self) -> bool:
        """True while some collective has been called by some ranks but not yet by all."""
        with self._lock:
            return bool(self._open)

    def drives(self, rank: int) -> bool:
        """True if the calling thread plays several ranks (so it must not block on one)."""
        me = threading.get_ident()
        with self._lock:
            first = self._first_rank.setdefault(me, rank)
        return me == self.creator or first != rank

    def failed(self, rank: int, exc: BaseException) -> None:
        """``rank``'s call raised before starting: abort if other ranks' parts are open (they would
        wait for it until the timeout)."""
        if self.has_open():
            self.world.abort(f"rank {rank}'s call failed: {type(exc).__name__}: {exc}")

    def run(self, rank: int, launch: Callable[[bool], Work | None], out: Any) -> Any:
        """Start ``rank``'s part asynchronously; wait for every rank's if it is the last to call,
        for its own if the thread plays one rank only; return ``out``."""
        driver = self.drives(rank)
        try:
            work = launch(True)
        except BaseException as exc:
            self.failed(rank, exc)
            raise
        with self._lock:
            self._calls[rank] += 1
            n = self._calls[rank]
            works = self._open.setdefault(n, [])
            works.append(work)
            last = len(works) == self.size
            if last:
                del self._open[n]
        if last:
            for w in works:
                w.wait()
        elif not driver:
            work.wait()
        return out


def create_ring_topology(world_size: int, timeout: float = 60.0) -> list[DistributedCommunicator]:
    """``world_size`` communicators over one thread world. One thread may call every rank's
    operators in turn (results complete once the last rank has called), or each rank's calls may
    run on its own thread (each call blocks); see the module docstring."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    world = LocalWorld(world_size)
    topo = _Topology(world)
    hosts = ["localhost"] * world_size  # given, so building them needs no collective exchange
    topo.comms = [DistributedCommunicator(r, world_size, Communicator(LocalTransport(world, r), timeout=timeout,
                                                                      hosts=hosts), topo)
                  for r in range(world_size)]
    return list(topo.comms)


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
        rop = parse_op(op)
        return self.comm._run(lambda a: collectives.all_reduce(out, op=rop, group=self.comm.group, async_op=a), out)

    def benchmark(self, shapes: Sequence[Sequence[int]], num_trials: int = 10) -> dict[tuple, dict[str, float]]:
        """Time ``all_reduce`` per shape. Returns, per shape tuple, mean/min/max seconds and the bus
        bandwidth 2(p-1)/p·bytes/mean in GB/s. Collective when each rank has its own thread (every
        rank calls it); on the thread that created the topology (the seed calls it on one
        operator) each trial runs every rank's all_reduce in turn, timing the whole collective."""
        p = self.comm.world_size
        topo = self.comm.topology
        if topo is not None and threading.get_ident() == topo.creator:
            ops = [AllReduceOperator(c) for c in topo.comms]
            step: Callable[[torch.Tensor], Any] = lambda x: [o.all_reduce(x) for o in ops]
        else:
            step = self.all_reduce
        out: dict[tuple, dict[str, float]] = {}
        for shape in shapes:
            t = torch.randn(tuple(shape))
            step(t)  # warm-up
            times = []
            for _ in range(num_trials):
                t0 = time.perf_counter()
                step(t)
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
        return self.comm._run(lambda a: collectives.broadcast(out, root_rank, group=self.comm.group, async_op=a), out)


class AllGatherOperator(_Operator):
    """All-gather concatenated on dim 0."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, concatenated along dim 0 in rank order."""
        t = tensor.detach().contiguous()
        shape = (t.shape[0] * self.comm.world_size,) + tuple(t.shape[1:]) if t.dim() else (self.comm.world_size,)
        out = torch.empty(shape, dtype=t.dtype)
        return self.comm._run(lambda a: collectives.all_gather_into_tensor(out, t, group=self.comm.group, async_op=a),
                              out)


class ReduceScatterOperator(_Operator):
    """Reduce-scatter along dim 0: rank i gets the i-th of world_size equal parts."""

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """This rank's part of the reduction of ``tensor`` over all ranks."""
        p = self.comm.world_size
        if tensor.dim() == 0 or tensor.shape[0] % p:
            err = ValueError(f"reduce_scatter needs dim 0 divisible by the world size {p}, "
                             f"got shape {tuple(tensor.shape)}: pad dim 0 to a multiple of {p}")
            if self.comm.topology is not None:
                self.comm.topology.failed(self.comm.rank, err)
            raise err
        out = torch.empty((tensor.shape[0] // p,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
        inp, rop = tensor.detach().contiguous(), parse_op(op)
        return self.comm._run(lambda a: collectives.reduce_scatter_tensor(out, inp, op=rop, group=self.comm.group,
                                                                           async_op=a), out)


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
