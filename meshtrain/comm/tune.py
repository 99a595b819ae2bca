"""Online selection for ``algorithm="auto"``: measure the candidates on the calls themselves, agree
across the group on the fastest, keep it, and look again when its time drifts.

The static choice (``select.choose``: measured rules and the alpha-beta-gamma model) is a guess
from a ping-pong and a formula; this learns from the program's own calls. Per (group, op, dtype,
power-of-two size bucket, preferred algorithm) a *slot*:

* **warm**: where torch's own is a candidate and the calls are below ``WARM_MAX_BYTES``, the slot's
  first ``WARM`` calls run it untimed, so that it is timed as it runs once kept: with its wait mode
  for the size learned (``algorithms/native_wait.py`` explores looking and parking on its first 64
  calls of a size, and a parked small op costs a third more on the 2-core VM) and gloo's first calls
  of the size behind it. Timed while still learning, torch's own read 2-3x its back-to-back time on
  64 KB calls and lost to algorithms that then ran at 0.40-0.68 of it (docs/benchmarks.md, session 32).
* **explore**: the next ``ROUNDS`` x k x ``BLOCK`` calls (``ROUNDS_SMALL`` passes below
  ``SMALL`` bytes) run its k candidates in turn, ``BLOCK`` calls each (the static choice first,
  torch's own collective wherever it is offered, then the model's next best). Every member counts
  the same calls on the group in the same order, so every member runs the same candidate on the
  same call with no message. Each call is timed where it runs (``runner``); the first call of each
  block is not counted (it carries the previous algorithm's skew between the ranks).
* **decide**: on the next call every member posts its time per candidate (``typical``: the mean of
  its timed calls but the slowest, what a loop of such calls pays) through the transport's
  ``exchange`` (the store, or a shared dict) and all take the candidate with the least mean over the
  members -- the same answer everywhere, from the same numbers -- unless the static choice, or else
  torch's own, is within ``PRIOR`` of it, which then stays: a win inside the noise does not
  overturn the measured rules, nor the peer auto must not lose to. So the choice is never measured
  more than ``PRIOR`` slower than torch's own where that was a candidate. A candidate that beat
  the **peer** (torch's own where it is a candidate, else the static choice: the shm collective on
  one host's shared memory) is first **verified**: the slot explores again between the two only,
  in ``VERIFY_ROUNDS`` passes of ``VERIFY_BLOCK`` calls each (the first ``VERIFY_SKIP`` of a block
  not counted; the peer first, so within ``PRIOR`` it stays), and keeps the winner of that
  pass. A candidate some member has no time for (an async call still in flight) is left out.
  Group rank 0 writes the choice to the calibration cache (``select.cache_path``), keyed by
  transport, group shape and host fingerprint; the next run's first call loads group rank 0's
  table (one exchange per group) and keeps those choices without exploring.
* **keep**: the choice runs; ``CHECK_FIRST`` calls after a measured choice over the peer, then
  after twice as many calls each time it holds, up to every ``CHECK_EVERY`` calls (every
  ``CHECK_EVERY`` for any other choice), the members time the last ``RECENT`` of them and
  exchange their ``typical`` time. Such a choice on probation **races** the peer first:
  ``VERIFY_SKIP`` + ``RECENT`` calls of the peer, back to back, the last ``RECENT`` timed, so both
  are measured in the same spell of the host. If the choice's mean is slower than the peer just
  ran (or, without those times, than it was measured), by more than ``PRIOR``, the slot **falls
  back**: the peer is kept and the choice leaves the slot's candidates (it lost back to back).
  Otherwise, if the mean exceeds both the agreed time by more than ``DRIFT`` and the next best
  candidate's agreed time, at two checks in a row (the second ``CHECK_FIRST`` calls after the
  first, so a spell of the host does not count: a link that slowed, a cached choice from a quieter
  machine, or a choice whose exploring calls ran faster than it runs back to back), the slot
  explores again. A choice running faster than agreed only lowers its agreed time: its exploring
  blocks, each after another algorithm's calls, read slower than its calls back to back, and the
  others were measured slower still.

Every candidate computes the collective correctly, so exploring calls return correct results;
with more than two members their sums may differ in the last bits (another order of addition).
Off on ranks as threads (their timings measure the GIL, and the seed's operators drive every rank
from one thread, where an exchange would block it) and on NCCL (torch's own is taken there);
``MESHTRAIN_AUTO_TUNE=0/1`` or ``Communicator.tune`` overrides.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from typing import Any

from .algorithms import native_wait
from .transport.base import PeerTimeout, capabilities

ROUNDS = 2  # passes over the candidates while exploring
BLOCK = 4  # consecutive calls of one candidate in a pass; the first of each is not counted
ROUNDS_SMALL = 3  # below SMALL bytes: such calls are cheap and their times noisy (scheduler, wake-ups)
SMALL = 1 << 20
PRIOR = 0.05  # the static choice is kept unless another candidate is faster by more than this
VERIFY_ROUNDS = 2  # a win over torch's own is verified in passes of longer blocks (``_decide``) ...
VERIFY_BLOCK = 16
VERIFY_SKIP = 4  # ... whose first calls are not counted: after another algorithm's calls torch's own
# ran slower for several calls here (1 MB all-reduce, 2 ranks: 1.1-2.1 ms within blocks of 4 against
# 0.8-1.2 ms back to back), which blocks of 4 took for the candidates' difference
CHECK_EVERY = 1024  # calls of a kept choice between drift checks
CHECK_FIRST = 64  # ... but the first check comes this soon after a measured choice
RECENT = 16  # calls timed before each drift check
DRIFT = 1.5  # a recent/agreed time ratio above this (and above the next best) explores again
MAX_CANDIDATES = 4
WARM = native_wait.ROUNDS * 2 * native_wait.BLOCK  # torch's own, untimed, before a slot's first exploration
WARM_MAX_BYTES = 4 << 20  # where its wait mode matters (``native.polled`` looks longest below it)
TUNED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def enabled(group: Any) -> bool:
    """True if ``auto`` learns on ``group`` (module docstring): more than one member, and the
    communicator's ``tune`` setting, else ``MESHTRAIN_AUTO_TUNE``, else on for process transports
    other than NCCL."""
    if group.size < 2:
        return False
    setting = group.comm.tune
    if setting is None:
        env = os.environ.get("MESHTRAIN_AUTO_TUNE")
        if env is not None:
            value = env.strip().lower()
            if value not in ("0", "1", "true", "false", "on", "off"):
                raise ValueError(f"MESHTRAIN_AUTO_TUNE={env!r} is not a setting: use 1 (auto learns from its "
                                 "calls) or 0 (auto keeps its static choice), or unset it")
            return value in ("1", "true", "on")
        t = group.comm.transport
        return not capabilities(t).ranks_are_threads and "nccl" not in str(getattr(t, "backend", ""))
    return bool(setting)


def host_fingerprint() -> str:
    """What a cached choice is valid for besides the group's shape: the host's name and id (a
    simulated host's ``MESHTRAIN_HOST_ID``), its cores and torch's version."""
    import torch

    host = os.environ.get("MESHTRAIN_HOST_ID", "")
    return f"{platform.node()}{'/' + host if host else ''}/{os.cpu_count()}cpu/torch{torch.__version__}"


class Slot:
    """One (op, dtype, size bucket)'s state on one member; see the module docstring."""

    __slots__ = ("candidates", "calls", "times", "choice", "agreed", "source", "kept_at", "recent", "probes",
                 "period", "all_candidates", "warm", "race", "slowed", "peer")

    def __init__(self, candidates: list[str], warm: int = 0) -> None:
        self.candidates = candidates
        # what auto must not lose to: torch's own where it is a candidate, else the static choice
        self.peer = "native" if "native" in candidates else candidates[0]
        self.warm = warm  # untimed calls of torch's own before the first exploration (module docstring)
        self.calls = 0
        self.times: dict[str, list[float]] = {c: [] for c in candidates}
        self.choice: str | None = candidates[0] if len(candidates) == 1 else None
        self.agreed: dict[str, float] = {}  # mean over members of each candidate's median (s)
        self.source = "only candidate" if self.choice else "exploring"
        self.kept_at = 0
        self.recent: list[float] = []
        self.race: list[float] = []  # the peer timed beside a choice on probation (``on_probation``)
        self.probes = 0  # times explored (re-probes after drift count)
        self.period = CHECK_EVERY  # calls from ``kept_at`` to the next drift check
        self.all_candidates: list[str] | None = None  # set while a win over the peer is verified
        self.slowed = False  # the last drift check found it slower than DRIFT allows (confirmed next)

    def keep(self, choice: str, agreed: dict[str, float], source: str) -> None:
        """Keep ``choice`` from the call after this one on (checked soon if just measured against
        the peer and chosen over it: exploring calls of meshtrain's algorithms can run faster
        than the same calls back to back)."""
        self.choice, self.agreed, self.source = choice, agreed, source
        self.kept_at, self.recent, self.race, self.slowed = self.calls, [], [], False
        self.period = CHECK_FIRST if self.on_probation() else CHECK_EVERY

    def on_probation(self) -> bool:
        """True while the kept choice is a measured win over the peer (torch's own, else the static
        choice): each of its checks races it against the peer, back to back (``Tuner.pick``)."""
        return self.source == "measured" and self.choice != self.peer and self.peer in self.agreed

    def explore(self) -> None:
        """Start exploring again (after a drift)."""
        self.verified()
        self._restart()

    def verified(self) -> None:
        """End a verification (``verify``): the full candidate list again (explain, drift)."""
        if self.all_candidates is not None:
            self.candidates, self.all_candidates = self.all_candidates, None

    def verify(self, winner: str) -> None:
        """Explore again between the peer and ``winner`` only (see ``Tuner._decide``)."""
        self.all_candidates, self.candidates = self.candidates, [self.peer, winner]
        self._restart()

    def _restart(self) -> None:
        self.choice, self.calls, self.kept_at, self.recent, self.race, self.slowed = None, 0, 0, [], [], False
        self.times = {c: [] for c in self.candidates}


class Tuner:
    """A group's slots, its loaded cache table and the exchange counter; made by ``of``."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.slots: dict[tuple, Slot] = {}
        self.cached: dict[str, Any] | None = None
        self.seq = 0
        self._pending = threading.local()  # the slot and algorithm of this thread's call being made

    # -- the call path -------------------------------------------------------------------------
    def pick(self, op: str, nbytes: int, dtype: Any, candidates: Any) -> str:
        """The algorithm for this call; ``candidates()`` lists them (the static choice first) the
        first time a slot is met, so a kept choice costs no static choice. Collective in effect: every
        member makes the same calls."""
        key = (op, dtype, nbytes.bit_length(), self.group.comm.preferred_algorithm)
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = self._new_slot(key, candidates, nbytes)
        slot.calls += 1
        if slot.choice is None:
            k = len(slot.candidates)
            n = slot.calls - 1
            verifying = slot.all_candidates is not None
            if not verifying and not slot.probes:  # the first exploration: torch's own warms up first
                if n < slot.warm:
                    return "native"  # untimed (no pending entry for ``take``)
                n -= slot.warm
            block, skip = (VERIFY_BLOCK, VERIFY_SKIP) if verifying else (BLOCK, 1)
            rounds = VERIFY_ROUNDS if verifying else ROUNDS_SMALL if nbytes < SMALL else ROUNDS
            if n < rounds * k * block:
                algo = slot.candidates[n // block % k]
                # A block's first call absorbs the switch: the ranks leave the previous algorithm
                # at different times, and the first to leave waits for the others in this call.
                self._pending.v = (slot, algo, n % block >= skip)
                return algo
            self._decide(key, slot)
            if slot.choice is None:  # a win over the peer is being verified: its first call
                return self.pick(op, nbytes, dtype, candidates)
        elif slot.calls - slot.kept_at > slot.period:
            n = slot.calls - slot.kept_at - slot.period - 1
            if slot.on_probation() and n < VERIFY_SKIP + RECENT:  # the race: the peer, back to back
                self._pending.v = (slot, slot.peer, n >= VERIFY_SKIP)
                return slot.peer
            self._check_drift(key, slot)
            if slot.choice is None:  # drifted: explore again from this call
                return self.pick(op, nbytes, dtype, candidates)
        elif slot.calls - slot.kept_at > slot.period - RECENT and slot.source != "only candidate":
            self._pending.v = (slot, slot.choice, True)
        return slot.choice

    def take(self) -> tuple[Slot, str, bool] | None:
        """The slot the call just picked for, if it is to be timed (``runner.run`` asks, once)."""
        v = getattr(self._pending, "v", None)
        if v is not None:
            self._pending.v = None
        return v

    @staticmethod
    def record(pending: tuple[Slot, str, bool], algorithm: str, seconds: float) -> None:
        """Add one timed call of ``algorithm`` to its slot."""
        slot, algo, counted = pending
        if not counted or algo != algorithm:
            return
        if slot.choice is None:
            slot.times[algo].append(seconds)
        elif algo == slot.choice:
            slot.recent.append(seconds)
        elif algo == slot.peer:
            slot.race.append(seconds)

    # -- agreement -----------------------------------------------------------------------------
    def _exchange(self, what: str, payload: Any) -> list[Any]:
        g = self.group
        self.seq += 1
        try:
            posts = g.comm.transport.exchange(f"tune/{g.gid}/{self.seq}", g.ranks, json.dumps(payload), g.timeout)
        except PeerTimeout as exc:
            from ..errors import CollectiveTimeout

            err = CollectiveTimeout(
                f"algorithm='auto' on group {g.gid} (ranks {g.ranks}): {what} meets every member on the same "
                f"call, and rank(s) {exc.missing} did not arrive within {g.timeout:g}s. Every member must make "
                "the same collective calls on the group in the same order (or set MESHTRAIN_AUTO_TUNE=0).")
            err.missing = exc.missing  # type: ignore[attr-defined]
            raise err from None
        return [json.loads(p) for p in posts]

    def _new_slot(self, key: tuple, candidates: Any, nbytes: int) -> Slot:
        cands = candidates()
        slot = Slot(cands, WARM if "native" in cands and nbytes < WARM_MAX_BYTES else 0)
        if slot.choice is None:
            if self.cached is None:  # first slot of the group: group rank 0's cached table for all
                mine = _load_table(_table_key(self.group))
                posts = self._exchange("loading the cached choices", mine if self.group.rank == 0 else None)
                self.cached = posts[0] or {}
            entry = self.cached.get(_slot_name(key))
            if entry and entry.get("algorithm") in slot.candidates:
                slot.keep(entry["algorithm"], dict(entry.get("agreed", {})), "cache")
        return slot

    def _decide(self, key: tuple, slot: Slot) -> None:
        mine = {c: (typical(ts) if ts else None) for c, ts in slot.times.items()}
        posts = self._exchange(f"choosing {key[0]}'s algorithm", mine)
        agreed = {}
        for c in slot.candidates:
            vals = [p.get(c) for p in posts]
            if all(v is not None for v in vals):
                agreed[c] = sum(vals) / len(vals)
        choice = min(agreed, key=lambda c: (agreed[c], slot.candidates.index(c))) if agreed else slot.candidates[0]
        for keeper in (slot.candidates[0], "native"):  # the static choice, then torch's own
            if keeper in agreed and agreed[keeper] <= agreed[choice] * (1 + PRIOR):
                choice = keeper  # a win inside the noise does not overturn it
                break
        if choice != slot.peer and slot.peer in agreed and slot.all_candidates is None:
            # A win over the peer (torch's own, else the static choice) is measured twice before it
            # is kept: on a crowded host a candidate's exploring calls can draw a fast spell
            # (docs/benchmarks.md, session 23; on shm, recursive doubling kept over the shm
            # collective at 4 KB, session 36), and a second, separate pass of the two (the peer
            # first, so within PRIOR it stays) has to agree.
            slot.verify(choice)
            return
        slot.verified()
        slot.probes += 1
        slot.keep(choice, agreed, "measured")
        self._save(key, slot)

    def _save(self, key: tuple, slot: Slot) -> None:
        """Group rank 0 writes the slot's kept choice and agreed times to the calibration cache."""
        if self.group.rank == 0:
            _save_entry(_table_key(self.group), _slot_name(key), {"algorithm": slot.choice, "agreed": slot.agreed})

    def _check_drift(self, key: tuple, slot: Slot) -> None:
        mine = typical(slot.recent) if slot.recent else None
        # A measured choice over the peer stays on probation: each check races it against the peer
        # (the calls just before, ``pick``), and it is checked again after twice as many calls
        # each time it holds, up to CHECK_EVERY (see ``_fall_back``).
        probation = slot.on_probation()
        if probation:
            posts = self._exchange(f"checking {key[0]}'s time", [mine, typical(slot.race) if slot.race else None])
            raced = [p[1] for p in posts]
            posts = [p[0] for p in posts]
        else:
            posts = self._exchange(f"checking {key[0]}'s time", mine)
        slot.kept_at, slot.recent, slot.race = slot.calls, [], []
        slot.period = min(2 * slot.period, CHECK_EVERY) if probation else CHECK_EVERY
        base = slot.agreed.get(slot.choice or "")
        if base is None or any(p is None for p in posts):
            if base is None and all(p is not None for p in posts):  # a cached choice without times
                slot.agreed[slot.choice or ""] = sum(posts) / len(posts)
            return
        recent = sum(posts) / len(posts)
        if probation:  # the peer as it ran just now, or else as it was measured
            peer = sum(raced) / len(raced) if all(r is not None for r in raced) else slot.agreed[slot.peer]
            if recent > peer * (1 + PRIOR):
                self._fall_back(key, slot, recent, peer)
                return
        # the next best candidate's measured time (0: none measured, as in a cached entry without times)
        runner_up = min((t for c, t in slot.agreed.items() if c != slot.choice and c in slot.candidates), default=0.0)
        if recent <= base * DRIFT or recent <= runner_up:  # no slowdown that another could have beaten
            slot.slowed = False
            if recent < base:
                # Faster than agreed: the choice's time is lowered, nothing explores. The others
                # were measured slower than its old time, and a choice's exploring blocks (each
                # after another algorithm's calls) ran 2-4x its time back to back: the shm
                # collective at 4 KB read 95-180 us while exploring, 43-50 back to back, so every
                # check explored again, ~50 calls of slower candidates each 1,024
                # (docs/benchmarks.md, session 36).
                slot.agreed[slot.choice or ""] = recent
        elif slot.slowed:  # slowed at two checks in a row: explore again
            slot.explore()
        else:
            # A spell of the host can slow one window of RECENT calls 2-5x (shm at 64 KB: 74 us
            # agreed, 145-373 us in one window, session 36), and exploring costs ~50 calls of
            # slower candidates: a slowdown is confirmed CHECK_FIRST calls later first.
            slot.slowed = True
            slot.period = min(slot.period, CHECK_FIRST)

    def _fall_back(self, key: tuple, slot: Slot, recent: float, peer: float) -> None:
        """The kept choice ran slower back to back than the peer (``peer`` seconds a call): keep the
        peer, and drop the choice from the slot's candidates. On the 2-core VM a p2p algorithm
        won its blocks against torch's own in a slow spell (64 KB reduce-scatter: ring 0.6 ms a
        call, torch's own 1.9 ms), then ran 3.9 ms a call back to back for a thousand calls (torch's
        own: 0.4-0.8 ms), and exploring again after such a drift could keep it once more
        (docs/benchmarks.md, session 35)."""
        lost = slot.choice or ""
        slot.candidates = [c for c in slot.candidates if c != lost]
        slot.keep(slot.peer, dict(slot.agreed, **{lost: recent, slot.peer: peer}), "fallback")
        self._save(key, slot)

    def explain(self) -> list[dict[str, Any]]:
        """One row per slot: op, dtype, size range, candidates' agreed times, choice, source."""
        rows = []
        for (op, dtype, bits, pref), slot in sorted(self.slots.items(), key=lambda kv: (kv[0][0], kv[0][2])):
            lo = 0 if bits == 0 else 1 << (bits - 1)
            rows.append(dict(op=op, dtype=str(dtype).replace("torch.", ""), bytes_from=lo, bytes_below=1 << bits,
                             choice=slot.choice, source=slot.source, agreed_s=dict(slot.agreed),
                             candidates=list(slot.candidates), probes=slot.probes))
        return rows


def typical(times: list[float]) -> float:
    """Seconds per call of a candidate from its timed calls: their mean without the slowest (one
    descheduled call, which any candidate may draw). Not the median: on a crowded host a collective's
    calls can alternate between fast ones and scheduler-quantum stalls, and a loop of calls pays the
    mean; a median of the fast ones chose meshtrain's p2p algorithms over gloo's own on 4 KB calls that
    then ran 3x slower back to back (docs/benchmarks.md, session 23)."""
    kept = sorted(times)[:-1] if len(times) > 2 else times
    return sum(kept) / len(kept)


def of(group: Any) -> Tuner | None:
    """The group's tuner, or None where ``auto`` does not learn on it (``enabled``)."""
    t = group.tuner
    if t is None:
        group.tuner = t = Tuner(group) if enabled(group) else False
    return t or None


def settled(group: Any) -> bool:
    """True if no slot of ``group`` is exploring (for benchmarks that time the kept choice)."""
    t = group.tuner
    return not t or all(s.choice is not None for s in t.slots.values())


def kept(group: Any, op: str, nbytes: int, dtype: Any) -> str | None:
    """The choice ``group`` keeps for ``op`` on ``nbytes`` of ``dtype``, or None if none is kept."""
    t = group.tuner
    slot = t.slots.get((op, dtype, nbytes.bit_length(), group.comm.preferred_algorithm)) if t else None
    return slot.choice if slot is not None else None


def _slot_name(key: tuple) -> str:
    op, dtype, bits, pref = key
    return f"{op}|{str(dtype).replace('torch.', '')}|{bits}|{pref or ''}"


def _table_key(group: Any) -> str:
    from .select import _cache_key

    return f"tune|{_cache_key(group)}|{host_fingerprint()}"


def _load_table(key: str) -> dict[str, Any] | None:
    from .select import _load_cached

    return _load_cached(key)


def _save_entry(key: str, name: str, entry: dict[str, Any]) -> None:
    from .select import _load_cached, _save_cached

    table = _load_cached(key) or {}
    table[name] = entry
    _save_cached(key, table)


def now() -> float:
    """The clock the runner times calls with."""
    return time.perf_counter()
