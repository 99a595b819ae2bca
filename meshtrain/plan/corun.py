"""Run one measurement in several processes at the same moment.

Ranks that share a host slow each other down (caches, memory bandwidth, and time slices once there
are more ranks than cores), so ``this-host``'s profile of one rank's block is taken while as many
copies run as the layout has ranks. The copies are long-lived child interpreters (one set per count,
started on first use, stopped at exit); each receives the job, reports ready, and starts only when
all are ready. Pipes only: nothing is left in /dev/shm or /tmp.
"""

from __future__ import annotations

import atexit
import pickle
import select
import subprocess
import sys
from typing import IO, Any, Callable

TIMEOUT_S = 300.0
"""The longest one job may take in a copy before the measurement is abandoned with an error."""

_pools: dict[int, list[subprocess.Popen]] = {}
_serial: dict[int, int] = {}
_starts = 0


def _send(stream: IO[bytes], obj: Any) -> None:
    pickle.dump(obj, stream)
    stream.flush()


def serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """A copy's loop: job, "ready", wait for "go", run, result."""
    while True:
        try:
            job = pickle.load(inp)
        except EOFError:
            return
        if job is None:
            return
        fn, args = job
        _send(out, "ready")
        pickle.load(inp)  # "go": every copy starts together
        try:
            _send(out, ("ok", fn(*args)))
        except Exception as e:  # noqa: BLE001 - reported to the caller, who raises it
            _send(out, ("error", f"{type(e).__name__}: {e}"))


def _start(copies: int) -> list[subprocess.Popen]:
    # a fresh interpreter per copy (not fork: torch's OpenMP pool does not survive a fork; not
    # multiprocessing's spawn: it re-imports the caller's __main__)
    code = "import sys; from meshtrain.plan.corun import serve; serve(sys.stdin.buffer, sys.stdout.buffer)"
    return [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE) for _ in range(copies)]


def _receive(proc: subprocess.Popen, what: str) -> Any:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT_S)
    if not ready:
        raise RuntimeError(f"a profiling process did not {what} within {TIMEOUT_S:.0f} s")
    return pickle.load(proc.stdout)


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
    procs = _pools[copies]
    try:
        for i, p in enumerate(procs):
            _send(p.stdin, (fn, (*args, i) if ranked else args))  # type: ignore[arg-type]
        for p in procs:
            _receive(p, "start")
        for p in procs:
            _send(p.stdin, "go")  # type: ignore[arg-type]
        results = [_receive(p, "finish") for p in procs]
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as e:  # a copy died or hung
        stop(copies)
        raise RuntimeError(f"profiling in {copies} processes failed: {e}") from e
    errors = [msg for status, msg in results if status == "error"]
    if errors:
        raise RuntimeError(f"profiling failed: {errors[0]}")
    return [value for _, value in results]


def stop(copies: int | None = None) -> None:
    """Stop the copies (every set without ``copies``)."""
    for n in [copies] if copies is not None else list(_pools):
        procs = _pools.pop(n, [])
        for p in procs:  # tell every copy first: copies that share a communicator leave together
            try:
                _send(p.stdin, None)  # type: ignore[arg-type]
                p.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()


atexit.register(stop)
