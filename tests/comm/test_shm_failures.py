"""The shm transport when things go wrong: a peer killed with SIGKILL, a rank that never calls, a
mismatched call, leftovers of a dead job in /dev/shm; and launching under torchrun and the CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshtrain.comm.launch import RankFailure, spawn
from meshtrain.comm.transport import shm_memory
from meshtrain.errors import CollectiveMismatch, CollectiveTimeout

from ._outcomes import outcomes

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _killed_peer(rank: int, out_dir: str) -> None:
    import meshtrain.comm as mc

    path = Path(out_dir) / f"rank{rank}.json"
    mc.all_reduce(torch.ones(1000), algorithm="shm")  # everyone has mapped everyone's buffers
    if rank == 2:
        path.write_text(json.dumps({"pid": os.getpid()}))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.3)  # rank 2 is dead by now
    report = {"pid": os.getpid()}
    t0 = time.monotonic()
    try:
        for _ in range(3):
            mc.all_reduce(torch.ones(50_000), algorithm="shm")
        report["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.monotonic() - t0
    path.write_text(json.dumps(report))


@pytest.mark.timeout(60)
def test_killed_peer_is_named_quickly_and_shm_is_left_clean(tmp_path):
    stale = shm_memory.segment_path(f"{shm_memory.PREFIX}{_dead_pid()}.1.r0.p2p")
    Path(stale).write_bytes(b"left by a job killed earlier")
    with pytest.raises(RankFailure, match=r"rank 2 died with exit code -9"):
        spawn(3, _killed_peer, str(tmp_path), timeout=50, comm_timeout=20, transport="shm")
    assert not os.path.exists(stale)  # the next start removed the dead job's segment
    reports = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)}
    for r in (0, 1):  # the survivors: a clear error naming rank 2, long before the 20 s timeout
        assert reports[r]["error"] is not None and "rank 2" in reports[r]["error"], reports[r]
        assert "killed" in reports[r]["error"] and reports[r]["seconds"] < 5, reports[r]
    pids = [reports[r]["pid"] for r in range(3)]
    time.sleep(0.5)
    assert shm_memory.segments_of(pids) == []


def _blocked_then_destroyed(rank: int, op: str) -> dict:
    import threading

    import meshtrain.comm as mc

    mc.all_reduce(torch.ones(8), algorithm="shm")  # the buffers are mapped
    if rank == 1:  # alive, but never calls again: rank 0's wait can end only by destroy() (or, 2.5 s after
        time.sleep(3)  # it, by this rank's exit, which the assertion below tells apart)
        return {}
    out: dict = {}

    def wait() -> None:
        try:
            if op == "recv":
                mc.recv(torch.empty(8), src=1)
            else:
                mc.all_reduce(torch.ones(8), algorithm="shm")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    mc.destroy()
    thread.join(5)
    out["seconds"], out["ended"] = time.monotonic() - t0, not thread.is_alive()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["all_reduce", "recv"])
def test_destroy_ends_a_wait_left_in_another_thread(op):
    """A failed worker destroys its communicator while an async op or a bucket's reduction still
    waits in another thread for a live peer: the wait must end then, not at the timeout, or the
    thread holds the process's exit (Python joins executor threads) and the whole job with it."""
    res = spawn(2, _blocked_then_destroyed, op, timeout=50, comm_timeout=30, transport="shm")[0]
    assert res["ended"] and res["seconds"] < 2, res
    assert "transport is closed" in res["error"], res


def _errors(rank: int) -> dict:
    import meshtrain.comm as mc

    out: dict = {}
    try:  # a mismatched call: every rank raises at once, naming the odd rank
        mc.all_reduce(torch.ones(4 if rank != 1 else 6), algorithm="shm")
    except CollectiveMismatch as exc:
        out["mismatch"] = str(exc)
    mc.barrier()
    g = mc.new_group([0, 1, 2], timeout=1.5)
    if rank != 2:  # rank 2 never calls
        t0 = time.monotonic()
        try:
            mc.all_reduce(torch.ones(8), group=g, algorithm="shm")
        except CollectiveTimeout as exc:
            out["timeout"], out["seconds"] = str(exc), time.monotonic() - t0
    mc.barrier()
    return out


@pytest.mark.timeout(60)
def test_mismatch_and_missing_rank_over_shm():
    res = spawn(3, _errors, timeout=50, comm_timeout=20, transport="shm")
    assert all("ranks [1]: all_reduce shapes=[[6]]" in r["mismatch"] for r in res)
    for r in res[:2]:
        assert "rank(s) [2] never called it" in r["timeout"] and r["seconds"] < 5


def _mismatches_in_the_first_step(rank: int) -> dict:
    """Calls that differ only where the fingerprint travels with the shm step: an empty call
    against a full one, shm against ring, auto picking ring on one rank and shm on the other."""
    import meshtrain.comm as mc

    cases = {
        "empty": lambda: mc.all_reduce(torch.ones(0 if rank == 0 else 4), algorithm="shm"),
        "algorithms": lambda: mc.all_reduce(torch.ones(4), algorithm="shm" if rank == 0 else "ring"),
        "auto-sizes": lambda: mc.reduce_scatter_tensor(torch.empty(16 if rank == 0 else 1 << 18),
                                                       torch.ones(32 if rank == 0 else 1 << 19)),
        "ops": lambda: (mc.broadcast(torch.ones(8), src=0, algorithm="shm") if rank == 0
                        else mc.all_gather_into_tensor(torch.empty(16), torch.ones(8), algorithm="shm")),
        # the shm all-to-all checks its pairs from its headers: rank 0 sends 3 to rank 1, which expects 2
        "a2a-pairs": lambda: mc.all_to_all_single(torch.empty(4), torch.ones(5 if rank == 0 else 4), [2, 2],
                                                  [2, 3] if rank == 0 else [2, 2]),
    }
    out = outcomes(cases, (CollectiveMismatch,))
    x = torch.full((300_000,), float(rank + 1))  # the group still works, chunked and all
    mc.all_reduce(x, algorithm="shm")
    out["after"] = float(x[0]), float(x[-1])
    return out


@pytest.mark.timeout(60)
def test_a_mismatch_is_named_from_the_shm_steps_fingerprint_and_the_group_goes_on():
    res = spawn(2, _mismatches_in_the_first_step, timeout=50, comm_timeout=20, transport="shm")
    for r in res:
        assert "shapes=[[0]]" in r["empty"] and "shapes=[[4]]" in r["empty"], r["empty"]
        assert "algorithm=shm" in r["algorithms"] and "algorithm=ring" in r["algorithms"], r["algorithms"]
        assert "shapes=[[16]]" in r["auto-sizes"] and "shapes=[[262144]]" in r["auto-sizes"], r["auto-sizes"]
        assert "broadcast" in r["ops"] and "all_gather_into_tensor" in r["ops"], r["ops"]
        assert "rank 0 sends 3 elements to rank 1, which expects 2" in r["a2a-pairs"], r["a2a-pairs"]
        assert all(r[k + "_s"] < 5 for k in ("empty", "algorithms", "auto-sizes", "ops", "a2a-pairs"))
        assert r["after"] == (3.0, 3.0)


@pytest.mark.timeout(90)
def test_torchrun_four_ranks_auto_picks_shm(tmp_path):
    proc = subprocess.run(  # torchrun's own log directory would otherwise stay in /tmp
        [str(VENV_BIN / "torchrun"), "--standalone", "--nproc_per_node", "4", "--log-dir", str(tmp_path / "logs"),
         str(ROOT / "tests" / "comm" / "_shm_torchrun_worker.py")],
        capture_output=True, text=True, timeout=80, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "shm worker OK world=4" in proc.stdout
    pids = [int(m) for m in re.findall(r"shm worker pid (\d+)", proc.stdout)]  # the ranks' lines may interleave
    assert len(pids) == 4, proc.stdout
    # nothing of theirs left in /dev/shm (which another xdist worker's ranks may share meanwhile)
    assert shm_memory.segments_of(pids) == []


@pytest.mark.timeout(90)
def test_bench_cli_shm_prints_table_and_checks_results(tmp_path):
    out = tmp_path / "b.json"
    proc = subprocess.run(
        [str(VENV_BIN / "meshtrain"), "bench", "comm", "--transport", "shm", "--world", "2",
         "--algorithms", "shm,ring", "--sizes", "1K,256K", "--trials", "1", "--iters", "3",
         "--json", str(out)],
        capture_output=True, text=True, timeout=80, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "transport=shm world=2 op=all_reduce algorithm=shm" in proc.stdout
    recs = json.loads(out.read_text())["records"]
    assert {(r["algorithm"], r["size"]) for r in recs} == {(a, s) for a in ("shm", "ring") for s in (1024, 262144)}
    assert all(r["wrong"] == 0 and r["transport"] == "shm" for r in recs)
