"""``Work``: the handle of an operation that may still be running (as torch.distributed's Work)."""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..errors import CollectiveTimeout


class Work:
    """Handle of an asynchronous send, receive or collective.

    ``wait(timeout)`` blocks until the operation is done and re-raises its error; ``is_completed()``
    polls; ``exception()`` returns the error of a finished operation (or None).
    """

    def __init__(self, description: str = "operation") -> None:
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._result: Any = None
        self._callbacks: list[Callable[[Work], None]] = []
        self._lock = threading.Lock()
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
    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (at most ``timeout`` seconds); re-raise the operation's error."""
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


def completed_work(result: Any = None, description: str = "operation") -> Work:
    """A Work that is already done (for operations that finish eagerly)."""
    w = Work(description)
    w._finish(result)
    return w
