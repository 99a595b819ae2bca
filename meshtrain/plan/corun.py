"""Run one measurement in several processes at the same moment.

Ranks that share a host slow each other down (caches, memory bandwidth, and time slices once there
are more ranks than cores), so ``this-host``'s profile of one rank's block is taken while as many
copies run as the layout has ranks. The copies are long-lived processes (one set per count, started
on first use, stopped at exit) forked from the server that training ranks are forked from
(``worker_processes``: torch imported once there, not again in each copy, which took most of a
profiled check's time on a 2-core host), so a copy runs as a training rank does. Each receives the
job, reports ready, and starts only when all are ready. Pipes only: nothing is left in /dev/shm or
/tmp. As for any multiprocessing start other than fork, a script that profiles (``this_host``,
``--parallel.auto``) keeps its own work under ``if __name__ == "__main__":`` (the copies import the
caller's main module); meshtrain's commands do.
"""

from __future__ import annotations

import atexit
from multiprocessing.connection import Connection
from typing import Any, Callable

from .. import worker_processes

TIMEOUT_S = 300.0
"""The longest one job may take in a copy before the measurement is abandoned with an error."""


class _Copy:
    """One copy: its process and this end of its pipe."""

    def __init__(self, proc: Any, conn: Connection) -> None:
        self.proc, self.conn = proc, conn


_pools: dict[int, list[_Copy]] = {}
_serial: dict[int, int] = {}
_starts = 0
_at_stop: list[Callable[[], None]] = []  # in a copy: what it runs when told to stop


def at_stop(fn: Callable[[], None]) -> None:
    """In a copy: run ``fn`` when the copy is told to stop (a forked process runs no ``atexit``
    handler), e.g. to leave a communicator the copies share together."""
    _at_stop.append(fn)


def serve(conn: Connection) -> None:
    """A copy's loop: job, "ready", wait for "go", run, result; at the end, the ``at_stop`` hooks."""
    try:
        while True:
            try:
                job = conn.recv()
            except EOFError:
                return
            if job is None:
                return
            fn, args = job
            conn.send("ready")
            conn.recv()  # "go": every copy starts together
            try:
                conn.send(("ok", fn(*args)))
            except Exception as e:  # noqa: BLE001 - reported to the caller, who raises it
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        for fn in reversed(_at_stop):
            fn()


def _start(copies: int) -> list[_Copy]:
    ctx = worker_processes.context()
    pool = []
    for _ in range(copies):
        mine, theirs = ctx.Pipe()
        proc = worker_processes.start(serve, (), handles=(theirs,), name="meshtrain-profile")
        theirs.close()
        pool.append(_Copy(proc, mine))
    return pool


def _receive(copy: _Copy, what: str) -> Any:
    if not copy.conn.poll(TIMEOUT_S):
        raise RuntimeError(f"a profiling process did not {what} within {TIMEOUT_S:.0f} s")
    try:
        return copy.conn.recv()
    except EOFError:  # the copy ended (killed, out of memory, os._exit)
        copy.proc.join(timeout=5)
        raise RuntimeError(f"a profiling process ended (exit code {copy.proc.exitcode}) before it could "
                           f"{what}") from None


def started(copies: int) -> int:
    """Start the set of ``copies`` processes if it is not running; returns its number, new with each
    start (state a caller keeps per set, e.g. a store's port, must not outlive the set)."""
    global _starts
    if copies not in _pools:
        _pools[copies] = _start(copies)
        _starts += 1
        _serial[copies] = _starts
    return _serial[copies]


def together(copies: int, fn: Callable[..., Any], *args: Any, ranked: bool = False) -> list[Any]:
    """``fn(*args)`` run in ``copies`` processes at once; their results, one per copy. ``fn`` must be
    a module-level function (it is pickled). ``ranked``: copy i calls ``fn(*args, i)``."""
    started(copies)
    pool = _pools[copies]
    try:
        for i, c in enumerate(pool):
            c.conn.send((fn, (*args, i) if ranked else args))
        for c in pool:
            _receive(c, "start")
        for c in pool:
            c.conn.send("go")
        results = [_receive(c, "finish") for c in pool]
    except (OSError, RuntimeError) as e:  # a copy died or hung
        stop(copies)
        raise RuntimeError(f"profiling in {copies} processes failed: {str(e) or type(e).__name__}") from e
    errors = [msg for status, msg in results if status == "error"]
    if errors:
        raise RuntimeError(f"profiling failed: {errors[0]}")
    return [value for _, value in results]


def stop(copies: int | None = None) -> None:
    """Stop the copies (every set without ``copies``)."""
    for n in [copies] if copies is not None else list(_pools):
        pool = _pools.pop(n, [])
        for c in pool:  # tell every copy first: copies that share a communicator leave together
            try:
                c.conn.send(None)
            except OSError:
                pass
        for c in pool:
            c.proc.join(timeout=5)
            if c.proc.is_alive():
                c.proc.kill()
                c.proc.join()
            c.conn.close()


atexit.register(stop)
