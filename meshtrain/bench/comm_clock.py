"""``CommClock``: a torch.distributed-like module whose communication calls are timed.

The compat bench wraps ``torch.distributed`` and ``meshtrain.comm`` alike, so each mode reports
the seconds per step its ranks spent inside communication (collectives, and waits on p2p
Works): what switching the import can save at most, the rest of a step being compute. Time in a
call includes waiting for a slower peer (a pipeline bubble, a straggler), so it bounds the
communication's own cost from above.
"""

from __future__ import annotations

import time
from typing import Any, Callable

TIMED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
         "barrier", "broadcast_object_list", "all_gather_object", "send", "recv")


class _TimedWork:
    """A Work whose ``wait`` is timed on the clock."""

    def __init__(self, work: Any, clock: "CommClock") -> None:
        self._work, self._clock = work, clock

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped Work's ``wait``, timed."""
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._clock.seconds += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommClock:
    """Stands for ``dist`` (a module with torch.distributed's names): every name resolves to the
    module's own, except the collectives of ``TIMED`` and ``batch_isend_irecv``, whose time (and
    that of waits on the Works they return) adds up in ``seconds``. ``isend``/``irecv`` are the
    module's own objects, so ``P2POp`` recognises them."""

    def __init__(self, dist: Any) -> None:
        self._dist = dist
        self.seconds = 0.0

    def reset(self) -> None:
        """Start counting again from zero."""
        self.seconds = 0.0

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
            if kwargs.get("async_op") and out is not None:
                return _TimedWork(out, self)
            return out
        return call

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._dist, name)
        if name in TIMED:
            return self._timed(value)
        if name == "batch_isend_irecv":
            timed = self._timed(value)
            return lambda ops: [_TimedWork(w, self) for w in timed(ops)]
        return value
