"""``run_local``: run a function on N ranks that are threads of this process."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..errors import CollectiveDeadlock
from . import deadlock
from .communicator import Communicator, bind_thread
from .transport import registry
from .transport.local import LocalWorld

WATCH_S = 1.0  # how often the caller's thread looks for a deadlock while the ranks run


def run_local(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0,
              check: bool = True, ranks_per_node: int | None = None, transport: str = "local",
              **kwargs: Any) -> list[Any]:
    """Call ``fn(rank, *args, **kwargs)`` on ``world_size`` threads, each with its own communicator
    bound as the default for ``meshtrain.comm``'s functions; return the results in rank order.

    ``timeout`` bounds every collective (a missing rank fails with ``CollectiveTimeout``);
    ``ranks_per_node`` simulates hosts (ranks r and s share a node iff r // k == s // k), which the
    hierarchical algorithm uses. The first failure is re-raised with its rank in the message, after
    the other ranks were woken with an error (no rank is left blocked); ranks deadlocked in
    collectives called in different orders are woken once ``deadlock.stall_s()`` passes, and a
    ``CollectiveDeadlock`` naming each rank's call is raised instead. ``transport`` names a
    registered transport whose ranks are threads (``transport/registry.py``; ``local`` by default).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    spec = registry.find(transport)
    if spec is None or not spec.threads:
        why = " (its ranks are processes: meshtrain.comm.init)" if spec is not None else ""
        raise ValueError(f"run_local cannot run transport {transport!r}{why}: use one whose ranks are threads, "
                         f"{', '.join(registry.names(threads=True))}")
    world = LocalWorld(world_size)
    k = ranks_per_node or world_size
    hosts = [f"node{r // k}" for r in range(world_size)]
    results: list[Any] = [None] * world_size
    failures: list[tuple[float, int, BaseException]] = []
    # Each rank's communicator while its function runs (the deadlock check reads their wait
    # states); "done" once it returned or raised: a finished rank is not live.
    comms: list[Communicator | str | None] = [None] * world_size

    def worker(rank: int) -> None:
        comm = None
        try:
            t = spec.build(registry.Setup(rank, world_size, timeout, world=world))
            comm = Communicator(t, timeout=timeout, check=check, hosts=hosts)
            comms[rank] = comm
            bind_thread(comm)
            results[rank] = fn(rank, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            failures.append((time.monotonic(), rank, exc))
            world.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")
        finally:
            comms[rank] = "done"
            bind_thread(None)
            if comm is not None:
                comm.close()

    threads = [threading.Thread(target=worker, args=(r,), name=f"meshtrain-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    found: str | None = None
    for t in threads:  # the caller's thread, idle anyway, watches for a deadlock between joins
        while t.is_alive():
            t.join(WATCH_S)
            if found is None and t.is_alive() and world.abort_reason is None:
                found = _deadlock(comms)
                if found is not None:
                    world.abort(found)  # every blocked rank raises, naming the calls
    if found is not None and failures:
        raise CollectiveDeadlock(found) from min(failures, key=lambda f: f[0])[2]
    if failures:
        _, rank, exc = min(failures, key=lambda f: f[0])
        if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith("[rank "):
            exc.args = (f"[rank {rank}] {exc.args[0]}",) + exc.args[1:]
        raise exc
    return results


def _deadlock(comms: list[Communicator | str | None]) -> str | None:
    """``deadlock.find`` over the ranks' communicators (None while a rank has not made its own yet:
    it is about to call, so nothing is decided)."""
    stall = deadlock.stall_s()
    if stall <= 0 or any(c is None for c in comms):
        return None
    states = [c.wait_state() if isinstance(c, Communicator) else None for c in comms]
    return deadlock.find(states, stall)
