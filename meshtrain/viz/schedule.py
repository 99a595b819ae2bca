"""Gantt charts of pipeline schedules (simulated or measured) and ``meshtrain viz schedule``.

A timeline is what :func:`meshtrain.parallel.pipeline.schedule.simulate` returns: per rank, a list of
``(Action, start, end)``. The engine writes the measured one as a JSON trace::

    {"pp": 4, "microbatches": 8, "schedule": "1f1b", "virtual": 1,
     "events": [{"rank": 0, "kind": "F", "microbatch": 0, "stage": 0, "start": 0.0, "end": 0.01}, ...]}

with times in seconds; :func:`load_trace` turns it back into a timeline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

from ..errors import DataError, MeshtrainError
from ..files import atomic_path
from ..parallel.pipeline.schedule import (
    SCHEDULES,
    Action,
    ScheduleError,
    Timeline,
    bubble_fraction,
    build_schedule,
    check_schedule,
    peak_in_flight,
    simulate,
    theoretical_bubble,
)

_COLORS = {"F": "#3b75af", "B": "#e1812c"}


# --------------------------------------------------------------------------------------------- trace

@dataclass(frozen=True)
class Trace:
    """A measured pipeline run: the schedule's parameters and its per-rank timeline (seconds)."""

    pp: int
    """Pipeline ranks."""
    microbatches: int
    """Micro-batches per step."""
    schedule: str
    """Schedule name, one of SCHEDULES."""
    virtual: int
    """Model chunks per rank."""
    timeline: Timeline
    """Per rank, (action, start, end), sorted by start."""


def read_trace(path: str) -> Trace:
    """Read and validate an engine trace; DataError if unreadable, ScheduleError if inconsistent."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise DataError(f"cannot read pipeline trace {path!r}: {e.strerror or e}; pass the JSON file the engine wrote")
    except json.JSONDecodeError as e:
        raise DataError(f"pipeline trace {path!r} is not valid JSON ({e}); pass the JSON file the engine wrote")
    if not isinstance(doc, dict):
        raise ScheduleError(f"pipeline trace {path!r} must be a JSON object with pp, microbatches, schedule, "
                            f"virtual and events")
    missing = [k for k in ("pp", "microbatches", "schedule", "events") if k not in doc]
    if missing:
        raise ScheduleError(f"pipeline trace {path!r} lacks field(s) {', '.join(missing)}")
    pp, m, v = doc["pp"], doc["microbatches"], doc.get("virtual", 1)
    for field, value in (("pp", pp), ("microbatches", m), ("virtual", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"pipeline trace {path!r}: {field} must be an integer >= 1, got {value!r}")
    timeline: Timeline = [[] for _ in range(pp)]
    for i, ev in enumerate(doc["events"]):
        try:
            r, kind, mb, stage = int(ev["rank"]), str(ev["kind"]), int(ev["microbatch"]), int(ev["stage"])
            start, end = float(ev["start"]), float(ev["end"])
        except (KeyError, TypeError, ValueError) as e:
            raise ScheduleError(f"pipeline trace {path!r} event #{i} is malformed ({e!r}); each event needs "
                                f"rank, kind, microbatch, stage, start, end")
        where = f"pipeline trace {path!r} event #{i} ({kind} mb={mb} stage={stage} on rank {r})"
        if not 0 <= r < pp or stage % pp != r or not 0 <= stage < pp * v:
            raise ScheduleError(f"{where}: rank must be in 0..{pp - 1} and own the stage (stage % pp), "
                                f"stage in 0..{pp * v - 1}")
        if kind not in ("F", "B") or not 0 <= mb < m or end < start:
            raise ScheduleError(f"{where}: kind must be F or B, micro-batch in 0..{m - 1}, end >= start")
        timeline[r].append((Action(kind, mb, stage), start, end))
    for acts in timeline:
        acts.sort(key=lambda t: t[1])
    return Trace(pp, m, str(doc["schedule"]), v, timeline)


def load_trace(path: str) -> Timeline:
    """The per-rank timeline ``[(Action, start, end), ...]`` of an engine's JSON trace (see module doc)."""
    return read_trace(path).timeline


# ---------------------------------------------------------------------------------------------- draw

def _shade(hex_color: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """``hex_color`` lightened towards white for later chunks, so chunks of one rank stay apart."""
    from matplotlib.colors import to_rgb

    mix = 0.6 * chunk / max(chunks - 1, 1) if chunks > 1 else 0.0
    return tuple(c + (1.0 - c) * mix for c in to_rgb(hex_color))  # type: ignore[return-value]


def draw_timeline(timeline: Timeline, path: str, title: str = "pipeline schedule", unit: str = "time") -> float:
    """Draw a Gantt chart PNG of ``timeline`` at ``path`` and return its bubble fraction.

    One row per rank (rank 0 on top), one box per action labelled with its micro-batch; forwards blue,
    backwards orange, later model chunks lighter. The bubble fraction goes in the title. The file is
    written to a temporary name in the same folder and renamed (``files.atomic_path``), so a failure
    leaves no partial PNG.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pp = len(timeline)
    spans = [(s, e) for acts in timeline for _, s, e in acts]
    if not spans:
        raise ScheduleError("nothing to draw: the timeline has no actions")
    t0 = min(s for s, _ in spans)
    chunks = max(a.stage for acts in timeline for a, _, _ in acts) // pp + 1
    bubble = bubble_fraction(timeline)
    per_rank = max(len(acts) for acts in timeline)
    width_in = min(24.0, max(8.0, 0.3 * per_rank))
    fig, ax = plt.subplots(figsize=(width_in, 1.2 + 0.55 * pp))
    fontsize = max(5.0, min(9.0, 240.0 / per_rank))
    # label a box only where its number fits (about 0.6 em per digit, axes ~80% of the figure)
    makespan = max(e for _, e in spans) - t0
    points_per_unit = 0.8 * width_in * 72.0 / makespan if makespan > 0 else 0.0
    for r, acts in enumerate(timeline):
        # one bar collection per rank (not one artist per box) keeps long schedules quick to draw
        ax.broken_barh([(s - t0, e - s) for _, s, e in acts], (r - 0.4, 0.8), edgecolor="black", linewidth=0.4,
                       facecolors=[_shade(_COLORS[a.kind], a.stage // pp, chunks) for a, _, _ in acts])
        for a, s, e in acts:
            if (e - s) * points_per_unit >= 0.6 * fontsize * (len(str(a.microbatch)) + 0.5):
                ax.text((s + e) / 2 - t0, r, str(a.microbatch), ha="center", va="center", fontsize=fontsize)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.set_ylim(pp - 0.5, -0.5)  # rank 0 on top, as in the papers' figures
    ax.set_xlabel(unit)
    ax.set_title(f"{title}: bubble {bubble:.1%}")
    handles = [Patch(color=_shade(_COLORS[k], c, chunks), label=f"{name}" + (f" chunk {c}" if chunks > 1 else ""))
               for k, name in (("F", "forward"), ("B", "backward")) for c in range(chunks)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    try:
        with atomic_path(path) as tmp:  # mode from the umask, as every other file the project writes
            fig.savefig(tmp, format="png", dpi=110)
    finally:
        plt.close(fig)
    return bubble


# ----------------------------------------------------------------------------------------------- CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``meshtrain viz schedule``."""
    p.add_argument("--pp", type=int, help="pipeline ranks (required without --trace)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step (required without --trace)")
    p.add_argument("--schedule", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)")
    p.add_argument("--virtual", type=int, help="model chunks per rank (default 2 for interleaved, else 1)")
    p.add_argument("--out", default="schedule.png", help="PNG to write (default schedule.png)")
    p.add_argument("--trace", help="draw a measured JSON trace written by the pipeline engine instead")


def _fail(msg: str) -> int:
    print(f"meshtrain viz schedule: error: {msg}", file=sys.stderr)
    return 2


def _from_trace(args: argparse.Namespace) -> tuple[Timeline, str, str]:
    """Timeline, title and summary line of a measured trace; CLI values must agree with it."""
    tr = read_trace(args.trace)
    for field, given, found in (("--pp", args.pp, tr.pp), ("--microbatches", args.microbatches, tr.microbatches),
                                ("--schedule", args.schedule, tr.schedule), ("--virtual", args.virtual, tr.virtual)):
        if given is not None and given != found:
            raise ScheduleError(f"{field} {given} disagrees with the trace's {found}; drop {field} to use the trace's")
    theory = theoretical_bubble(tr.schedule, tr.pp, tr.microbatches, tr.virtual)
    measured = bubble_fraction(tr.timeline)
    title = f"measured {tr.schedule} pp={tr.pp} m={tr.microbatches} v={tr.virtual}"
    return tr.timeline, title, f"measured bubble {measured:.1%}   theoretical {theory:.1%}"


def _simulated(args: argparse.Namespace) -> tuple[Timeline, str, str]:
    """Timeline, title and summary line of the simulated schedule the arguments name."""
    if args.pp is None or args.microbatches is None:
        raise ScheduleError("--pp and --microbatches are required without --trace, e.g. --pp 4 --microbatches 8")
    name = args.schedule or "1f1b"
    virtual = args.virtual if args.virtual is not None else (2 if name == "interleaved" else 1)
    sched = build_schedule(name, args.pp, args.microbatches, virtual)
    check_schedule(sched, args.pp, args.microbatches, virtual)
    timeline = simulate(sched)
    theory = theoretical_bubble(name, args.pp, args.microbatches, virtual)
    peaks = [peak_in_flight(acts) for acts in sched]
    title = f"{name} pp={args.pp} m={args.microbatches} v={virtual} (F=1, B=2)"
    summary = (f"theoretical bubble {theory:.1%}   simulated bubble {bubble_fraction(timeline):.1%}   "
               f"peak activations in flight per rank {peaks}")
    return timeline, title, summary


def main(args: argparse.Namespace) -> int:
    """Run ``meshtrain viz schedule``: draw a simulated schedule or a measured trace; the exit code."""
    try:
        timeline, title, summary = _from_trace(args) if args.trace else _simulated(args)
        draw_timeline(timeline, args.out, title=title, unit="seconds" if args.trace else "time (F=1, B=2)")
    except MeshtrainError as e:
        return _fail(str(e))
    print(summary)
    print(f"wrote {args.out}")
    return 0
