"""SIGTERM across simulated hosts keeps the step it stopped at (``meshtrain/train/interrupt.py``).

Training runs dp2 x tp2 on 2 hosts x 2 ranks (shm inside a host, gloo between), one torchrun per
host, with ``checkpoint.every = 0``. Once a step is logged, SIGTERM goes to one of host1's workers
(an operator, a node agent); the run is resumed across the hosts and, once it has trained a step
more, SIGTERM goes to host1's torchrun agent (what Slurm sends a job step's processes at its time
limit). Each time every rank of both hosts must stop after the same step and save it, and rank 0
must say so in one line; the last checkpoint resumed (here, as threads) must give the
uninterrupted run's losses bitwise. (One run through both signals: a launch of the hosts costs
more than its training.)
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.simhosts import SimulatedHosts

from ._util import ROOT, skip_without_namespaces

STEPS = 30  # ~5 s of training across the hosts after a first row: each signal lands mid-run
ARGS = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
        "--train.seq_len=32", "--train.warmup_steps=1", f"--train.steps={STEPS}", "--parallel.dp=2",
        "--parallel.tp=2", "--checkpoint.every=0"]


def _losses(run: Path) -> list[tuple[int, float]]:
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _rows(run: Path) -> int:
    try:
        return len(_losses(run))
    except ValueError:  # a line caught half-written
        return 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, float]]:
    """The uninterrupted run, as threads (every transport gives the same losses bitwise)."""
    out = tmp_path_factory.mktemp("interrupt-hosts") / "ref"
    assert main(["train", f"--out={out}", *ARGS, "--comm.transport=local", "--no-progress"]) == 0
    return _losses(out)


def _run_until_signalled(tmp_path: Path, out: Path, target: str, after: int, *extra: str) -> tuple[int, list[str]]:
    """The run across 2 hosts x 2 ranks; once it has logged a step past ``after``, SIGTERM to host1's
    ``target`` ("agent" or "worker"). Returns the step it stopped at and the hosts' logs, having
    checked that every rank stopped there with one line, a checkpoint of that step and no worker's
    traceback."""
    worker = ["-m", "meshtrain.train", f"--out={out}", *ARGS, *extra]
    with SimulatedHosts(2, 2, worker, tmp_path / f"hosts-{target}", cwd=ROOT) as hosts:
        deadline = time.monotonic() + 120
        while _rows(out) <= after:
            assert time.monotonic() < deadline and all(p.poll() is None for p in hosts._procs), hosts.tails()
            time.sleep(0.02)
        pid = hosts.agent_pid(1) if target == "agent" else hosts.worker_pids(1)[-1]
        assert pid is not None, hosts.tails()
        os.kill(pid, signal.SIGTERM)
        codes = hosts.wait(90)
        logs = [hosts.log(k) for k in range(2)]
        assert all(c != 0 for c in codes), f"exit codes {codes}\n{hosts.tails()}"  # stopped, not finished
        for k in range(2):
            assert hosts.shm_left(k) == [], hosts.shm_left(k)
    said = [ln for log in logs for ln in log.splitlines() if "meshtrain.train: interrupted by SIGTERM after step" in ln]
    assert len(said) == 1, "\n".join(logs)[-4000:]  # rank 0's line, once, on whichever host holds it
    step = len(_losses(out))
    assert after < step < STEPS and f"after step {step} of {STEPS}" in said[0], said
    assert [s for s, _ in _losses(out)] == list(range(1, step + 1))  # each step once, none lost or replayed
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{step:08d}"
    # no worker's traceback; torchrun's agent prints its own SignalException when it is the one signalled
    frames = [ln for log in logs for ln in log.splitlines() if ln.strip().startswith("File ") and "/meshtrain/" in ln]
    assert frames == [], "\n".join(logs)[-4000:]
    return step, logs


@pytest.mark.timeout(300)
def test_sigterm_to_a_worker_then_to_an_agent_saves_the_same_step_on_both_hosts(tmp_path, reference):
    """SIGTERM to one of host1's workers; the run resumed across the hosts; SIGTERM to host1's agent;
    the run resumed on threads to the end: the uninterrupted run's losses, bitwise."""
    skip_without_namespaces()
    out = tmp_path / "run"
    first, _ = _run_until_signalled(tmp_path, out, "worker", 0)
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == [f"step-{first:08d}"]
    second, _ = _run_until_signalled(tmp_path, out, "agent", first, "--checkpoint.resume=auto")
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == [f"step-{first:08d}",
                                                                            f"step-{second:08d}"]
    assert main(["train", f"--out={out}", *ARGS, "--comm.transport=local", "--no-progress",
                 "--checkpoint.resume=auto"]) == 0
    assert _losses(out) == reference
