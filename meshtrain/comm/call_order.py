"""A record of every collective a rank issues, per group, for tests to check one order on every rank.

Every rank of a group must issue the group's collectives in the same order with the same
metadata. The runner's metadata check catches a disagreement when the ranks meet in the call,
but a race can also pair calls that happen to agree (two equal bucket all-reduces swapped), or
leave a run that passed by luck. ``start()`` makes the runner note each call this rank issues
(group, sequence number, op, shapes, dtype); ``stop()`` returns the notes; ``check(notes of
every rank)`` raises ``CollectiveMismatch`` at the first call where the members' sequences differ.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from ..errors import CollectiveMismatch
from .communicator import Communicator, Group, current

Note = tuple[int, tuple[int, ...], int, str, str, str]
"""(group id, group ranks, sequence number, op, shapes, dtype) of one call."""

_lock = threading.Lock()
_notes: dict[int, list[Note]] = {}  # id(communicator) -> its notes, while it records
RECORDING = 0
"""How many communicators record (the runner asks this before anything else: off costs nothing)."""


def start(communicator: Communicator | None = None) -> None:
    """Note every collective this rank issues from now on (its communicator, on every thread)."""
    global RECORDING
    c = communicator or current()
    with _lock:
        if id(c) not in _notes:
            _notes[id(c)] = []
            RECORDING += 1


def stop(communicator: Communicator | None = None) -> list[Note]:
    """Stop noting; the notes since ``start``, in issue order."""
    global RECORDING
    c = communicator or current()
    with _lock:
        notes = _notes.pop(id(c), None)
        if notes is None:
            raise RuntimeError("call_order.stop() without call_order.start() on this rank's communicator")
        RECORDING -= 1
    return notes


def note(g: Group, seq: int, op: str, meta: dict[str, Any]) -> None:
    """The runner's hook: note call ``seq`` of group ``g`` if its communicator records."""
    notes = _notes.get(id(g.comm))
    if notes is not None:
        with _lock:
            notes.append((g.gid, tuple(g.ranks), seq, op, str(meta.get("shapes")), str(meta.get("dtype"))))


def check(per_rank: Sequence[Sequence[Note]]) -> int:
    """Raise ``CollectiveMismatch`` unless, for every group, every member issued the same calls
    (op, shapes, dtype) in the same order; ``per_rank[r]`` is rank r's ``stop()``. Returns the
    number of calls compared."""
    by_group: dict[int, dict[int, list[Note]]] = {}
    ranks_of: dict[int, tuple[int, ...]] = {}
    for rank, notes in enumerate(per_rank):
        for n in notes:
            by_group.setdefault(n[0], {}).setdefault(rank, []).append(n)
            ranks_of[n[0]] = n[1]
    compared = 0
    for gid, members in sorted(by_group.items()):
        seqs = {r: [n[3:] for n in sorted(ns, key=lambda n: n[2])] for r, ns in members.items()}
        expected = [r for r in ranks_of[gid] if r < len(per_rank)]
        first = seqs.get(expected[0], [])
        for r in expected[1:]:
            mine = seqs.get(r, [])
            for i in range(max(len(first), len(mine))):
                a = first[i] if i < len(first) else None
                b = mine[i] if i < len(mine) else None
                if a != b:
                    raise CollectiveMismatch(
                        f"group {gid} (ranks {list(ranks_of[gid])}): call #{i + 1} is {_say(a)} on rank "
                        f"{expected[0]} but {_say(b)} on rank {r}; every rank of a group must issue its "
                        f"collectives in the same order (streams that issue concurrently need groups of "
                        f"their own)")
        compared += len(first)
    return compared


def _say(call: tuple[str, str, str] | None) -> str:
    return "missing" if call is None else f"{call[0]} shapes={call[1]} dtype={call[2]}"


__all__ = ["Note", "RECORDING", "start", "stop", "note", "check"]
