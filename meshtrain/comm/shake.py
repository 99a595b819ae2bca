"""Timing perturbed on purpose, so that an ordering race fails every run instead of one in three.

A race between two streams of calls (a worker thread's bucket all-reduces and the training
thread's all-to-all, say) shows only when the machine happens to schedule the threads one way;
on a quiet machine a test passes, on a loaded one it fails now and then. With shaking on, each
collective sleeps a random time (0 to ``max_ms``, half of them not at all) on the thread that
issues it, before it takes its sequence number, and the thread transport's sends sleep before
they are posted: the threads' interleavings are spread over the orders a busy machine produces.
Each (seed, rank, thread) draws from its own generator, so a seed names a perturbation (threads'
scheduling still varies: a seed is a pattern, not a replay).

On in one process with ``enable(seed)`` / ``disable()`` (or ``shaking(seed)``), and in processes
with ``MESHTRAIN_SHAKE=SEED[:MAX_MS]``, read by ``from_env`` when ``comm.init`` runs. Off, it
costs the collectives one module-attribute test.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from typing import Iterator

ENV = "MESHTRAIN_SHAKE"
DEFAULT_MAX_MS = 2.0


class Shaker:
    """Random pauses of up to ``max_ms`` milliseconds, one generator per (seed, rank, thread)."""

    def __init__(self, seed: int, max_ms: float = DEFAULT_MAX_MS) -> None:
        if max_ms < 0:
            raise ValueError(f"shake: max_ms = {max_ms} must be >= 0")
        self.seed, self.max_s = int(seed), max_ms / 1000.0
        self._local = threading.local()

    def pause(self, rank: int) -> None:
        """Sleep a random time (none half of the time) on the calling thread of ``rank``."""
        rngs = getattr(self._local, "rngs", None)
        if rngs is None:
            rngs = self._local.rngs = {}
        rng = rngs.get(rank)
        if rng is None:  # a string seed: the same numbers in every process (hash() is salted)
            rng = rngs[rank] = random.Random(f"{self.seed}/{rank}/{threading.current_thread().name}")
        if rng.random() < 0.5:
            time.sleep(rng.random() * self.max_s)


ACTIVE: Shaker | None = None
"""The shaker in force in this process (None: off)."""


def enable(seed: int, max_ms: float = DEFAULT_MAX_MS) -> Shaker:
    """Turn shaking on in this process (every rank and thread of it)."""
    global ACTIVE
    ACTIVE = Shaker(seed, max_ms)
    return ACTIVE


def disable() -> None:
    """Turn shaking off."""
    global ACTIVE
    ACTIVE = None


@contextlib.contextmanager
def shaking(seed: int, max_ms: float = DEFAULT_MAX_MS) -> Iterator[Shaker]:
    """Shaking on for the ``with`` block (threads' tests: ``with shaking(3): comm.run_local(...)``)."""
    before = ACTIVE
    try:
        yield enable(seed, max_ms)
    finally:
        globals()["ACTIVE"] = before


def from_env() -> Shaker | None:
    """Turn shaking on from ``MESHTRAIN_SHAKE=SEED[:MAX_MS]`` if set; ValueError naming the form
    for a value that is not one."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return ACTIVE
    seed, _, ms = value.partition(":")
    try:
        return enable(int(seed), float(ms) if ms else DEFAULT_MAX_MS)
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: use SEED or SEED:MAX_MS, e.g. {ENV}=3 or {ENV}=3:5 "
                         f"(an integer seed, a pause of at most MAX_MS milliseconds)") from None


__all__ = ["Shaker", "ACTIVE", "ENV", "enable", "disable", "shaking", "from_env"]
