"""Pipeline-parallel schedules as data: builders, a checker, a simulator and bubble/memory measures.

A schedule is ``list[list[Action]]``: for each pipeline rank, the ordered actions it runs. One engine
executes any schedule and one function draws it, so the schedules themselves stay plain data that can
be checked (every action once, only owned stages, no deadlock) before a single process starts.

Stages are GLOBAL virtual stages ``0 .. pp*v - 1``; stage ``s`` runs on rank ``s % pp`` (Megatron's
interleaving: rank ``r`` holds model chunks ``c = 0 .. v-1``, i.e. stages ``c*pp + r``).

Execution model (shared by the checker and the simulator): each rank runs its list in order;
``F(mb, s)`` needs ``F(mb, s-1)``; ``B(mb, s)`` needs ``F(mb, s)`` and ``B(mb, s+1)`` (``B`` of the last
stage needs only its forward). Sends are asynchronous and buffered, so only these data dependencies
can block a rank.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ...errors import ConfigError

SCHEDULES = ("afab", "1f1b", "interleaved")

Timeline = list[list[tuple["Action", float, float]]]


class ScheduleError(ConfigError):
    """A pipeline schedule, or the parameters asked of one, is invalid; the message says the fix."""


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work: forward ("F") or backward ("B") of one micro-batch on one stage."""

    kind: str
    """"F" (forward) or "B" (backward)."""
    microbatch: int
    """Micro-batch index, 0 .. m-1."""
    stage: int
    """Global virtual stage, 0 .. pp*v-1; it runs on rank ``stage % pp``."""

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.microbatch}, stage={self.stage})"


# ---------------------------------------------------------------------------------------- validation

def _validate(name: str, pp: int, microbatches: int, virtual: int) -> None:
    """Raise ScheduleError naming the bad parameter and the fix."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    for field, value in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ScheduleError(f"{field} must be an integer, got {value!r}")
    if pp < 1:
        raise ScheduleError(f"pp (pipeline stages) must be >= 1, got {pp}")
    if microbatches < 1:
        raise ScheduleError(f"microbatches must be >= 1, got {microbatches}")
    if virtual < 1:
        raise ScheduleError(f"virtual (model chunks per rank) must be >= 1, got {virtual}")
    if name in ("afab", "1f1b") and virtual != 1:
        raise ScheduleError(f"the {name} schedule has one model chunk per rank (virtual=1), got virtual={virtual}; "
                            f"use virtual=1 or the interleaved schedule")
    if name == "1f1b" and microbatches < pp:
        raise ScheduleError(f"fewer micro-batches (m={microbatches}) than pipeline stages (pp={pp}) for 1F1B; "
                            f"use at least pp micro-batches (parallel.microbatches >= {pp}) or the afab schedule")
    if name == "interleaved" and microbatches % pp != 0:
        raise ScheduleError(f"the interleaved schedule needs microbatches divisible by pp (Megatron requires it), "
                            f"got m={microbatches}, pp={pp}; use a multiple of {pp}, e.g. "
                            f"{(microbatches // pp + 1) * pp}")


# ----------------------------------------------------------------------------------------- builders

def _afab(pp: int, m: int) -> list[list[Action]]:
    """GPipe: every forward, then every backward (same micro-batch order, so the drain pipelines)."""
    return [[Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)] for r in range(pp)]


def _one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    """PipeDream-flush: pp-1-r warmup forwards, then alternate F/B, then drain the backwards."""
    out = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        acts = [Action("F", i, r) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action("F", warmup + i, r), Action("B", i, r)]
        acts += [Action("B", i, r) for i in range(m - warmup, m)]
        out.append(acts)
    return out


def _interleaved_action(kind: str, k: int, rank: int, pp: int, v: int) -> Action:
    """The k-th forward (or backward) of ``rank`` in Megatron's order.

    Micro-batches go through the chunks in groups of pp: chunk 0 takes micro-batches 0..pp-1, then
    chunk 1 takes the same group, ...; backwards visit the chunks in reverse order.
    """
    in_group = k % (pp * v)
    chunk = in_group // pp
    if kind == "B":
        chunk = v - 1 - chunk
    mb = (k // (pp * v)) * pp + k % pp
    return Action(kind, mb, chunk * pp + rank)


def _interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    """Megatron interleaved 1F1B: v chunks per rank, a longer warmup, then 1F1B over all m*v units."""
    if v == 1:
        return _one_f_one_b(pp, m)  # one chunk per rank: interleaving degenerates to plain 1F1B
    total = m * v
    out = []
    for r in range(pp):
        # Megatron's warmup: enough forwards that every chunk has work queued when backwards start.
        warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        acts = [_interleaved_action("F", k, r, pp, v) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [_interleaved_action("F", warmup + k, r, pp, v), _interleaved_action("B", k, r, pp, v)]
        acts += [_interleaved_action("B", k, r, pp, v) for k in range(total - warmup, total)]
        out.append(acts)
    return out


def build_schedule(name: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """For each pp rank, its ordered list of actions.

    ``afab`` is GPipe (all forwards, then all backwards: m activations live per rank); ``1f1b`` is
    PipeDream-flush (at most pp live on rank 0); ``interleaved`` is Megatron's interleaved 1F1B with
    ``virtual`` model chunks per rank (smaller bubble, needs ``microbatches % pp == 0``).
    """
    _validate(name, pp, microbatches, virtual)
    if name == "afab":
        return _afab(pp, microbatches)
    if name == "1f1b":
        return _one_f_one_b(pp, microbatches)
    return _interleaved(pp, microbatches, virtual)


# ------------------------------------------------------------------------------ execution (shared)

def _deps(a: Action, last_stage: int) -> tuple[Action, ...]:
    """The actions that must finish before ``a`` may start."""
    if a.kind == "F":
        return (Action("F", a.microbatch, a.stage - 1),) if a.stage > 0 else ()
    own_forward = Action("F", a.microbatch, a.stage)
    if a.stage < last_stage:
        return own_forward, Action("B", a.microbatch, a.stage + 1)
    return (own_forward,)


def _execute(schedule: list[list[Action]], last_stage: int, f_time: float, b_time: float) -> Timeline:
    """Run every rank's list in order as early as dependencies allow; raise ScheduleError on deadlock.

    Start times depend only on the dependency graph, not on the order ranks are visited, so a simple
    sweep over the ranks until none progresses gives the as-soon-as-possible timeline. Finish times
    live in a flat list indexed by (stage, micro-batch, kind), not a dict of Actions: the planner's
    search simulates schedules of tens of thousands of actions, and hashing them dominated its time.
    """
    flat = [a for acts in schedule for a in acts]
    bad = [a for a in flat if a.microbatch < 0 or not 0 <= a.stage <= last_stage or a.kind not in ("F", "B")]
    if bad:
        raise ScheduleError(f"cannot simulate {bad[0]}: an action needs kind 'F' or 'B', a micro-batch >= 0 and a "
                            f"stage in 0..{last_stage}")
    m = 1 + max((a.microbatch for a in flat), default=0)
    done = [-1.0] * (2 * m * (last_stage + 1))  # [(stage * m + mb) * 2 + (kind == "B")]: end time, -1 not yet
    coded = [[((a.stage * m + a.microbatch) * 2, a.kind == "B", a.stage) for a in acts] for acts in schedule]
    timeline: Timeline = [[] for _ in schedule]
    free = [0.0] * len(schedule)
    pos = [0] * len(schedule)
    remaining = len(flat)
    up = 2 * m  # index distance from a stage to the next one
    while remaining:
        progressed = False
        for r, acts in enumerate(coded):
            p, t, n = pos[r], free[r], len(acts)
            while p < n:
                i, backward, stage = acts[p]
                if backward:
                    ready = done[i]  # its own forward
                    if ready < 0:
                        break
                    if stage < last_stage:
                        later = done[i + up + 1]  # the next stage's backward
                        if later < 0:
                            break
                        ready = max(ready, later)
                    start = max(t, ready)
                    t = done[i + 1] = start + b_time
                else:
                    start = t
                    if stage > 0:
                        ready = done[i - up]  # the previous stage's forward
                        if ready < 0:
                            break
                        start = max(t, ready)
                    t = done[i] = start + f_time
                timeline[r].append((schedule[r][p], start, t))
                p += 1
            if p != pos[r]:
                remaining -= p - pos[r]
                pos[r], free[r] = p, t
                progressed = True
        if not progressed:
            finished = {a: end for acts in timeline for a, _, end in acts}
            raise _deadlock(schedule, pos, finished, last_stage)
    return timeline


def _deadlock(schedule: list[list[Action]], pos: list[int], finished: dict[Action, float],
              last_stage: int) -> ScheduleError:
    """The error for a stuck schedule: each blocked rank, its next action and what that waits on."""
    scheduled = {a for acts in schedule for a in acts}
    lines = []
    for r, acts in enumerate(schedule):
        if pos[r] >= len(acts):
            continue
        a = acts[pos[r]]
        waits = []
        for d in _deps(a, last_stage):
            if d not in finished:
                waits.append(f"{d}" + ("" if d in scheduled else " (which no rank schedules)"))
        lines.append(f"rank {r} blocked at action #{pos[r]} {a}, waiting for {' and '.join(waits)}")
    ranks = ", ".join(str(r) for r, acts in enumerate(schedule) if pos[r] < len(acts))
    return ScheduleError(f"pipeline schedule deadlocks: no rank can progress (blocked ranks: {ranks}):\n  "
                         + "\n  ".join(lines)
                         + "\nreorder the blocked ranks' lists so each action comes after the work it needs")


# ------------------------------------------------------------------------------------------ checker

def check_schedule(schedule: list[list[Action]], pp: int, microbatches: int, virtual: int = 1) -> None:
    """Raise ScheduleError unless ``schedule`` is runnable for (pp, microbatches, virtual).

    Checks: one list per rank; each action is a known kind, in range, on a stage its rank owns
    (``stage % pp == rank``); every (F|B, mb, stage) appears exactly once; and executing it
    (see the module docstring) terminates, i.e. is deadlock-free.
    """
    for field, value in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{field} must be an integer >= 1, got {value!r}")
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists but pp={pp}; give one list per pipeline rank")
    n_stages = pp * virtual
    for r, acts in enumerate(schedule):
        for i, a in enumerate(acts):
            if a.kind not in ("F", "B"):
                raise ScheduleError(f"rank {r} action #{i} has kind {a.kind!r}; use 'F' or 'B'")
            if not 0 <= a.microbatch < microbatches:
                raise ScheduleError(f"rank {r} action #{i} {a}: micro-batch out of range 0..{microbatches - 1}")
            if not 0 <= a.stage < n_stages:
                raise ScheduleError(f"rank {r} action #{i} {a}: stage out of range 0..{n_stages - 1} "
                                    f"(pp={pp} x virtual={virtual})")
            if a.stage % pp != r:
                raise ScheduleError(f"rank {r} action #{i} {a}: stage {a.stage} belongs to rank "
                                    f"{a.stage % pp} (stage % pp), not rank {r}; move it to that rank's list")
    counts = Counter(a for acts in schedule for a in acts)
    dups = sorted((a for a, n in counts.items() if n > 1), key=_order)
    if dups:
        raise ScheduleError(f"schedule repeats {len(dups)} action(s), e.g. {', '.join(map(str, dups[:4]))}; "
                            f"each (F|B, micro-batch, stage) must appear exactly once")
    expected = {Action(k, mb, s) for k in "FB" for mb in range(microbatches) for s in range(n_stages)}
    missing = sorted(expected - counts.keys(), key=_order)
    if missing:
        raise ScheduleError(f"schedule lacks {len(missing)} action(s), e.g. {', '.join(map(str, missing[:4]))}; "
                            f"add each to rank (stage % pp)'s list")
    _execute(schedule, n_stages - 1, 1.0, 2.0)


def _order(a: Action) -> tuple[int, int, str]:
    """Sort key that lists errors by stage, micro-batch, kind."""
    return a.stage, a.microbatch, a.kind


# -------------------------------------------------------------------------------- simulate, measure

def simulate(schedule: list[list[Action]], f_time: float = 1.0, b_time: float = 2.0) -> Timeline:
    """Per rank, ``(action, start, end)``: every action costs ``f_time`` (F) or ``b_time`` (B) and starts
    as soon as its rank is free and its dependencies are done (communication is free).

    The last stage is the largest stage in the schedule. For interleaved schedules a chunk holds 1/v
    of the layers; pass ``f_time/v, b_time/v`` for absolute times (fractions do not change).
    Raises ScheduleError if the schedule deadlocks.
    """
    stages = [a.stage for acts in schedule for a in acts]
    if not stages:
        return [[] for _ in schedule]
    return _execute(schedule, max(stages), f_time, b_time)


def bubble_fraction(timeline: Timeline) -> float:
    """Idle fraction of the pipeline: ``1 - busy / (pp * makespan)``.

    ``busy`` is the summed duration of all actions over all ranks, ``pp = len(timeline)`` (ranks with
    no action count as idle) and ``makespan = max end - min start``. 0.0 for an empty timeline.
    """
    spans = [(s, e) for acts in timeline for _, s, e in acts]
    if not spans:
        return 0.0
    makespan = max(e for _, e in spans) - min(s for s, _ in spans)
    if makespan <= 0:
        return 0.0
    busy = sum(e - s for s, e in spans)
    return 1.0 - busy / (len(timeline) * makespan)


def theoretical_bubble(name: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The textbook bubble as a fraction of total time, comparable with :func:`bubble_fraction`.

    afab / 1f1b: ``(p-1) / (m + p-1)``: the pipeline takes (m+p-1) slots of (F+B) of which each rank is
    busy m. interleaved: ``(p-1) / (v*m + p-1)``: the fill/drain still lasts p-1 slots but each slot is
    1/v as long (Megatron's bubble ratio (p-1)/(v*m) of ideal time, turned into a fraction of total).
    """
    _validate(name, pp, microbatches, virtual)
    v = virtual if name == "interleaved" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def peak_in_flight(schedule_for_one_rank: list[Action]) -> int:
    """Most activations held at once by one rank: forwards run whose backward has not yet run.

    Counted per (micro-batch, stage), so with interleaving each chunk's activations count separately
    (each is 1/v of a full stage). 1F1B on rank 0 gives pp; AFAB gives m.
    """
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in schedule_for_one_rank:
        if a.kind == "F":
            live.add((a.microbatch, a.stage))
            peak = max(peak, len(live))
        else:
            live.discard((a.microbatch, a.stage))
    return peak
