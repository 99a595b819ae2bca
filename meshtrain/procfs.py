"""What Linux's /proc tells of another process: its children, its initial environment, its state.
Shared by the simulated hosts (``simhosts``) and the elastic worker's frozen-sibling check
(``train/elastic_world``); standard library only, so either may import it cheaply."""

from __future__ import annotations

import contextlib
import os


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's: a child belongs to the thread that forked it)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    return sorted(set(out))


def environ(pid: int) -> list[bytes]:
    """``pid``'s initial environment as NAME=value entries; empty if it is gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def state(pid: int) -> str | None:
    """``pid``'s state letter (R, S, T stopped by a signal, Z zombie, ...); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """True until ``pid`` has finished dying (a zombie is dead)."""
    return state(pid) not in (None, "Z", "X")
