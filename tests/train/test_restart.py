"""Restart after a killed worker: ``meshtrain train --max-restarts 1`` with 4 processes, one of them
killed with SIGKILL mid-run. The elastic agent tears the job down and restarts it; the workers
resume from the last checkpoint, replay the lost steps bitwise, and no sample is skipped or
repeated. /dev/shm is left clean."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.comm.transport import shm_memory

# 16 steps: the kill comes after step 4, and the run must still be training when it lands (a kill
# after the last checkpoint would restart with nothing to replay)
ARGS = ["--train.steps=16", "--checkpoint.every=2", "--model.preset=test", "--data.max_bytes=300000",
        "--data.vocab_size=512", "--train.global_batch=4", "--train.seq_len=32", "--train.warmup_steps=2",
        "--no-progress", "--parallel.dp=2", "--parallel.tp=2"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _workers(pid: int) -> list[int]:
    """The launcher's worker processes: the children of the server it forks them from
    (``worker_processes``), which is its child beside multiprocessing's resource tracker."""
    def cmdline(p: int) -> str:
        try:
            return Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return ""

    servers = [p for p in _children(pid) if "multiprocessing.forkserver" in cmdline(p)]
    return [w for s in servers for w in _children(s)]


@pytest.mark.timeout(400)
def test_kill_9_of_a_worker_restarts_and_loses_nothing(tmp_path):
    ref = tmp_path / "ref"
    assert main(["train", f"--out={ref}", "--comm.transport=local", *ARGS]) == 0
    want = _rows(ref / "metrics.jsonl")

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "meshtrain.cli", "train", f"--out={out}", "--max-restarts=1", *ARGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim, first, restarted, deadline = None, set(), False, time.monotonic() + 300
    ours = {proc.pid}  # every process of this run seen: /dev/shm is shared with other tests' runs
    while proc.poll() is None and time.monotonic() < deadline:
        if victim is None and len(_rows(out / "metrics.jsonl")) >= 5:  # after step 4's checkpoint
            workers = _workers(proc.pid)
            assert len(workers) == 4, f"expected the launcher's 4 workers, found {workers}"
            first, victim = set(workers), workers[-1]
            ours |= first
            os.kill(victim, signal.SIGKILL)
        elif victim is not None and not restarted:  # the agent starts a new group of 4
            now = set(_workers(proc.pid))
            ours |= now
            restarted = len(now) == 4 and not now & first
        time.sleep(0.05)
    log = proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
    assert proc.returncode == 0, log[-3000:]
    assert victim is not None, "the run ended before a worker could be killed"
    assert restarted, f"no new worker group was seen after the kill of {victim}:\n{log[-3000:]}"

    rows = _rows(out / "metrics.jsonl")
    steps = [r["step"] for r in rows]
    # steps logged after the last checkpoint before the kill run twice; under load the kill can land
    # right after a checkpoint, when there is nothing to replay (exit 0 after a kill -9 is the restart)
    assert len(steps) >= 16 and steps[-1] == 16
    last: dict[int, dict] = {}
    for r in rows:
        if r["step"] in last:  # a replayed step repeats its first run bit for bit
            assert r["loss"] == last[r["step"]]["loss"] and r["samples"] == last[r["step"]]["samples"]
        last[r["step"]] = r
    assert sorted(last) == list(range(1, 17))
    seen = [s for step in sorted(last) for s in last[step]["samples"]]
    assert seen == [s for r in want for s in r["samples"]] and len(set(seen)) == len(seen)
    for step, r in last.items():  # processes (shm) vs threads: the same sums in another order
        assert r["loss"] == pytest.approx(want[step - 1]["loss"], rel=1e-5)
    assert shm_memory.segments_of(ours) == []  # none of the run's, the killed worker's included
