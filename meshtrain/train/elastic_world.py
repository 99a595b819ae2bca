"""World changes under ``torchrun --nnodes MIN:MAX``: what the old world leaves when it stops, and
what the change cost, for the ``world_change`` (or ``restart``) row of ``metrics.jsonl``.

A change costs these, each timed from marks the processes leave, since no single process sees
them all:

* **detect**: from the end of the old world's last step to its stop. For a failure, the time to
  notice it (a collective that fails, or the heartbeats, ``comm/liveness.py``); for a planned change
  (SIGTERM from the agent, which saw a host waiting to join) the step boundary the ranks agree on
  and the save there.
* **rendezvous**: from that stop to the start of the new world's processes: the agents stop their
  workers, form the new rendezvous (torch's c10d handler) and start the workers.
* **setup** and **reshard**: from the new process's start to the checkpoint load (imports, process
  group, data, model), and the load itself (the last checkpoint resharded into the new layout).
* **replay**: the old world's steps after that checkpoint, trained again (their measured time).

Each worker process of an elastic run writes a *stop mark* (``RUN_DIR/elastic/stop-<host>-<pid>.json``:
its last finished step and when, the time it stopped and why) once, when it stops: on SIGTERM after
the save, on an error, or when the heartbeats find a peer lost. The new world's rank 0 reads the
marks, writes the row and removes them. A process killed outright leaves none; its peers' marks
tell the story.

Also here: a rank its peers found frozen (no heartbeat: SIGSTOP, a hang that holds the interpreter)
is SIGKILLed by a sibling worker on its own host, because torchrun's agent would SIGTERM it and
wait 30 s (a fixed timeout) before SIGKILL, holding the job's restart that long.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .. import procfs
from ..files import write_atomic

STOPS_DIR = "elastic"
"""The directory of the run directory that holds the stop marks between two worlds."""

_LOCK = threading.Lock()
_PROGRESS: dict[str, Any] = {"step": 0, "end": None}  # this process's last finished step, and when (wall clock)
_WRITTEN: set[str] = set()  # run directories this process has left its stop mark in


def begin(run_dir: str | os.PathLike, step: int) -> None:
    """A world starts in ``run_dir`` at ``step`` (its checkpoint's): this process may leave a stop
    mark there again, and its last finished step is ``step``."""
    with _LOCK:
        _WRITTEN.discard(os.path.abspath(run_dir))
        _PROGRESS.update(step=step, end=None)


def note_step(step: int, when: float | None = None) -> None:
    """Record that this process finished ``step`` (at ``when``, default now; wall clock)."""
    with _LOCK:
        _PROGRESS.update(step=step, end=time.time() if when is None else when)


def process_start() -> float:
    """The wall-clock time this process started (Linux: its start in /proc against the uptime, to
    about 10 ms); elsewhere the time this module was imported."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    return _IMPORTED


_IMPORTED = time.time()


def _mark_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / STOPS_DIR / f"stop-{socket.gethostname()}-{os.getpid()}.json"


def write_stop(run_dir: str | os.PathLike, rank: int, world: int, why: str) -> Path | None:
    """Leave this process's stop mark in ``run_dir`` (once per process and run; later calls do
    nothing, so the first cause is kept). Never raises: a stop must not fail over its mark."""
    key = os.path.abspath(run_dir)
    with _LOCK:
        if key in _WRITTEN:
            return None
        _WRITTEN.add(key)
        mark = {"rank": rank, "world": world, "host": socket.gethostname(), "pid": os.getpid(),
                "step": _PROGRESS["step"], "step_end": _PROGRESS["end"], "stopped": time.time(),
                "why": why.splitlines()[0][:300] if why else ""}
    try:
        path = _mark_path(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(mark))
        return path
    except OSError:
        return None


def read_stops(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The stop marks the previous world left in ``run_dir`` (unreadable ones skipped)."""
    out = []
    for p in sorted((Path(run_dir) / STOPS_DIR).glob("stop-*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(p.read_text()))
    return out


def clear_stops(run_dir: str | os.PathLike, stops: Sequence[Mapping[str, Any]]) -> None:
    """Remove the stop marks ``stops`` (read by ``read_stops``) once their row is written."""
    for s in stops:
        with contextlib.suppress(OSError):
            (Path(run_dir) / STOPS_DIR / f"stop-{s['host']}-{s['pid']}.json").unlink()
    with contextlib.suppress(OSError):  # only if empty
        (Path(run_dir) / STOPS_DIR).rmdir()


def _last_runs(rows: Sequence[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    """{step: its last row} of the step rows of a metrics.jsonl (a replayed step appears twice)."""
    return {int(r["step"]): r for r in rows if "event" not in r and "step" in r}


def change_seconds(stops: Sequence[Mapping[str, Any]], resumed_step: int, rows: Sequence[Mapping[str, Any]],
                   started: float, load_start: float, load_end: float) -> tuple[dict[str, float | None], int]:
    """The seconds a change cost, split as the module docstring says, and the steps it replays.

    ``stops``: the old world's stop marks; ``resumed_step``: the checkpoint's step; ``rows``: the run's
    metrics.jsonl so far; ``started``, ``load_start``, ``load_end``: wall-clock times of this process's
    start and of the checkpoint load. ``detect`` and ``rendezvous`` are None without stop marks (a
    resume started by hand, or a world whose every process was killed)."""
    runs = _last_runs(rows)
    last = max([int(s.get("step") or 0) for s in stops] + [s for s in runs if s > resumed_step] + [resumed_step])
    replayed = list(range(resumed_step + 1, last + 1))
    timed = [float(runs[s]["step_s"]) for s in replayed if s in runs and "step_s" in runs[s]]
    if len(timed) < len(replayed):  # steps the old world ran but did not log (log_every, or rank 0 was lost)
        known = [float(r["step_s"]) for r in runs.values() if "step_s" in r]
        timed += [statistics.median(known) if known else 0.0] * (len(replayed) - len(timed))
    ends = [float(s["step_end"]) for s in stops if s.get("step_end") is not None]
    stopped = min((float(s["stopped"]) for s in stops), default=None)
    detect = max(stopped - max(ends), 0.0) if stopped is not None and ends else None
    rendezvous = max(started - stopped, 0.0) if stopped is not None else None
    seconds: dict[str, float | None] = {"detect": detect, "rendezvous": rendezvous,
                                        "setup": max(load_start - started, 0.0), "reshard": load_end - load_start,
                                        "replay": sum(timed)}
    seconds["total"] = sum(v for v in seconds.values() if v is not None)
    return seconds, len(replayed)


def stopped_by(stops: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the old world stopped: the reason of its earliest stop mark (None without marks)."""
    first = min(stops, key=lambda s: float(s["stopped"]), default=None)
    return None if first is None else first.get("why") or None


# -- a rank found frozen --------------------------------------------------------------------------


def _env(pid: int) -> dict[str, str]:
    return dict(i.decode(errors="replace").split("=", 1) for i in procfs.environ(pid) if b"=" in i)


def sibling_pids(ranks: Sequence[int]) -> dict[int, int]:
    """{global rank: pid} of this host's other workers of the same torchrun run and attempt (the
    agent's other children) among ``ranks``; empty outside torchrun or off Linux. Read from each
    process's initial environment, so it finds the workers torchrun execs, not ones forked from a
    server (``meshtrain train``'s local launcher, whose ranks set RANK after the fork)."""
    mine = {k: os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")}
    if mine["TORCHELASTIC_RUN_ID"] is None:
        return {}
    out = {}
    for pid in procfs.children(os.getppid()):
        env = _env(pid)
        if pid != os.getpid() and all(env.get(k) == v for k, v in mine.items()) and env.get("RANK", "").isdigit():
            if int(env["RANK"]) in ranks:
                out[int(env["RANK"])] = pid
    return out


def kill_frozen_siblings(lost: Sequence[int], rank: int, hosts: Sequence[str]) -> list[int]:
    """SIGKILL the ranks of ``lost`` (found without a heartbeat) that run on this rank's host: they
    are frozen (their process exists but its heartbeat thread stopped), and the agent would
    otherwise wait 30 s after its SIGTERM before killing them. Returns the ranks killed."""
    # Every sibling is looked at, not only those this rank's own monitor saw go quiet: under load
    # the first error here can be another rank's report, and a stopped process (state T) is frozen
    # whoever noticed it.
    here = [r for r in range(len(hosts)) if r != rank and hosts[r] == hosts[rank]]
    killed = []
    for r, pid in sibling_pids(here).items():
        if not procfs.alive(pid):  # gone already (a zombie until its agent reaps it): nothing to do
            continue
        if r not in lost and procfs.state(pid) != "T":  # T: stopped by a signal
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(r)
    return killed


def report_frozen(lost: Sequence[int], rank: int, hosts: Sequence[str]) -> list[int]:
    """``kill_frozen_siblings`` and the line that names the ranks killed (stderr)."""
    killed = kill_frozen_siblings(lost, rank, hosts)
    if killed:
        print(f"meshtrain: [rank {rank}] killed rank(s) {killed} of this host: no heartbeat, but their "
              f"process was still there (frozen); torchrun's agent would wait 30 s to kill them",
              file=sys.stderr, flush=True)
    return killed


def on_peer_lost(run_dir: str | None, rank: int, world: int, monitor: Any, hosts: Sequence[str],
                 elastic: bool) -> Callable[[BaseException], None]:
    """A listener for the heartbeat monitor (``LivenessMonitor.add_listener``): it runs on the
    heartbeat thread when a peer is lost, before the monitor ends this process. It kills frozen
    sibling ranks (``kill_frozen_siblings``) and, for an elastic run, leaves the stop mark."""

    def listener(err: BaseException) -> None:
        if elastic and run_dir:  # first: the mark's time is the detection's, before any kill below
            write_stop(run_dir, rank, world, str(err))
        lost = [r for r in getattr(err, "missing", []) if str(monitor.failures.get(r, "")).endswith("was lost")]
        report_frozen(lost, rank, hosts)
        hint = rendezvous_hint(elastic, os.environ)
        if hint:
            print(hint, file=sys.stderr, flush=True)

    return listener


def rendezvous_hint(elastic: bool, env: Mapping[str, str]) -> str | None:
    """What the survivors of a lost host do next, said once per host (its local rank 0) when an elastic
    run under torchrun with restarts left loses a peer, with the fix for the case torchrun itself
    only reports later: fewer hosts left than ``--nnodes MIN`` (its ``RendezvousTimeoutError`` after
    ``join_timeout``, a message that does not say what to do). None elsewhere."""
    if not elastic or "TORCHELASTIC_RUN_ID" not in env or env.get("LOCAL_RANK", "0") != "0":
        return None
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) <= 0:
        return None
    return (f"meshtrain: [host {socket.gethostname()}] a peer was lost: torchrun's agents now form a new "
            f"rendezvous with the hosts left and the run goes on from its newest saved step. If fewer hosts than "
            f"torchrun's --nnodes MIN remain, torchrun exits after its join_timeout (RendezvousTimeoutError): "
            f"then submit the job again with a lower MIN, or once the hosts are back; it resumes from the last "
            f"checkpoint")


__all__ = ["STOPS_DIR", "begin", "note_step", "process_start", "write_stop", "read_stops", "clear_stops",
           "change_seconds", "stopped_by", "sibling_pids", "kill_frozen_siblings", "report_frozen", "on_peer_lost",
           "rendezvous_hint"]
