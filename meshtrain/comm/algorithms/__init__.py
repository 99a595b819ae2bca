"""Collective algorithms, one plain function per (operation, algorithm), over a ``Ctx``.

``REGISTRY[op][name]`` is meshtrain's own function (any transport). ``dispatch.TABLE`` maps
(operation, algorithm name) to the implementation the front end runs: those functions, the shm
collectives (``shm_direct``, on transports with shared memory) and "native" (torch.distributed's
own collective, on transports with ``native_collectives``) alike. ``algorithms_for`` and
``implementation`` both read that table.
"""

from __future__ import annotations

import functools
from typing import Callable

from ..transport.registry import Capabilities, capabilities_of
from .dispatch import REGISTRY, TABLE, Implementation

__all__ = ["REGISTRY", "TABLE", "Implementation", "algorithms_for", "implementation"]


def algorithms_for(op: str, transport_kind: str) -> list[str]:
    """Algorithm names valid for ``op`` on a transport kind: the table's entries for ``op`` whose
    needed capability the kind's registry entry has ("native" needs torch's own collectives, "shm" shared memory)."""
    if op not in REGISTRY:
        raise KeyError(op)
    return list(_offered(op, capabilities_of(transport_kind)))


@functools.lru_cache(maxsize=None)
def _offered(op: str, caps: Capabilities) -> tuple[str, ...]:
    # Cached: every collective call asks, and the scan of the table cost ~10 us of a ~500 us call.
    return tuple(name for (o, name), impl in TABLE.items() if o == op and impl.offered_on(caps))


def implementation(op: str, name: str) -> Callable:
    """The implementation of ``op`` by algorithm ``name``, with the operation's signature
    (``dispatch``'s docstring). The caller has checked the name with ``algorithms_for``."""
    return TABLE[op, name].run

