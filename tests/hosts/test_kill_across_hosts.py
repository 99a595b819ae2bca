"""kill -9 across simulated hosts: of one worker, of a whole host, of one host's torchrun agent.

Training runs dp2 x tp2 on 2 hosts x 2 ranks (shm inside a host, gloo between) with a collective
timeout of 300 s. After step 5 one thing on host1 is killed. Every host must then exit non-zero
within 10 s, whatever the timeout (heartbeats, comm/liveness.py), a surviving host's log must name
a lost rank of host1, and no surviving host may leave anything in its /dev/shm. A killed agent
must take its workers along (no orphan trains on). The killed worker's run then resumes on one
host under another layout (dp1 x tp2) from its last checkpoint, and that step's loss matches an
uninterrupted run's.

Restarts across hosts (torchrun --max-restarts, the agents forming the world again after a lost
worker, a lost host, a host back) are test_elastic_hosts.py's.
"""

from __future__ import annotations

import math
import os
import re
import signal
import time
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.procfs import alive as _alive
from meshtrain.simhosts import SimulatedHosts
from meshtrain.train.metrics import read_rows

from ._util import ROOT, skip_without_namespaces

COMMON = ["--checkpoint.every=2", "--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512",
          "--train.global_batch=4", "--train.seq_len=32", "--train.warmup_steps=2", "--comm.timeout_s=300",
          "--train.lr=0.001", "--train.min_lr=0.001"]  # a flat schedule: runs of other lengths agree step by step
STEPS = 200  # far more than run before the kill: the run must still be training when it lands


def _train_until_killed(tmp_path: Path, what: str) -> tuple[SimulatedHosts, Path, list[int], float, list[int]]:
    out = tmp_path / "run"
    worker = ["-m", "meshtrain.train", "--out", str(out), f"--train.steps={STEPS}", "--parallel.dp=2",
              "--parallel.tp=2", *COMMON]
    hosts = SimulatedHosts(2, 2, worker, tmp_path / "hosts", cwd=ROOT)
    deadline = time.monotonic() + 150
    while len(read_rows(out / "metrics.jsonl")) < 5:
        assert time.monotonic() < deadline and all(p.poll() is None for p in hosts._procs), hosts.tails()
        time.sleep(0.1)
    node = hosts.node_rank(1)
    assert node is not None
    lost = [2 * node, 2 * node + 1]  # host1's global ranks
    workers = hosts.worker_pids(1)
    killed_at = time.monotonic()
    if what == "worker":
        os.kill(workers[-1], signal.SIGKILL)  # the last local rank
        lost = lost[1:]
    elif what == "agent":
        hosts.kill_agent(1)
    else:
        hosts.kill_host(1)
    return hosts, out, lost, killed_at, workers


@pytest.mark.timeout(300)
@pytest.mark.parametrize("what", ["worker", "host", "agent"])
def test_every_host_stops_within_10s_of_a_kill_naming_the_lost_rank(tmp_path, what):
    skip_without_namespaces()
    hosts, out, lost, killed_at, workers = _train_until_killed(tmp_path, what)
    with hosts:
        codes = hosts.wait(60)
        took = time.monotonic() - killed_at
        assert all(c != 0 for c in codes), f"exit codes {codes}\n{hosts.tails()}"
        assert took < 10, f"the hosts took {took:.1f}s to exit after the kill\n{hosts.tails()}"
        assert hosts.shm_left(0) == [], hosts.shm_left(0)
        if what != "host":
            assert hosts.shm_left(1) == [], hosts.shm_left(1)
        assert not [p for p in workers if _alive(p)], "host1's workers outlived the kill (orphans)"
        survivor = hosts.log(0)
        said = "\n".join(ln for ln in survivor.splitlines() if "meshtrain" in ln)
        named = [r for r in lost if re.search(rf"\brank(?:\(s\))? \[?(?:\d+, )*{r}\b[^\n]*(lost|failed|killed)", said)]
        assert named, f"host0 never named a lost rank of {lost}:\n{said}\n{survivor[-3000:]}"
    if what != "worker":
        return
    # Resume the killed run on one host (threads) under another layout: dp1 x tp2.
    done = read_rows(out / "metrics.jsonl")
    assert main(["train", f"--out={out}", "--checkpoint.resume=auto", "--comm.transport=local", "--no-progress",
                 "--parallel.dp=1", "--parallel.tp=2", f"--train.steps={len(done) + 2}", *COMMON]) == 0
    rows = read_rows(out / "metrics.jsonl")
    resumed = rows[len(done):]
    first = resumed[0]["step"]
    assert first % 2 == 1 and first <= len(done) + 1, [r["step"] for r in rows]  # right after a checkpoint
    ref = tmp_path / "ref"
    assert main(["train", f"--out={ref}", "--comm.transport=local", "--no-progress", "--parallel.dp=2",
                 "--parallel.tp=2", f"--train.steps={first}", *COMMON]) == 0
    want = read_rows(ref / "metrics.jsonl")[first - 1]
    assert want["step"] == first and math.isclose(resumed[0]["loss"], want["loss"], rel_tol=1e-5), (resumed[0], want)
