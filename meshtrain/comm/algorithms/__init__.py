"""Collective algorithms, one plain function per (operation, algorithm), over a ``Ctx``.

``REGISTRY[op][name]`` is the function; ``native`` (torch.distributed's own collective) is handled
by the front end because it bypasses the ``Ctx``. ``shm`` (``shm_direct.ALGORITHMS``) works on the
shm transport's shared buffers, so it is offered only there; ``lookup`` finds either kind.
"""

from __future__ import annotations

from typing import Callable

from ..transport.base import CAPABILITIES, Capabilities
from . import direct, hierarchical, recursive, ring, shm_direct, tree

REGISTRY: dict[str, dict[str, Callable]] = {
    "all_reduce": {
        "ring": ring.all_reduce,
        "tree": tree.all_reduce,
        "recursive_doubling": recursive.all_reduce_doubling,
        "halving_doubling": recursive.all_reduce_halving_doubling,
        "hierarchical": hierarchical.all_reduce,
        "direct": direct.all_reduce,
    },
    "reduce": {"tree": tree.reduce, "ring": ring.reduce, "direct": direct.reduce},
    "broadcast": {"tree": tree.broadcast, "ring": ring.broadcast, "direct": direct.broadcast},
    "all_gather": {"ring": ring.all_gather, "recursive_doubling": recursive.all_gather_bruck,
                   "hierarchical": hierarchical.all_gather, "direct": direct.all_gather},
    "reduce_scatter": {"ring": ring.reduce_scatter, "hierarchical": hierarchical.reduce_scatter,
                       "direct": direct.reduce_scatter},
    "gather": {"tree": "tree", "direct": direct.gather},
    "scatter": {"tree": "tree", "direct": direct.scatter},
    "all_to_all": {"direct": direct.all_to_all},
    "barrier": {"direct": None},
}
# gather/scatter "tree" work on a root-relative layout; the front end maps it (see collectives.py).


def algorithms_for(op: str, transport_kind: str) -> list[str]:
    """Algorithm names valid for ``op`` on a transport kind: "native" where it has torch's own
    collectives, "shm" where it has shared memory (its ``Capabilities``)."""
    caps = CAPABILITIES.get(transport_kind, Capabilities())
    names = list(REGISTRY[op])
    if caps.native_collectives:
        names.append("native")
    if caps.shared_memory and op in shm_direct.ALGORITHMS:
        names.append("shm")
    return names


def lookup(op: str, name: str) -> Callable:
    """The function of algorithm ``name`` for ``op`` (a REGISTRY entry, or a shm collective)."""
    if name == "shm":
        return shm_direct.ALGORITHMS[op]
    return REGISTRY[op][name]
