"""meshtrain.comm: a collective-communication library with torch.distributed's API.

Switch from torch.distributed by changing the import::

    import meshtrain.comm as dist
    dist.init()                      # under torchrun; or dist.run_local(4, fn) for threads
    dist.all_reduce(t, op="sum", algorithm="ring")

Transports: ``local`` (ranks are threads), ``torch`` (a torch.distributed ProcessGroup: gloo/NCCL),
``shm`` (processes of one host through shared memory).
Algorithms: ring, tree, recursive_doubling, halving_doubling, hierarchical, direct, native, shm, auto.
"""

from __future__ import annotations

from typing import Any

from ..errors import CollectiveDeadlock, CollectiveError, CollectiveMismatch, CollectiveTimeout
from .collectives import (all_gather, all_gather_into_tensor, all_reduce, broadcast, reduce,
                          reduce_scatter, reduce_scatter_tensor)
from .communicator import Communicator, Group, bind_process, current
from .describe import describe
from .compat import (GroupMember, P2POp, all_gather_object, batch_isend_irecv, broadcast_object_list,
                     destroy_process_group, gather_object, get_backend, get_global_rank, get_group_rank,
                     get_process_group_ranks, group, init_process_group, is_available,
                     is_torchelastic_launched, monitored_barrier, new_subgroups, new_subgroups_by_enumeration,
                     scatter_object_list)
from . import shake
from .fusion import all_reduce_coalesced
from .local_run import run_local
from .p2p import irecv, isend, recv, send
from .personalized import all_to_all, all_to_all_single, barrier, gather, scatter
from .symmetric import symmetric_empty
from .types import ReduceOp
from .work import Work

__all__ = [
    "init", "destroy", "is_initialized", "run_local", "new_group", "get_rank", "get_world_size",
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier", "all_reduce_coalesced",
    "send", "recv", "isend", "irecv", "symmetric_empty", "stats", "reset_stats", "flight_recorder",
    "dump_flight_recorder", "calibrate", "describe", "ReduceOp", "Work", "Group", "Communicator",
    "CollectiveError", "CollectiveMismatch", "CollectiveTimeout", "CollectiveDeadlock",
    # torch.distributed's remaining names (compat.py)
    "is_available", "init_process_group", "destroy_process_group", "get_backend", "is_torchelastic_launched",
    "group", "GroupMember", "new_subgroups", "new_subgroups_by_enumeration", "get_process_group_ranks",
    "get_global_rank", "get_group_rank", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list", "P2POp", "batch_isend_irecv", "monitored_barrier",
]


def init(transport: str = "torch", backend: str | None = None, timeout: float = 300.0,
         check: bool = True, node_size: int | None = None, init_timeout: float | None = None) -> Communicator:
    """Initialise this process's communicator from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), or wrap torch.distributed's default group if it is initialised.

    ``transport``: a registered transport whose ranks are processes (``transport/registry.py``):
    ``torch`` (the torch.distributed group: gloo or NCCL), ``shm`` (shared memory; every rank on
    this host), or ``auto`` (``registry.auto_choice``): NCCL's group when the backend is nccl (CUDA tensors),
    else shm between ranks of a host and gloo between hosts (found through the store: hostname +
    boot id). ``backend`` is gloo or nccl (default: nccl if CUDA is available, else gloo);
    ``timeout`` bounds every collective; ``init_timeout`` (default ``timeout``) bounds reaching the
    store and the other ranks at start-up; ``check`` turns the cross-rank metadata check on or off.
    """
    from .transport import registry

    processes = registry.names(threads=False)
    if transport != registry.AUTO and transport not in processes:
        raise ValueError(f"unknown transport {transport!r}: use {', '.join(map(repr, processes))} or 'auto' "
                         "(threads: run_local)")
    import torch.distributed as dist

    from .transport.torchdist import init_torch_distributed

    from .liveness import die_with_parent, monitor_for

    die_with_parent()  # under torchrun: a killed agent takes its workers along (no orphans)
    setup = timeout if init_timeout is None else init_timeout
    store, _ = init_torch_distributed(backend, timeout, setup)
    # Heartbeats: a rank lost on any host stops every rank within seconds (liveness.py). The first
    # beat is posted before the transport's world-wide rendezvous below, so every key exists after it.
    liveness = monitor_for(store, dist.get_rank(), dist.get_world_size())
    if liveness is not None:
        liveness.announce()
    auto = transport == registry.AUTO
    spec = registry.auto_choice(str(dist.get_backend())) if auto else registry.get(transport)
    t: Any = spec.build(registry.Setup(dist.get_rank(), dist.get_world_size(), setup, store=store, spans_hosts=auto))
    hosts = getattr(t, "hosts", None)
    comm = Communicator(t, timeout=timeout, check=check, node_size=node_size, hosts=hosts)
    from .algorithms import native

    native.crowded(comm.hosts.count(comm.hosts[comm.rank]))  # torch's ops' waits (native.polled)
    if liveness is not None:
        t.liveness = liveness  # the shm transport's waits raise PeerLost at once
        if getattr(t, "remote", None) is not None:
            t.remote.liveness = liveness
        liveness.wait_state = comm.wait_state  # the beats also name a deadlock (comm/deadlock.py)
        liveness.start(comm.hosts)
        comm.liveness = liveness
    shake.from_env()  # MESHTRAIN_SHAKE: timing perturbed on purpose, for tests (comm/shake.py)
    bind_process(comm)
    return comm


def is_initialized() -> bool:
    """True if a communicator is bound to this thread or process."""
    try:
        current()
        return True
    except RuntimeError:
        return False


def destroy(failure: BaseException | str | None = None) -> None:
    """Close the process's communicator (torch.distributed itself is left to its owner).

    ``failure``: this rank is shutting down because of that error; the other ranks are told at
    once (their heartbeat monitors stop them, naming this rank and the error) instead of waiting
    for it in their next collective.
    """
    try:
        comm = current()
    except RuntimeError:
        return
    liveness = getattr(comm, "liveness", None)
    if liveness is not None:
        why = None if failure is None else (failure if isinstance(failure, str)
                                            else f"{type(failure).__name__}: {failure}".splitlines()[0])
        liveness.stop(why)
    comm.close()
    bind_process(None)


def new_group(ranks: list[int] | None = None, timeout: float | None = None) -> Group:
    """Create a group of global ``ranks``; every rank of the world must call it, in the same order."""
    return current().new_group(ranks, timeout)


def get_rank(group: Group | None = None) -> int:
    """This rank's position in ``group`` (the world by default); -1 if not a member."""
    return (group or current().world).rank


def get_world_size(group: Group | None = None) -> int:
    """Number of ranks in ``group`` (the world by default)."""
    return (group or current().world).size


def stats() -> dict[int, dict[str, Any]]:
    """Per-group counters of operations, bytes and time (see ``Monitor.stats``)."""
    return current().monitor.stats()


def reset_stats() -> None:
    """Zero the counters of ``stats()``."""
    current().monitor.reset()


def flight_recorder() -> list[dict[str, Any]]:
    """The last N collectives of this rank (op, group, seq, shapes, dtype, start/end, state)."""
    return current().monitor.records()


def dump_flight_recorder(path: str) -> str:
    """Write this rank's flight recorder to ``path`` as JSON."""
    return current().monitor.dump(path)


def calibrate(group: Group | None = None, force: bool = True):
    """Fit the alpha-beta-gamma cost model of ``group`` now (collective); returns the CostModel."""
    from .select import calibrate as _cal

    return _cal(group or current().world, force=force)


# torch.distributed's new_group (timeout as a timedelta, backend=, use_local_synchronization=, ...)
# replaces the definition above; it calls the same Communicator.new_group.
from .compat import new_group  # noqa: E402,F811
