"""torch.distributed's remaining module-level names, so a torch trainer runs on ``meshtrain.comm``.

Set-up (``init_process_group``, ``destroy_process_group``, ``get_backend``, ...), groups
(``group.WORLD``, ``new_group`` with torch's keywords, ``new_subgroups*``, rank translation),
object collectives (pickle over meshtrain's broadcast/all_gather/gather/scatter), batched p2p
(``P2POp``, ``batch_isend_irecv``) and ``monitored_barrier``. Each keeps torch's signature,
defaults and exception types; where meshtrain differs it says so in the docstring.
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
from typing import Any, Callable, Sequence

import torch

from ..errors import CollectiveTimeout
from .call import from_torch_group  # noqa: F401  (re-exported: compat's public name)
from .collectives import all_gather, broadcast
from .communicator import Group, _thread, bind_thread, current
from .p2p import irecv, isend
from .personalized import gather, scatter
from .transport.base import PeerTimeout
from .work import Work


def _is_initialized() -> bool:
    try:
        current()
        return True
    except RuntimeError:
        return False


def _seconds(timeout: Any, default: float | None = None) -> float | None:
    """A torch-style ``timeout`` (a ``timedelta`` or None) in seconds; TypeError like torch otherwise."""
    if timeout is None:
        return default
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"Expected timeout argument to be of type datetime.timedelta, got {timeout}")
    return timeout.total_seconds()


# ---------------------------------------------------------------------------------------- set-up


def is_available() -> bool:
    """True: meshtrain.comm is always available (torch.distributed.is_available)."""
    return True


def is_torchelastic_launched() -> bool:
    """True if this process was started by torchrun / torchelastic (TORCHELASTIC_RUN_ID is set)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: datetime.timedelta | None = None, world_size: int = -1, rank: int = -1,
                       store: Any = None, group_name: str = "", pg_options: Any = None,
                       device_id: Any = None) -> None:
    """Initialise torch.distributed exactly as ``torch.distributed.init_process_group`` does
    (env:// by default, or ``init_method``, or ``store`` + ``rank`` + ``world_size``), unless it
    already is, then meshtrain's communicator on top of it.

    The communicator's transport is ``auto``: on a gloo backend, shared memory between the ranks
    of one host and gloo between hosts (a group's path is per link: ``describe(group)``); on NCCL,
    NCCL's own group. ``MESHTRAIN_TRANSPORT=torch|shm|auto`` overrides it. torch's ProcessGroups
    stay valid: every group made through meshtrain.comm also gets its torch.distributed twin
    (``Group.torch_group``), so torch.distributed calls on the default group or a twin, and
    torch.distributed groups with the ranks of a meshtrain group, keep working beside meshtrain's.

    ``timeout`` is a ``datetime.timedelta`` (torch's default when None: 30 minutes); it bounds
    gloo's operations and every meshtrain collective. Raises ValueError if this process (or, under
    ``run_local``, this thread) is already initialised or MESHTRAIN_TRANSPORT names no transport,
    TypeError for a timeout of another type.
    """
    from . import init

    if _is_initialized():
        raise ValueError("trying to initialize the default process group twice!")
    import torch.distributed as tdist
    from torch.distributed.constants import default_pg_timeout

    transport = os.environ.get("MESHTRAIN_TRANSPORT", "auto")
    from .transport import registry

    processes = registry.names(threads=False)
    if transport not in (*processes, registry.AUTO):
        raise ValueError(f"MESHTRAIN_TRANSPORT={transport!r} names no transport: set it to {', '.join(processes)} "
                         "or auto (or unset it: auto)")
    seconds = _seconds(timeout, default_pg_timeout.total_seconds())
    if not tdist.is_initialized():
        tdist.init_process_group(backend=backend, init_method=init_method, timeout=timeout,
                                 world_size=world_size, rank=rank, store=store, group_name=group_name,
                                 pg_options=pg_options, device_id=device_id)
    comm = init(transport=transport, timeout=seconds)
    comm.torch_twins = True


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group``; with None (or ``group.WORLD``) close meshtrain's communicator AND
    torch.distributed's default group (``meshtrain.comm.destroy()`` leaves torch's alone).

    Under ``run_local`` the thread's communicator is only unbound (run_local closes it). A
    subgroup is released (its worker thread and torch sub-group); its id stays taken. ValueError
    when nothing is initialised, like torch.
    """
    from . import destroy

    if not _is_initialized():
        raise ValueError("Invalid process group specified")
    comm = current()
    g = _resolve(group)
    if g is not comm.world:
        g.close()
        if g.torch_group is not None:
            import torch.distributed as tdist

            tdist.destroy_process_group(g.torch_group)
            g.torch_group = None
        return
    if getattr(_thread, "comm", None) is comm:
        bind_thread(None)
        return
    destroy()
    import torch.distributed as tdist

    if tdist.is_initialized():
        tdist.destroy_process_group()


def get_backend(group: Any = None) -> str:
    """The backend of ``group``: torch's name (``gloo``, ``nccl``) on the torch transport and after
    ``init_process_group`` (the backend the program asked for, whatever path meshtrain takes:
    ``describe`` tells that), else the transport's kind (``local``, ``shm``)."""
    g = _resolve(group)
    if g.comm.torch_twins:
        import torch.distributed as tdist

        return str(tdist.get_backend())
    return str(getattr(g.comm.transport, "backend", None) or g.comm.transport.kind)


# ---------------------------------------------------------------------------------------- groups


class _WorldMeta(type):
    """``WORLD`` resolves, at each access, to the calling rank's world group (None before init)."""

    @property
    def WORLD(cls) -> Group | None:  # noqa: N802 - torch's name
        return current().world if _is_initialized() else None


class group(metaclass=_WorldMeta):  # noqa: N801 - torch's name
    """``group.WORLD``: the world group of the caller, as in torch.distributed."""


class GroupMember(metaclass=_WorldMeta):
    """``GroupMember.WORLD`` (the world group) and ``NON_GROUP_MEMBER``, as in torch.distributed."""

    NON_GROUP_MEMBER = -100


def _resolve(g: Any) -> Group:
    if g is None:
        return current().world
    if isinstance(g, Group):
        return g
    return from_torch_group(g)


def new_group(ranks: Sequence[int] | None = None, timeout: datetime.timedelta | float | None = None,
              backend: str | None = None, pg_options: Any = None, use_local_synchronization: bool = False,
              group_desc: str | None = None, device_id: Any = None, sort_ranks: bool = False) -> Group:
    """Create a group of global ``ranks`` (torch's keywords accepted; ``timeout`` as a timedelta or
    seconds). Every rank of the world must call it in the same order, even with
    ``use_local_synchronization=True``. Unlike torch, the order of ``ranks`` defines group ranks
    unless ``sort_ranks=True`` (torch sorts by default). ``backend``/``pg_options`` are ignored:
    the group uses the world's transport."""
    if timeout is not None and not isinstance(timeout, (datetime.timedelta, int, float)):
        raise TypeError(f"Expected timeout argument to be of type datetime.timedelta, got {timeout}")
    secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if ranks is not None and sort_ranks:
        ranks = sorted(ranks)
    return current().new_group(None if ranks is None else list(ranks), secs)


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]],
                                 timeout: datetime.timedelta | None = None, backend: str | None = None,
                                 pg_options: Any = None, group_desc: str | None = None
                                 ) -> tuple[Group | None, list[Group]]:
    """Make one group per rank list (every rank calls it); return (this rank's group or None, all
    groups). ValueError for an empty list or a rank in two lists, as in torch."""
    if not ranks_per_subgroup_list:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    seen: dict[int, Sequence[int]] = {}
    for ranks in ranks_per_subgroup_list:
        for r in ranks:
            if r in seen:
                raise ValueError(f"Rank {r} has appeared in both subgroup {seen[r]} and {ranks}")
            seen[r] = ranks
    me = current().rank
    mine: Group | None = None
    subgroups: list[Group] = []
    for ranks in ranks_per_subgroup_list:
        g = new_group(list(ranks), timeout=timeout, backend=backend, pg_options=pg_options)
        subgroups.append(g)
        if me in g.ranks:
            mine = g
    return mine, subgroups


def new_subgroups(group_size: int | None = None, group: Any = None, timeout: datetime.timedelta | None = None,
                  backend: str | None = None, pg_options: Any = None, group_desc: str | None = None
                  ) -> tuple[Group | None, list[Group]]:
    """Split the world (or ``group``) into consecutive groups of ``group_size`` ranks; returns
    (this rank's group, all groups). ValueError when the size is missing (no CUDA to count),
    not positive, larger than the world, or does not divide it, as in torch."""
    parent = _resolve(group)
    if group_size is None:
        if not torch.cuda.is_available():
            raise ValueError("Default group size only takes effect when CUDA is available.If your "
                             "subgroup using a backend that does not depend on CUDA,please pass in 'group_size' correctly.")
        group_size = torch.cuda.device_count()
    if group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    world = parent.size
    if world < group_size:
        raise ValueError(f"The arg 'group_size' ({group_size}) must not exceed the world size ({world})")
    if world % group_size != 0:
        raise ValueError(f"The world size ({world}) must be divisible by 'group_size={group_size}'")
    lists = [parent.ranks[i:i + group_size] for i in range(0, world, group_size)]
    return new_subgroups_by_enumeration(lists, timeout=timeout, backend=backend, pg_options=pg_options)


def get_process_group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group`` (None: the world), ordered by group rank."""
    return list(_resolve(group).ranks)


def get_global_rank(group: Any, group_rank: int) -> int:
    """Global rank of ``group_rank`` in ``group`` (identity for the world); ValueError if none."""
    g = _resolve(group)
    if g is g.comm.world:
        return group_rank
    if not isinstance(group_rank, int) or not 0 <= group_rank < g.size:
        raise ValueError(f"Group rank {group_rank} is not part of group {g}")
    return g.ranks[group_rank]


def get_group_rank(group: Any, global_rank: int) -> int:
    """Rank of global rank ``global_rank`` in ``group`` (identity for the world); ValueError if absent."""
    g = _resolve(group)
    if g is g.comm.world:
        return global_rank
    if global_rank not in g.ranks:
        raise ValueError(f"Global rank {global_rank} is not part of group {g}")
    return g.ranks.index(global_rank)


def _root(g: Group, root: int | None, group_root: int | None, what: str) -> int:
    if root is not None and group_root is not None:
        raise ValueError(f"Can not specify both {what} and group_{what}")
    if group_root is not None:
        if not 0 <= group_root < g.size:
            raise ValueError(f"group_{what} {group_root} is not part of group {g}")
        return g.ranks[group_root]
    return 0 if root is None else root


# ---------------------------------------------------------------------------- object collectives
# Objects travel pickled, as in torch: unpickling runs code chosen by the sender, so use these only
# between trusted peers. Bytes are padded to 8 and sent as int64 words (8x fewer elements than uint8).


def _pack(obj: Any) -> tuple[torch.Tensor, int]:
    buf = io.BytesIO()
    pickle.Pickler(buf).dump(obj)
    data = buf.getvalue()
    padded = bytearray(data) + bytearray((-len(data)) % 8)
    return torch.frombuffer(padded, dtype=torch.uint8).view(torch.int64).clone(), len(data)


def _unpack(words: torch.Tensor, nbytes: int) -> Any:
    data = words.contiguous().view(torch.uint8)[:nbytes].numpy().tobytes()
    return pickle.Unpickler(io.BytesIO(data)).load()


def _words(nbytes: int) -> int:
    return (nbytes + 7) // 8


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                          device: Any = None, group_src: int | None = None) -> None:
    """Replace ``object_list`` on every rank by global rank ``src``'s (default 0), in place; every
    rank passes a list of the same length. Objects are pickled: for trusted peers only."""
    g = _resolve(group)
    root = _root(g, src, group_src, "src")
    me = g.comm.rank == root
    packed = [_pack(o) for o in object_list] if me else []
    sizes = torch.tensor([n for _, n in packed] if me else [0] * len(object_list), dtype=torch.int64)
    broadcast(sizes, root, group=g)
    flat = (torch.cat([t for t, _ in packed]) if packed else torch.zeros(0, dtype=torch.int64)) if me else \
        torch.empty(sum(_words(int(n)) for n in sizes), dtype=torch.int64)
    broadcast(flat, root, group=g)
    if not me:
        at = 0
        for i, n in enumerate(sizes.tolist()):
            object_list[i] = _unpack(flat[at:at + _words(n)], n)
            at += _words(n)


def _gather_sizes(g: Group, n: int) -> list[int]:
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(g.size)]
    all_gather(out, torch.tensor([n], dtype=torch.int64), group=g)
    return [int(t) for t in out]


def _padded(t: torch.Tensor, words: int) -> torch.Tensor:
    return torch.cat([t, torch.zeros(words - t.numel(), dtype=torch.int64)])


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """``object_list[i]`` receives group rank i's ``obj`` on every rank (the list must have the
    group's length). Objects are pickled: for trusted peers only."""
    g = _resolve(group)
    t, n = _pack(obj)
    sizes = _gather_sizes(g, n)
    words = max(_words(s) for s in sizes)
    outs = [torch.empty(words, dtype=torch.int64) for _ in range(g.size)]
    all_gather(outs, _padded(t, words), group=g)
    for i, (o, s) in enumerate(zip(outs, sizes)):
        object_list[i] = _unpack(o, s)


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: Any = None, group_dst: int | None = None) -> None:
    """``object_gather_list[i]`` on global rank ``dst`` (default 0) receives group rank i's ``obj``;
    the list is given on ``dst`` only (ValueError otherwise, as in torch). Pickled: trusted peers only."""
    g = _resolve(group)
    root = _root(g, dst, group_dst, "dst")
    me = g.comm.rank == root
    if me and not object_gather_list:
        raise ValueError("Argument ``gather_list`` must be specified on destination rank.")
    if not me and object_gather_list:
        raise ValueError("Argument ``gather_list`` must NOT be specified on non-destination ranks.")
    t, n = _pack(obj)
    sizes = _gather_sizes(g, n)
    words = max(_words(s) for s in sizes)
    outs = [torch.empty(words, dtype=torch.int64) for _ in range(g.size)] if me else None
    gather(_padded(t, words), outs, dst=root, group=g)
    if me:
        for i, (o, s) in enumerate(zip(outs, sizes)):
            object_gather_list[i] = _unpack(o, s)


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: Any = None, group_src: int | None = None) -> None:
    """``scatter_object_output_list[0]`` on group rank i receives ``scatter_object_input_list[i]``
    of global rank ``src`` (default 0). Pickled: trusted peers only."""
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("Expected argument scatter_object_output_list to be a list of size at least 1.")
    g = _resolve(group)
    root = _root(g, src, group_src, "src")
    me = g.comm.rank == root
    packed = [_pack(o) for o in scatter_object_input_list] if me else []
    head = torch.tensor([max((_words(n) for _, n in packed), default=0)], dtype=torch.int64)
    broadcast(head, root, group=g)
    words = int(head)
    out = torch.empty(words, dtype=torch.int64)
    scatter(out, [_padded(t, words) for t, _ in packed] if me else None, src=root, group=g)
    size = torch.zeros(1, dtype=torch.int64)
    scatter(size, [torch.tensor([n], dtype=torch.int64) for _, n in packed] if me else None, src=root, group=g)
    scatter_object_output_list[0] = _unpack(out, int(size))


# ------------------------------------------------------------------------------------------- p2p


def _p2p_fn(op: Any) -> Callable[..., Work] | None:
    if op is isend or op is irecv:
        return op
    import torch.distributed as tdist

    return {id(tdist.isend): isend, id(tdist.irecv): irecv}.get(id(op))


class P2POp:
    """One send or receive of ``batch_isend_irecv``: ``op`` is ``isend`` or ``irecv`` (meshtrain's,
    or torch.distributed's, which mean the same), ``peer`` a global rank (or ``group_peer`` a rank
    of ``group``)."""

    def __init__(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int | None = None,
                 group: Any = None, tag: int = 0, group_peer: int | None = None) -> None:
        fn = _p2p_fn(op)
        if fn is None:
            raise ValueError("Invalid ``op``. Expected ``op`` to be of type ``torch.distributed.isend`` or "
                             "``torch.distributed.irecv``.")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Invalid function argument. Expected parameter `tensor` of type torch.Tensor "
                            f"but got {type(tensor)} instead.")
        self.op, self.tensor, self.tag = fn, tensor, tag
        self.group = _resolve(group)
        if peer is None and group_peer is None:
            raise ValueError("Must specify either peer or group_peer")
        if peer is not None and group_peer is not None:
            raise ValueError("Can't specify both peer and group_peer")
        self.peer = get_global_rank(self.group, group_peer) if group_peer is not None else peer
        self.group_peer = get_group_rank(self.group, self.peer)

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__} peer={self.peer} tag={self.tag} shape={tuple(self.tensor.shape)})"


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Post every send and receive of ``p2p_op_list`` at once and return their Works (wait on each).
    Their order does not matter across peers; between one pair and direction it does, as in torch."""
    if not isinstance(p2p_op_list, list) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("Invalid ``p2p_op_list``. Each op is expected to to be of type ``torch.distributed.P2POp``.")
    g = p2p_op_list[0].group
    if not all(p.group is g for p in p2p_op_list):
        raise ValueError("All ops need to use the same group.")
    return [p.op(p.tensor, p.peer, g, p.tag) for p in p2p_op_list]


# -------------------------------------------------------------------------------------- barriers


def monitored_barrier(group: Any = None, timeout: datetime.timedelta | float | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that, when some ranks do not arrive within ``timeout`` (default: the group's),
    raises a RuntimeError (``CollectiveTimeout``) naming them, on every rank that did arrive.
    Every missing rank is named (as torch's ``wait_all_ranks=True``) whatever ``wait_all_ranks``."""
    g = _resolve(group)
    if g.rank < 0:
        return  # torch warns and returns for a non-member
    secs = timeout if isinstance(timeout, (int, float)) else _seconds(timeout, g.timeout)
    g.drain()
    seq = g.next_seq()
    try:
        g.comm.transport.exchange(f"mb/{g.gid}/{seq}", g.ranks, "1", secs)
    except PeerTimeout as exc:
        err = CollectiveTimeout(f"Ranks {exc.missing} failed to pass monitoredBarrier in {secs * 1000:g} ms "
                                f"(monitored_barrier #{seq} on group {g.gid}, ranks {g.ranks})")
        err.missing = exc.missing  # type: ignore[attr-defined]
        raise err from None
