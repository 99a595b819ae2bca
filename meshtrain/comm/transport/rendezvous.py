"""All-gather of short strings through a torch.distributed store: the shm transport's rendezvous
and the torch transport's metadata exchange.

Each rank sets one key and reads everyone's with one blocking ``multi_get``, so a timeout can
name exactly the ranks whose key is absent.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Callable, ContextManager, Sequence

import torch.distributed as dist

from .base import PeerTimeout


def set_store_timeout(store: Any, timeout: float) -> None:
    """Bound the store's blocking reads by ``timeout`` seconds (a local setter, no round trip)."""
    store.set_timeout(datetime.timedelta(seconds=max(timeout, 0.001)))


def is_store_timeout(exc: BaseException) -> bool:
    """True if ``exc`` is a store wait that ran out of time: torch raises ``DistStoreError`` for
    that, and ``DistNetworkError`` for a lost connection (which must not read as a late rank)."""
    return isinstance(exc, dist.DistStoreError)


def store_all_gather(store: Any, prefix: str, rank: int, ranks: Sequence[int], value: str, *,
                     where: str = "",
                     blocked: Callable[[], ContextManager[None]] = contextlib.nullcontext) -> list[str]:
    """Set ``prefix/<rank>`` to ``value`` and return every member's value, in ``ranks`` order.

    The wait is bounded by the store's timeout (``set_store_timeout``). On timeout it raises
    ``PeerTimeout`` (``never_arrived``) naming the ranks whose key is absent, "ranks [..] never
    arrived" followed by ``where``. ``blocked`` is entered around the wait (the shm transport
    keeps its own messages moving meanwhile). Other store errors propagate unchanged.
    """
    keys = [f"{prefix}/{r}" for r in ranks]
    store.set(f"{prefix}/{rank}", value)
    try:
        with blocked():
            raw = store.multi_get(keys)  # waits for every key: one round trip, not one per rank
    except Exception as exc:
        if not is_store_timeout(exc):
            raise
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise PeerTimeout(f"ranks {missing} never arrived{where}", missing, never_arrived=True) from None
    return [v.decode() for v in raw]
