"""``Work``: the handle of an operation that may still be running (as torch.distributed's Work)."""

from __future__ import annotations

import datetime
import threading
from typing import Any, Callable

import torch

from ..errors import CollectiveTimeout


class _Latch:
    """A one-shot ``threading.Event`` (``set``, ``is_set``, ``wait``) made of one lock, held from
    creation until ``set``: a Work is made for every operation, and an Event (a Condition, its lock
    and a waiter list, built in Python) cost 2 µs of the 5 µs a point-to-point Work took to make
    and finish. Every waiter takes the lock and hands it straight on, so all of them wake."""

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        """True once ``set`` was called."""
        return self._flag

    def set(self) -> None:
        """Mark done and wake every waiter (call once)."""
        if not self._flag:
            self._flag = True
            self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set, or ``timeout`` seconds; return whether it is set."""
        if self._flag:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._lock.release()
        return self._flag


class Work:
    """Handle of an asynchronous send, receive or collective.

    ``wait(timeout)`` blocks until the operation is done and re-raises its error; ``is_completed()``
    polls; ``exception()`` returns the error of a finished operation (or None); ``get_future()``
    gives a ``torch.futures.Future`` of the outputs, as torch.distributed's Work does.
    """

    def __init__(self, description: str = "operation") -> None:
        self._done = _Latch()
        self._exc: BaseException | None = None
        self._result: Any = None
        self._callbacks: list[Callable[[Work], None]] = []
        self._lock = threading.Lock()
        self._future: _WorkFuture | None = None
        self.description = description

    # -- completion (called by whoever runs the operation) ---------------------------------
    def _finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        # Callbacks run before waiters wake, so after wait() their effects are visible.
        self._result, self._exc = result, exc
        while True:
            with self._lock:
                callbacks, self._callbacks = self._callbacks, []
                if not callbacks:
                    self._done.set()
                    return
            for cb in callbacks:
                try:
                    cb(self)
                except BaseException as err:  # noqa: BLE001 - surfaces in wait()
                    self._exc = self._exc or err

    def _progress(self, timeout: float | None) -> bool:
        """Drive the operation; return True once done. Subclasses that complete lazily override."""
        return self._done.wait(timeout)

    # -- public API -----------------------------------------------------------------------
    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block until done and return True; re-raise the operation's error. ``timeout``: seconds
        or, as in torch, a ``datetime.timedelta`` (``timedelta(0)``, torch's default, means none).
        Past it, raise ``CollectiveTimeout`` (a RuntimeError, like gloo's); the operation itself
        goes on until its group's deadline, so a later ``wait()`` can still succeed."""
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds() or None
        elif timeout is not None and not isinstance(timeout, (int, float)):
            raise TypeError(f"Work.wait: timeout must be seconds or a datetime.timedelta, got {timeout!r}")
        if not self._progress(timeout):
            raise CollectiveTimeout(
                f"{self.description} did not complete within {timeout:.3g}s of wait(); "
                "raise the timeout or check that every rank of the group calls it"
            )
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not. Never blocks."""
        return self._progress(0)

    def exception(self) -> BaseException | None:
        """The error of a finished operation, or None (also while it is still running)."""
        return self._exc if self.is_completed() else None

    def result(self) -> Any:
        """Wait, then return the operation's result (the output tensor(s) of a collective)."""
        self.wait()
        return self._result

    def add_done_callback(self, fn: Callable[["Work"], None]) -> None:
        """Call ``fn(work)`` once the operation finishes (immediately if it already has), before
        ``wait()`` returns; ``fn`` must not wait on this work. Its error surfaces in ``wait()``."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)


    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` completed with the operation's outputs when it finishes, as
        torch.distributed's (a list: ``[tensor]`` for all_reduce, broadcast, all_to_all_single,
        send and recv; the output list for all_gather and all_to_all; ``[]`` for barrier), or with
        its error. ``then`` callbacks run on the thread that finishes the operation (a group's
        worker thread for collectives); a receive on the thread or local transport finishes when
        waited on, and the future's ``wait()`` does that. Unlike gloo, p2p works have one too."""
        with self._lock:
            if self._future is None:
                self._future = _WorkFuture(self)
                fut = self._future
                pending = not self._done.is_set()
                if pending:
                    self._callbacks.append(fut._settle)
            else:
                return self._future
        if not pending:
            fut._settle(self)
        return fut


def _future_value(result: Any) -> list[Any]:
    if result is None:
        return []
    if isinstance(result, (list, tuple)):
        return list(result)
    return [result]


class _WorkFuture(torch.futures.Future):
    """The future of a ``Work``; its ``wait()`` first drives the work (some complete only when
    waited on), so it never blocks on an operation nobody progresses."""

    def __init__(self, work: Work) -> None:
        super().__init__()
        self._work = work
        self._settled = threading.Lock()

    def _settle(self, work: Work, exc: BaseException | None = None) -> None:
        with self._settled:
            if super().done():
                return
            err = exc if exc is not None else work._exc
            if err is not None:
                self.set_exception(err)
            else:
                self.set_result(_future_value(work._result))

    def wait(self) -> Any:
        """Drive the work to completion, then return its outputs (or raise its error)."""
        if not super().done():
            try:
                self._work.wait()
            except BaseException as exc:  # noqa: BLE001 - the future carries it
                self._settle(self._work, exc)
        return super().wait()

    def value(self) -> Any:
        """The outputs of a completed work (raises its error)."""
        return super().value()


def completed_work(result: Any = None, description: str = "operation") -> Work:
    """A Work that is already done (for operations that finish eagerly)."""
    w = Work(description)
    w._finish(result)
    return w
