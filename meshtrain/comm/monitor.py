"""Per-group counters (operations, bytes, time) and a flight recorder of the last N collectives."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from ..files import write_atomic
from .deadlock import Call, WaitState


class Monitor:
    """One rank's communication record. Thread-safe: async collectives finish on worker threads."""

    def __init__(self, rank: int, capacity: int = 256) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._recent: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._groups: dict[int, dict[str, Any]] = {}
        self._counters: dict[tuple[int, str], dict[str, Any]] = {}  # (group, op) -> its entry in _groups
        # The deadlock check (comm/deadlock.py) reads the calls in flight and the last completion
        # from the recorder's entries, once a second, so calls pay nothing for it; it counts the
        # threads waiting for an async call here.
        self._created = time.time()
        self._waiters = 0

    def begin(self, gid: int, ranks: list[int], seq: int, op: str, algorithm: str,
              shapes: Sequence[Sequence[int]], dtype: str, nbytes: int, sync: bool = True) -> dict[str, Any]:
        """Record the start of a collective; returns the flight-recorder entry. ``sync``: the
        caller's thread runs it (not an async op's worker), so this rank is blocked in it."""
        entry = {
            "rank": self.rank, "group": gid, "group_ranks": ranks, "seq": seq, "op": op,
            "algorithm": algorithm, "shapes": shapes, "dtype": dtype, "bytes": nbytes,
            "start": time.time(), "end": None, "state": "started", "sent_bytes": 0, "sync": sync,
        }
        self._recent.append(entry)  # deque.append is atomic: no lock on every call's way in
        return entry

    def end(self, entry: dict[str, Any], sent_bytes: int, error: BaseException | None = None) -> None:
        """Record the end (or failure) of a collective and add it to the group's counters."""
        now = time.time()
        entry["end"] = now
        entry["sent_bytes"] = sent_bytes
        entry["state"] = "completed" if error is None else f"failed: {type(error).__name__}"
        with self._lock:
            c = self._counters.get((entry["group"], entry["op"]))
            if c is None:
                g = self._groups.setdefault(entry["group"], {"ranks": entry["group_ranks"], "ops": {}})
                c = self._counters[entry["group"], entry["op"]] = g["ops"].setdefault(
                    entry["op"], {"count": 0, "bytes": 0, "sent_bytes": 0, "time_s": 0.0, "errors": 0})
            c["count"] += 1
            c["bytes"] += entry["bytes"]
            c["sent_bytes"] += sent_bytes
            c["time_s"] += now - entry["start"]
            c["errors"] += error is not None

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the calling thread as blocked for the deadlock check while it waits for an async call."""
        with self._lock:
            self._waiters += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1

    def wait_state(self, issued: dict[int, int]) -> WaitState:
        """This rank's ``WaitState`` now; ``issued``: the calls issued per group it is a member of.
        Read from the flight recorder: a call in flight that 256 (its capacity) later calls pushed
        out is missed, which can only hide a cycle, never make one."""
        while True:
            try:  # another thread may begin a call while the entries are copied
                recent = list(self._recent)
                break
            except RuntimeError:
                continue
        now = time.time()
        inflight = [e for e in recent if e["end"] is None]
        calls = tuple(Call(e["group"], tuple(e["group_ranks"]), e["seq"], e["op"], now - e["start"])
                      for e in inflight)
        ended = max((e["end"] for e in recent if e["end"] is not None), default=self._created)  # failed calls too
        blocked = self._waiters > 0 or any(e["sync"] for e in inflight)
        return WaitState(calls, dict(issued), now - ended, blocked)

    def stats(self) -> dict[int, dict[str, Any]]:
        """Counters per group id: {"ranks": [...], "ops": {op: {count, bytes, sent_bytes, time_s, errors}},
        "total": {...}}. ``bytes`` is the payload handed in; ``sent_bytes`` what this rank sent."""
        with self._lock:
            out: dict[int, dict[str, Any]] = {}
            for gid, g in self._groups.items():
                ops = {k: dict(v) for k, v in g["ops"].items()}
                total = {k: sum(o[k] for o in ops.values()) for k in ("count", "bytes", "sent_bytes", "time_s", "errors")}
                out[gid] = {"ranks": list(g["ranks"]), "ops": ops, "total": total}
            return out

    def reset(self) -> None:
        """Clear the counters (the flight recorder keeps its entries)."""
        with self._lock:
            self._groups.clear()
            self._counters.clear()

    def records(self) -> list[dict[str, Any]]:
        """The flight recorder: the last N collectives of this rank, oldest first."""
        with self._lock:  # shapes as lists, as JSON has them (calls record the tuples they carry)
            return [dict(e, shapes=[list(s) for s in e["shapes"]]) for e in list(self._recent)]

    def dump(self, path: str) -> str:
        """Write the flight recorder as JSON (atomically: temp file, then rename). Returns the path."""
        write_atomic(path, json.dumps({"rank": self.rank, "records": self.records()}, indent=1))
        return path
