"""One progress engine per rank: its shared-memory messages keep moving while it blocks elsewhere.

A shm message larger than the outbox (SLOTS x SLOT_BYTES) leaves the sender chunk by chunk, and
only the two processes' own threads copy the chunks: nothing moves while the sender's (or the
receiver's) thread is blocked on another link. On a group whose ring mixes shm links (same host)
and gloo links (other hosts), rank A blocks in gloo waiting for B on the other host, B for C over
shm, C in gloo for D, D for A over shm, and no wait can end: the cycle of waits 0 -> (gloo) -> 3
-> (shm) -> 2 -> (gloo) -> 1 -> (shm) -> 0 deadlocks every ring step above 2 MiB.

gloo cannot be polled (its send/recv work completes only inside ``wait()``, and a timed-out wait
closes the pair), so the rank's thread must block there. While it does, this engine's thread
pumps the rank's shm sends and receives (``ShmTransport.poll``), so every pending message of the
rank moves whichever link its thread waits on, and no cycle of waits can form. The thread runs
only while some wait outside shm is in progress, and backs off to a 1 ms period when nothing moves.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

IDLE_SLEEP_S = (20e-6, 1e-3)  # the pump's sleep when nothing moved: starts short, doubles to the cap


class ProgressEngine:
    """Runs ``pump()`` (which returns True when it moved anything) on a thread of its own while
    at least one caller is inside ``blocked()``."""

    def __init__(self, pump: Callable[[], bool], name: str = "meshtrain-progress") -> None:
        self._pump = pump
        self._name = name
        self._cv = threading.Condition()
        self._blocked = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        """Wrap a wait on a link this rank cannot drive itself (gloo, the store)."""
        with self._cv:
            if self._closed:
                yield
                return
            self._blocked += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()
        try:
            yield
        finally:
            with self._cv:
                self._blocked -= 1

    def _run(self) -> None:
        sleep = IDLE_SLEEP_S[0]
        while True:
            with self._cv:
                while self._blocked == 0 and not self._closed:
                    self._cv.wait()
                    sleep = IDLE_SLEEP_S[0]
                if self._closed:
                    return
            if self._pump():
                sleep = IDLE_SLEEP_S[0]
                continue
            time.sleep(sleep)
            sleep = min(sleep * 2, IDLE_SLEEP_S[1])

    def close(self) -> None:
        """Stop the thread (waits for it, at most a second)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)
