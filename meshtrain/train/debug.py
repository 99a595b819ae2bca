"""Post-mortem of a hang: every rank's flight recorder (its last collectives) is dumped into
``RUN_DIR/flight/`` when a collective fails, and ``meshtrain debug hang RUN_DIR`` reads them and
says which rank stopped where. ``meshtrain debug elastic RUN_DIR`` lists the run's world changes
(the ``world_change`` rows of its metrics.jsonl).

The reasoning is the one NCCL's flight-recorder analysis uses: within a group, every rank issues
the same collectives in the same order (numbered by ``seq``), so the ranks that reached a lower
``seq`` than their peers, or have no record at all, are the ones the others waited for.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .. import comm
from .metrics import read_rows

FLIGHT_DIR = "flight"


def dump_flight_record(run_dir: str | Path, rank: int) -> Path:
    """Write this rank's flight recorder to ``RUN_DIR/flight/rank-NNNNN.json``."""
    d = Path(run_dir) / FLIGHT_DIR
    d.mkdir(parents=True, exist_ok=True)
    return Path(comm.dump_flight_recorder(str(d / f"rank-{rank:05d}.json")))


def load_flight_records(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """{rank: its records, oldest first} from ``RUN_DIR/flight/``."""
    d = Path(run_dir) / FLIGHT_DIR
    if not d.is_dir():
        raise FileNotFoundError(f"no flight records in {d}: they are written when a collective times out or "
                                f"mismatches; check the run directory")
    out = {}
    for f in sorted(d.glob("rank-*.json")):
        data = json.loads(f.read_text())
        out[int(data["rank"])] = data["records"]
    return out


def _describe(r: dict[str, Any]) -> str:
    return f"{r['op']} seq {r['seq']} {r['shapes']} {r['dtype']} ({r['state']})"


def analyze(records: dict[int, list[dict[str, Any]]], world_size: int | None = None) -> list[str]:
    """Lines that say, per group, which ranks fell behind and where each rank stopped."""
    lines = []
    groups: dict[tuple[int, ...], dict[int, dict[str, Any]]] = {}
    for rank, recs in records.items():
        for r in recs:
            key = tuple(r["group_ranks"])
            last = groups.setdefault(key, {}).get(rank)
            if last is None or r["seq"] >= last["seq"]:
                groups[key][rank] = r
    if world_size is not None:
        missing = sorted(set(range(world_size)) - set(records))
        if missing:
            lines.append(f"ranks {missing} left no flight record: they died (or were killed) before a collective "
                         f"failed on them — look at them first")
    for ranks, last in sorted(groups.items()):
        top = max(r["seq"] for r in last.values())
        behind = sorted(set(ranks) - {k for k, r in last.items() if r["seq"] == top})
        head = next(r for r in last.values() if r["seq"] == top)
        if behind:
            lines.append(f"group {list(ranks)}: ranks {behind} never reached {head['op']} seq {top} that "
                         f"{sorted(k for k, r in last.items() if r['seq'] == top)} waited in")
        for k in sorted(last):
            lines.append(f"  rank {k}: last {_describe(last[k])}")
    stuck = sorted(k for k, recs in records.items() if recs and recs[-1]["state"] != "completed")
    if stuck:
        lines.append(f"ranks whose last collective did not complete: {stuck}")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``meshtrain debug hang RUN_DIR [--world N]``."""
    p.add_argument("run_dir", help="the run directory whose flight/ records to read")
    p.add_argument("--world", type=int, help="the run's world size (to name ranks that left no record)")


def world_changes(run_dir: str | Path, restarts: bool = False) -> list[dict[str, Any]]:
    """The ``{"event": "world_change", ...}`` rows of ``RUN_DIR/metrics.jsonl``, in order (a run
    writes one each time it resumes under another layout than its checkpoint's); with ``restarts``
    also the ``restart`` rows (an elastic run resumed under the same layout after a stop)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}: pass the run directory of a `meshtrain train` run")
    rows = read_rows(path)
    kinds = ("world_change", "restart") if restarts else ("world_change",)
    return [r for r in rows if r.get("event") in kinds]


def describe_world_change(row: dict[str, Any]) -> str:
    """One line for a world-change (or restart) row: the step, the layouts, the worlds, the steps
    replayed, the seconds measured (a part that could not be timed shows as "?") and where the step
    came from (memory or disk)."""
    from .elastic import layout_label as label

    secs = ", ".join(f"{k} " + ("?" if v is None else f"{v:.2f} s") for k, v in row.get("seconds", {}).items())
    what = "restart" if row.get("event") == "restart" else f"{row['old_world']} -> {row['new_world']} ranks"
    replayed = f", {row['replayed_steps']} step(s) replayed" if "replayed_steps" in row else ""
    source = f", resumed from {row['from']}" if row.get("from") else ""  # in-memory replicas or disk
    return (f"after step {row['step']}: {what}, {label(row['old_layout'])} -> {label(row['new_layout'])} "
            f"({secs}{replayed}{source})" + (f"; {row['reason']}" if row.get("reason") else "")
            + (f"; stopped by {row['stopped_by']}" if row.get("stopped_by") else ""))


def add_elastic_arguments(p: argparse.ArgumentParser) -> None:
    """``meshtrain debug elastic RUN_DIR``."""
    p.add_argument("run_dir", help="the run directory whose metrics.jsonl to read")


def main(args: argparse.Namespace) -> int:
    """``hang``: print the analysis; ``elastic``: list the world changes. 2 when there is nothing to read."""
    if getattr(args, "debug", "hang") == "elastic":
        try:
            changes = world_changes(args.run_dir, restarts=True)
        except (OSError, ValueError) as exc:
            print(f"meshtrain debug elastic: error: {exc}", file=sys.stderr)
            return 2
        for row in changes:
            print(describe_world_change(row))
        if not changes:
            print(f"no world changes or restarts in {args.run_dir}/metrics.jsonl: every resume kept the "
                  f"checkpoint's layout and followed no stop")
        return 0
    try:
        records = load_flight_records(args.run_dir)
    except (OSError, ValueError, KeyError) as exc:
        print(f"meshtrain debug hang: error: {exc}", file=sys.stderr)
        return 2
    for line in analyze(records, args.world):
        print(line)
    return 0
