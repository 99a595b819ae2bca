"""Naming a deadlock in seconds: ranks blocked in collectives that wait for each other's calls.

When the ranks of a job call collectives in different orders (rank 0: all_reduce on group A,
then on group B; rank 1: B, then A), every rank waits for a call its peer has not reached, and
without this module the job only ends at the collective timeout (minutes), naming one call.

Each rank's ``Monitor`` knows its in-flight calls and when it last completed one; with the
sequence number each of its groups has reached (``Group._seq``) that makes its ``WaitState``.
``find`` takes every rank's state and names a deadlock when

* every live rank is blocked (a thread of it is inside a collective or waits for one) with at
  least one call in flight, and none has completed a call for ``stall_s`` seconds; and
* there is a wait-for cycle: rank r waits for rank m when r has call ``#s`` of group g in flight
  and m, a member of g, has issued fewer than ``s`` calls on g (it has not reached the call).

A blocked rank issues no further calls, so no rank of such a cycle can ever reach the call the
previous one waits for: the cycle cannot resolve, however long the timeout. The stall bound only
keeps a slow but progressing job (a long step, a rank computing while the others wait, every
member in the same slow call) from being examined at all; none of those has a cycle.

The processes' heartbeats (``liveness.py``) carry the states and run ``find`` every period; on
ranks as threads (``run_local``) the caller's thread does. ``MESHTRAIN_DEADLOCK_S`` sets
``stall_s`` (default 5 s; 0 turns the check off).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Sequence

DEFAULT_STALL_S = 5.0


def stall_s() -> float:
    """Seconds without a completed call before a deadlock may be named (``MESHTRAIN_DEADLOCK_S``,
    default 5; 0 or less: off). Read on every round, so a test can change it."""
    try:
        return float(os.environ.get("MESHTRAIN_DEADLOCK_S", DEFAULT_STALL_S))
    except ValueError:
        return DEFAULT_STALL_S


@dataclass(frozen=True)
class Call:
    """A collective in flight on one rank: call ``#seq`` of group ``gid`` (global ``ranks``)."""

    gid: int
    ranks: tuple[int, ...]
    seq: int
    op: str
    age_s: float  # seconds since it started


@dataclass(frozen=True)
class WaitState:
    """What one rank waits for: its in-flight calls, the calls it has issued per group (the
    highest sequence number, for every group it is a member of), the seconds since it last
    completed a call, and whether a thread of it is blocked in a collective (a synchronous call,
    or a wait for an asynchronous one: a rank with only async calls in flight may still compute
    and issue the calls its peers wait for)."""

    calls: tuple[Call, ...]
    issued: dict[int, int] = field(default_factory=dict)
    idle_s: float = 0.0
    blocked: bool = False

    def stalled(self, stall: float) -> bool:
        """True if this rank may be part of a deadlock: blocked, in a call, idle for ``stall`` s."""
        return self.blocked and bool(self.calls) and self.idle_s >= stall

    def encode(self) -> str:
        """Compact JSON (no spaces: it rides the heartbeat value after a space)."""
        return json.dumps({"c": [[c.gid, list(c.ranks), c.seq, c.op, round(c.age_s, 2)] for c in self.calls],
                           "i": [[g, s] for g, s in self.issued.items()], "t": round(self.idle_s, 2),
                           "b": int(self.blocked)}, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> "WaitState":
        """The state ``encode`` wrote; ValueError (or KeyError, TypeError) if it is not one."""
        d = json.loads(text)
        calls = tuple(Call(int(g), tuple(int(r) for r in rs), int(s), str(op), float(a)) for g, rs, s, op, a in d["c"])
        return cls(calls, {int(g): int(s) for g, s in d["i"]}, float(d["t"]), bool(d["b"]))


def _waits_for(states: Sequence[WaitState | None], r: int) -> list[tuple[Call, int, int]]:
    """(call, member, calls the member issued on the call's group) for every member that has not
    reached one of rank ``r``'s in-flight calls."""
    out = []
    for c in states[r].calls:  # type: ignore[union-attr]
        for m in c.ranks:
            other = states[m] if 0 <= m < len(states) else None
            if m != r and other is not None and other.issued.get(c.gid, 0) < c.seq:
                out.append((c, m, other.issued.get(c.gid, 0)))
    return out


def _cycle(edges: dict[int, list[int]]) -> list[int] | None:
    """One cycle of the graph (ranks in order, the first repeated at the end), or None."""
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    path: list[int] = []

    def visit(r: int) -> list[int] | None:
        state[r] = 1
        path.append(r)
        for m in edges.get(r, ()):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[r] = 2
        return None

    for r in sorted(edges):
        if r not in state:
            found = visit(r)
            if found:
                return found
    return None


def find(states: Sequence[WaitState | None], stall: float) -> str | None:
    """The message naming a deadlock among the ranks whose ``states`` are given (indexed by
    global rank; None: a rank that finished, which is not live), or None (see the module
    docstring for the rule). ``stall`` <= 0 turns the check off."""
    live = [r for r, s in enumerate(states) if s is not None]
    if stall <= 0 or not live or not all(states[r].stalled(stall) for r in live):  # type: ignore[union-attr]
        return None
    waits = {r: _waits_for(states, r) for r in live}
    cycle = _cycle({r: sorted({m for _, m, _ in w}) for r, w in waits.items()})
    if cycle is None:
        return None
    parts = []
    for r in live:
        for c in states[r].calls:  # type: ignore[union-attr]
            lag = [(m, n) for cc, m, n in waits[r] if cc is c]
            where = f"rank {r} is in {c.op} #{c.seq} on group {c.gid} (ranks {list(c.ranks)}) for {c.age_s:.1f}s"
            if lag:
                where += ", waiting for " + " and ".join(
                    f"rank {m}, which has issued {n} call{'s' if n != 1 else ''} on that group" for m, n in lag)
            else:
                where += " (every member has reached it)"
            parts.append(where)
    idle = min(states[r].idle_s for r in live)  # type: ignore[union-attr]
    return ("deadlock: " + "; ".join(parts) + f". No rank has completed a collective for {idle:.1f}s and the "
            f"waits form a cycle ({' -> '.join(f'rank {r}' for r in cycle)}), so none can ever complete: the ranks "
            "called collectives in different orders. Every rank of a group must call the group's collectives in "
            "the same order; give concurrent streams of collectives (threads, overlapped async calls) groups of "
            "their own, each called in the same order on every rank.")
