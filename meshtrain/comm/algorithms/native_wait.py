"""Whether a rank looks at torch's CPU op before it parks in torch's wait, learned per op size from
its own calls (``native.polled`` looks; parking is torch's blocking wait).

Looking (``is_completed`` between ``sched_yield``s) saves a wake-up where parking is slow: on the
2-core test VM a parked caller's core idles into a slow wake-up, and 1 MB all-reduces over 2 ranks
ran 1.25x torch's blocking call looked at and 0.89x parked. Where the looks take cores from the
threads gloo runs the op on, they slow it instead: on a 16-core host (8 cores, 4 ranks) the same
all-reduce took 1.90 ms looked at and 1.24 ms parked, torch's own 1.02 (docs/benchmarks.md, session
30). Neither holds everywhere, so each process measures both on its own calls, per power-of-two size
class:

* **explore**: ``ROUNDS`` passes of ``BLOCK`` calls looking, then ``BLOCK`` parking; the first call
  of each block is not counted (it carries the previous mode's skew between the ranks). Every member
  makes the same calls of a size in the same order, so the members switch on the same calls.
* **keep** looking unless parking is faster by more than ``PRIOR`` in mean time per call (what a
  loop pays) in *every* round: where parking helps, it wins each round by far (1.2-2.1x on the
  16-core host), while on a noisy 2-core VM a round's mean swings 2x and one lucky round must not
  settle it (4 KB all-gathers over 2 ranks: parked 0.72x torch's own op, looked at 1.06x, and a
  process that had learned to park off one comparison of the means; docs/benchmarks.md, session 31).
  Two rounds still kept parking on 4 KB all-gathers there in 5-13 % of explorations (a spell of the
  scheduler outlasts a round), four in 0-2 % (session 35);
* **explore again** after ``RECHECK`` calls of the class (a host whose load changed).

The mode is the process's own: either way the op computes the same result, so members need not
agree. ``MESHTRAIN_NATIVE_WAIT=look`` or ``park`` fixes the mode instead (``learn``: the default).
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

LOOK, PARK = True, False
BLOCK = 8  # consecutive calls of one mode while exploring; the first of each is not counted
ROUNDS = 4  # passes over the two modes (each must favour parking for it to be kept)
PRIOR = 0.05  # parking is kept only if faster than looking by more than this
RECHECK = 4096  # calls of a size class between explorations
MODES = ("learn", "look", "park")
clock = time.perf_counter


class Call(NamedTuple):
    """One call's wait mode, and where its time goes (``record``)."""

    bits: int  # the size class: nbytes.bit_length()
    look: bool
    counted: bool  # an exploring call that is timed
    started: float


class _Class:
    """One size class's state in this process."""

    __slots__ = ("calls", "times", "look", "kept_at")

    def __init__(self) -> None:
        self.calls = 0
        self.times: dict[bool, list[float]] = {LOOK: [], PARK: []}
        self.look: bool | None = None  # None while exploring
        self.kept_at = 0


_classes: dict[int, _Class] = {}


def mode() -> str:
    """The setting: ``MESHTRAIN_NATIVE_WAIT`` (learn, look or park); a clear error for anything else."""
    value = os.environ.get("MESHTRAIN_NATIVE_WAIT", "learn").strip().lower() or "learn"
    if value not in MODES:
        raise ValueError(f"MESHTRAIN_NATIVE_WAIT={value!r} is not a mode: use learn (measure both on the "
                         "calls, the default), look (poll torch's op before its wait) or park (torch's wait)")
    return value


_MODE = ["learn"]  # read at comm.init (``reset``): the call path must not parse the environment
_UNTIMED = {LOOK: Call(0, LOOK, False, 0.0), PARK: Call(0, PARK, False, 0.0)}  # a kept or fixed mode's calls


def begin(nbytes: int) -> Call:
    """The wait mode of the call about to be issued on ``nbytes`` (the class's kept mode, or its
    exploring schedule's)."""
    fixed = _MODE[0]
    if fixed != "learn":
        return _UNTIMED[fixed == "look"]
    bits = nbytes.bit_length()
    c = _classes.get(bits)
    if c is None:
        c = _classes[bits] = _Class()
    c.calls += 1
    if c.look is not None:
        if c.calls - c.kept_at <= RECHECK:
            return _UNTIMED[c.look]
        c.look, c.times = None, {LOOK: [], PARK: []}  # explore again from this call
        c.calls = 1
    n = c.calls - 1
    if n < ROUNDS * 2 * BLOCK:
        return Call(bits, n // BLOCK % 2 == 0, n % BLOCK != 0, clock())
    c.look = not _parking_wins(c.times[LOOK], c.times[PARK])
    c.kept_at = c.calls
    return _UNTIMED[c.look]


def record(call: Call) -> None:
    """The call's wait ended: an exploring call's time counts for its mode."""
    if call.counted:
        c = _classes.get(call.bits)
        if c is not None and c.look is None:
            c.times[call.look].append(clock() - call.started)


def kept(nbytes: int) -> bool | None:
    """The mode kept for ``nbytes`` (True: look, False: park), or None while exploring or fixed."""
    c = _classes.get(nbytes.bit_length())
    return None if c is None else c.look


def set_mode(setting: str) -> None:
    """Fix the mode (look, park) or learn again, keeping what was learned (benchmarks)."""
    if setting not in MODES:
        raise ValueError(f"wait mode {setting!r}: use one of {MODES}")
    _MODE[0] = setting


def reset(setting: str | None = None) -> None:
    """Forget what was learned (tests, and a process that re-initialises), re-reading the setting
    (or using ``setting``)."""
    _classes.clear()
    set_mode(setting if setting is not None else mode())


def _parking_wins(looked: list[float], parked: list[float]) -> bool:
    """True if, in every exploring round, the parked calls' mean beats the looked-at calls' by more than
    ``PRIOR`` (each mode's counted calls, in order: ``BLOCK - 1`` a round)."""
    per = BLOCK - 1
    rounds = [(looked[r * per:(r + 1) * per], parked[r * per:(r + 1) * per]) for r in range(ROUNDS)]
    # (a round an overlapping async call has not recorded yet is judged on the calls it has; one with
    # none of a mode is no evidence for parking)
    return all(lk and pk and _mean(pk) * (1 + PRIOR) < _mean(lk) for lk, pk in rounds)


def _mean(ts: list[float]) -> float:
    return sum(ts) / len(ts)
