"""Elastic training across simulated hosts: 3 hosts x 2 ranks under ``torchrun --nnodes 2:3``.

One run goes through three changes (one run, not three, for the suite's time):

1. **A frozen worker.** After a few steps one worker of host2 (host1 if host2 got node rank 0; never
   host0, whose agent holds the rendezvous store) gets SIGSTOP. The heartbeats find it within the
   bound of a dead rank (test_kill_across_hosts: 10 s), its sibling on that host kills it
   (torchrun's agent would wait 30 s to), and the agents restart the world of 6 ranks from the
   newest step every rank kept in host memory (``elastic.memory_every = 1``, the default): a
   ``restart`` row, from memory, at most one step trained again.
2. **A host lost.** At a random step that host is killed (kill -9 of every process, its /dev/shm
   gone with it). The survivors stop, the agents form a rendezvous of the 2 hosts left, and the
   run goes on at dp2 x tp2 (the layout named in the log) from the newest step whose every shard
   survived in memory (the lost host's ranks' copies are on the next host): a ``world_change``
   row, 6 -> 4 ranks, from memory, at most one step replayed.
3. **The host back.** A new agent for it joins the rendezvous; the agents see it waiting and
   SIGTERM their workers, which save at a step boundary; the run grows back to dp3 x tp2 and
   finishes: a ``world_change`` row, 4 -> 6 ranks, from that disk checkpoint, nothing replayed.

Asserted: every step's sample ids are those of an undisturbed run (each sample once, in the
loader's order), every step's loss is within 1e-5 relative of that run's (one rank, the same global
batch of 6, which the elastic run trains as 2 or 3 rows per dp rank: one rank takes a third of the
time of dp3 x tp2 as threads on 2 cores, and layouts agree within 1e-5, as test_trainer holds), the
steps replayed after each failure are the steps since the newest copy that survived (only the failures replay any), the rows' seconds add
up, and the finished run leaves no replica in any host's /dev/shm. No periodic disk checkpoint
(``checkpoint.every = 0``): the disk holds only what the stops save and the memory restores commit,
so a failure that fell back to disk would replay every step since the previous change.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.simhosts import SimulatedHosts
from meshtrain.train.debug import describe_world_change, world_changes
from meshtrain.train.metrics import read_rows

from ._util import ROOT, skip_without_namespaces

COMMON = ["--checkpoint.every=0", "--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512",
          "--train.global_batch=6", "--train.seq_len=32", "--train.warmup_steps=2", "--comm.timeout_s=300",
          "--train.lr=0.001", "--train.min_lr=0.001", "--parallel.dp=3", "--parallel.tp=2"]
STEPS = 24
# c10d: complete a round 1 s after MIN hosts joined (default 30 s); a dead agent's rendezvous
# heartbeat expires after 1 s x 5 (default 5 s x 3). Not shorter: an agent waiting to join beats
# only about every 1-2 s (it polls the state once a second), and one whose beat looks expired is
# dropped from the wait list by the others, who then never see it waiting.
RDZV = {"last_call_timeout": 1, "keep_alive_interval": 1, "keep_alive_max_attempt": 5}
# torch 2.13's agents share their TCPStore with the workers by default, and then an agent that joins
# in a later round waits forever for the round's MASTER_ADDR, which the round's rank 0 agent wrote
# in round 0 only (it keeps its first answer): the workers' own store avoids it (docs/training.md)
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
             # the world of 4 ranks trains slowly on purpose: the killed host's new agent (seconds to start)
             # must join it before it has finished the run
             "MESHTRAIN_TEST_STEP_DELAY": "0.5", "MESHTRAIN_TEST_DELAY_WORLD": "4"}
LOST_BOUND_S = 10.0  # a dead rank's: every host stops within it (test_kill_across_hosts)


def _env_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(i.decode().split("=", 1) for i in f.read().split(b"\0") if b"=" in i)


def _until(hosts: SimulatedHosts, cond, what: str, timeout: float = 90.0, up: tuple | list = (0, 1, 2)) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        codes = [hosts._procs[k].poll() for k in up]
        assert codes == [None] * len(up) and time.monotonic() < deadline, \
            f"{what}: not within {timeout:g}s (exit codes {codes})\n{hosts.tails()}"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_a_frozen_worker_a_lost_host_and_its_return_lose_no_sample(tmp_path):
    skip_without_namespaces()
    out, seed = tmp_path / "run", random.randrange(1 << 16)
    rng = random.Random(seed)
    metrics = out / "metrics.jsonl"
    worker = [str(ROOT / "tests" / "hosts" / "_elastic_worker.py"), "--out", str(out), f"--train.steps={STEPS}",
              "--elastic.enabled=true", *COMMON]

    def steps() -> list[dict]:
        return [r for r in read_rows(metrics) if "event" not in r]

    def events() -> list[dict]:
        return [r for r in read_rows(metrics) if "event" in r]

    def steps_since_event(n: int) -> int:  # step rows logged after the n-th event row
        rows = read_rows(metrics)
        at = [i for i, r in enumerate(rows) if "event" in r]
        return len([r for r in rows[at[n - 1] + 1:] if "event" not in r]) if len(at) >= n else -1

    with SimulatedHosts(3, 2, worker, tmp_path / "hosts", cwd=ROOT, env=AGENT_ENV, max_restarts=4,
                        nnodes="2:3", rdzv_conf=RDZV) as hosts:
        # 1. freeze one worker of host2, or of host1 where host2 holds rank 0 (and the workers' store)
        first = 3 + rng.randrange(2)
        _until(hosts, lambda: len(steps()) >= first, "the first steps")
        victim = 2 if hosts.node_rank(2) != 0 else 1
        frozen = next(p for p in hosts.worker_pids(victim) if _env_of(p)["LOCAL_RANK"] == "1")
        frozen_rank = int(_env_of(frozen)["RANK"])
        os.kill(frozen, signal.SIGSTOP)
        _until(hosts, lambda: steps_since_event(1) >= 2, "the restart after the frozen worker")
        # 2. kill that host at a random step of the restarted world
        extra = rng.randrange(3)
        _until(hosts, lambda: steps_since_event(1) >= 2 + extra, "steps after the restart")
        hosts.kill_host(victim)
        # 3. the host back, once the world of 2 hosts has trained a step
        up = [k for k in range(3) if k != victim]
        _until(hosts, lambda: steps_since_event(2) >= 1, "the world of 2 hosts", up=up)
        hosts.start_host(victim)
        _until(hosts, lambda: len(events()) >= 3, "the world grown back to 3 hosts")
        codes = hosts.wait(120)
        assert codes == [0, 0, 0], f"exit codes {codes} (seed {seed})\n{hosts.tails()}"
        for k in range(3):  # the restarts left nothing behind in /dev/shm, the finished run no replica
            assert hosts.shm_left(k) == [], (k, hosts.shm_left(k))
        logs = [hosts.log(k) for k in range(3)]

    rows = read_rows(metrics)
    marks = [i for i, r in enumerate(rows) if "event" in r]
    restart, shrink, grow = (rows[i] for i in marks)
    assert [e["event"] for e in (restart, shrink, grow)] == ["restart", "world_change", "world_change"], seed
    # the worlds: 6 -> 6 (restart) -> 4 (dp 3 -> 2, tp kept) -> 6
    assert (restart["old_world"], restart["new_world"], shrink["new_world"], grow["new_world"]) == (6, 6, 4, 6)
    assert (shrink["new_layout"]["dp"], shrink["new_layout"]["tp"], grow["new_layout"]["dp"]) == (2, 2, 3)
    # rank 0 names the layout (rank 0 is on the host whose agent has the lowest pid, almost always host0)
    assert "# elastic: layout dp=3 tp=2 -> dp=2 tp=2: 4 ranks instead of the configured 6" in "".join(logs)
    # the frozen rank: found by the heartbeats within a dead rank's bound, killed by its sibling
    assert "no heartbeat" in restart["stopped_by"] and restart["seconds"]["detect"] < LOST_BOUND_S, restart
    assert f"killed rank(s) [{frozen_rank}] of this host" in logs[victim], logs[victim][-3000:]
    assert restart["seconds"]["rendezvous"] < 20, restart  # not torchrun's 30 s wait for a frozen worker
    assert grow["stopped_by"].startswith("SIGTERM"), grow

    # each change resumed from the newest surviving copy before it and replayed exactly the steps since
    bounds = [*marks, len(rows)]
    for n, i in enumerate(marks):
        before = [r["step"] for r in rows[(bounds[n - 1] + 1 if n else 0):i] if "event" not in r]
        after = [r["step"] for r in rows[i + 1:bounds[n + 1]] if "event" not in r]
        change, last = rows[i], before[-1]
        assert after[0] == change["step"] + 1, (seed, change, before, after)
        assert change["replayed_steps"] == last - change["step"], (seed, change, before)
        if change is grow:  # planned: saved at the step boundary the ranks agreed on, nothing trained twice
            assert change["step"] == last and change["replayed_steps"] == 0 and change["from"] == "disk", change
        else:  # a failure: from the newest step every rank kept in memory: the last one, or the one before
            # (two before if the crash struck at a step boundary while the last copy was in flight)
            assert change["from"] == "memory" and change["replayed_steps"] <= 2, (seed, change, before)
        secs = change["seconds"]
        assert all(secs[k] is not None and secs[k] >= 0 for k in secs), change
        assert secs["total"] == pytest.approx(sum(v for k, v in secs.items() if k != "total")), change
    assert world_changes(out, restarts=True) == [restart, shrink, grow] and world_changes(out) == [shrink, grow]
    line = describe_world_change(shrink)  # what `meshtrain debug elastic RUN_DIR` prints for it
    assert line.startswith(f"after step {shrink['step']}: 6 -> 4 ranks, dp=3 tp=2 -> dp=2 tp=2"), line

    # every step, once in the end, with an undisturbed run's samples and losses
    ref = tmp_path / "ref"
    assert main(["train", f"--out={ref}", "--comm.transport=local", "--no-progress", f"--train.steps={STEPS}",
                 *COMMON, "--parallel.dp=1", "--parallel.tp=1"]) == 0
    want = {r["step"]: r for r in read_rows(ref / "metrics.jsonl")}
    final = {r["step"]: r for r in rows if "event" not in r}
    assert sorted(final) == list(range(1, STEPS + 1)), seed
    assert [final[s]["samples"] for s in sorted(final)] == [want[s]["samples"] for s in sorted(want)]
    for r in rows:  # every run of a step, the replayed ones too (algorithm="auto" times its candidates
        if "event" not in r:  # afresh at each start, so a replayed step's sums may differ in the last bits)
            assert r["samples"] == want[r["step"]]["samples"], (seed, r)
            assert math.isclose(r["loss"], want[r["step"]]["loss"], rel_tol=1e-5), (seed, r, want[r["step"]])
