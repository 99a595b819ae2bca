"""meshtrain.simhosts itself: each host's own hostname and /dev/shm, what it left there, and
killing an agent, a whole host, or everything after a timeout."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from meshtrain.procfs import alive as _alive
from meshtrain.simhosts import SimulatedHosts

from ._util import ROOT, skip_without_namespaces

PROBE = str(ROOT / "tests" / "hosts" / "_probe_worker.py")


def _until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_hosts_have_their_own_hostname_and_dev_shm(tmp_path):
    skip_without_namespaces()
    outer = f"/dev/shm/simhosts-outer-{uuid.uuid4().hex[:8]}"  # must stay invisible inside the hosts
    open(outer, "w").close()
    try:
        with SimulatedHosts(2, 2, [PROBE, "probe", str(tmp_path)], tmp_path / "logs") as hosts:
            assert hosts.wait(90) == [0, 0], hosts.tails()
            seen = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
            assert sorted(seen) == [0, 1, 2, 3]
            for k in (0, 1):
                mine = sorted(r for r, s in seen.items() if s["hostname"] == f"host{k}")
                assert len(mine) == 2 and {seen[r]["group_rank"] for r in mine} == {mine[0] // 2}
                assert hosts.shm_left(k) == [f"left-by-rank{r}" for r in mine]
            assert all(s["master_addr"] == "127.0.0.1" for s in seen.values())
            assert not any(os.path.basename(outer) in s["shm"] for s in seen.values())
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("left-by-rank")]
    finally:
        os.unlink(outer)


def test_kill_agent_then_host_and_exit_kills_the_rest(tmp_path):
    skip_without_namespaces()
    with SimulatedHosts(2, 2, [PROBE, "sleep"], tmp_path / "logs") as hosts:
        _until(lambda: len(hosts.worker_pids(0)) == 2 and len(hosts.worker_pids(1)) == 2)
        w0, w1 = hosts.worker_pids(0), hosts.worker_pids(1)
        assert {hosts.node_rank(0), hosts.node_rank(1)} == {0, 1}
        agent = hosts.kill_agent(1)
        _until(lambda: not _alive(agent) and hosts.agent_pid(1) is None)
        assert all(_alive(p) for p in w1 + w0)  # only the agent died; its workers live on, orphaned
        hosts.kill_host(0)
        assert not any(_alive(p) for p in w0) and all(_alive(p) for p in w1)
        assert hosts.wait(10) == [-9, 128 + 9]  # host0 killed; host1's shell saw torchrun killed
        with pytest.raises(FileNotFoundError):
            hosts.shm_left(0)  # killed before it could list its /dev/shm
    assert not any(_alive(p) for p in w1)  # leaving the block killed host1's orphans


def test_wait_timeout_kills_everything_and_shows_the_logs(tmp_path):
    skip_without_namespaces()
    with SimulatedHosts(2, 1, [PROBE, "sleep"], tmp_path / "logs") as hosts:
        _until(lambda: hosts.worker_pids(0) and hosts.worker_pids(1))
        pids = hosts.worker_pids(0) + hosts.worker_pids(1) + [hosts.agent_pid(0), hosts.agent_pid(1)]
        with pytest.raises(TimeoutError, match=r"(?s)still ran after 1s.*host0.*host1"):
            hosts.wait(1)
        assert not any(_alive(p) for p in pids)
