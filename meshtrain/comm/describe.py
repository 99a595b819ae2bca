"""``describe(group)``: which path a group's messages take from this rank, and what ``auto`` chose."""

from __future__ import annotations

from typing import Any

from .call import resolve_group
from .transport.base import capabilities


def _remote_name(transport: Any) -> str:
    remote = getattr(transport, "remote", None)
    if remote is None:
        return "none"
    return str(getattr(remote, "backend", None) or remote.kind)


def describe(group: Any = None) -> dict[str, Any]:
    """This rank's view of ``group`` (None: the world; a meshtrain Group or a torch.distributed
    ProcessGroup with a meshtrain twin): its ranks and their hosts, the transport, the path to
    each other member (``shm`` through this host's shared memory, else the backend that carries
    the message: ``gloo``, ``nccl`` or ``local`` for threads), whether a torch.distributed twin
    exists, the static choices ``auto`` has made so far on it (op and inputs -> algorithm) and
    what it learned from its calls (``learned``: ``tune.Tuner.explain``)."""
    g = resolve_group(group)
    comm = g.comm
    t = comm.transport
    shared = capabilities(t).shared_memory
    own = str(getattr(t, "backend", None) or t.kind)
    links: dict[int, str] = {}
    for r in g.ranks:
        if r == comm.rank:
            continue
        if shared:
            links[r] = "shm" if t.is_local([r]) else _remote_name(t)
        else:
            links[r] = own
    return {"group": g.gid, "ranks": list(g.ranks), "hosts": list(g.hosts), "rank": comm.rank,
            "transport": t.kind, "links": links,
            "collectives": "shm" if g.on_shared_memory else ("native" if capabilities(t).native_collectives
                                                             else "p2p algorithms"),
            "torch_group": g.torch_group is not None,
            # select's memo keys start with (op, bytes); the rest is bookkeeping (model id, ...)
            "choices": {f"{k[0]} {k[1]} B": v for k, v in g.choices.items()},
            # what online selection measured and keeps, per op and size range (comm/tune.py)
            "learned": g.tuner.explain() if g.tuner else []}
