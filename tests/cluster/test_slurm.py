"""``meshtrain launch --emit slurm --device cpu``'s script under a real Slurm: munged, slurmctld and
two slurmd "hosts" on this machine (``meshtrain.simslurm``), a 2-node dp2 x tp2 job submitted with
``sbatch`` as emitted, unedited.

* ``scancel`` mid-run leaves a checkpoint, and the same script submitted again (``resume = "auto"``)
  continues from it to the end: the second job exits 0, every step's loss (the first job's steps and
  the second's) equals the same layout's run with its ranks as threads (``comm.transport = "local"``)
  bitwise (every cross-rank sum of dp2 x tp2 has 2 terms, as in
  tests/hosts/test_training_across_hosts.py), and the run directory is complete.

One test, two jobs: an uninterrupted job would prove nothing the pair does not (the first job
trains from scratch, the second to the end), and each job costs its 2 nodes' 6 interpreters.

Skipped, with the reason, where the packages or namespaces are missing (.ci/run installs the
packages; this module starts and stops the daemons). Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.simhosts import free_port
from meshtrain.simslurm import SimulatedSlurm, unavailable

from ..hosts._util import tiny_job_config

STEPS = 12
CONFIG = tiny_job_config(STEPS, resume=True)
JOB_TIMEOUT = 100  # s; a job takes about 10 here


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The cluster for the module; stopped and its state removed whatever happened, and no process
    of it left (checked by pid files, namespaces and pgrep)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    cluster = SimulatedSlurm(root / "state", 2, cpus=2)
    try:
        yield cluster
    finally:
        cluster.stop()
        left = subprocess.run(["pgrep", "-a", "-f", str(root / "state")], capture_output=True, text=True).stdout
        assert left == "" and not (root / "state").exists(), f"left running: {left}"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The config and its reference run (ranks as threads), which also builds the token caches the jobs read."""
    d = tmp_path_factory.mktemp("work")
    (d / "cpu.toml").write_text(CONFIG)
    assert main(["train", "--config", str(d / "cpu.toml"), f"--out={d / 'reference'}", "--comm.transport=local",
                 "--no-progress"]) == 0
    return d


def _script(work: Path, run_dir: Path) -> Path:
    out = work / f"{run_dir.name}.sh"
    assert main(["launch", "--emit", "slurm", "--device", "cpu", "--nodes", "2", "--procs-per-node", "2",
                 "--cpus-per-proc", "1", "--config", str(work / "cpu.toml"), "--run-dir", str(run_dir),
                 "--port", str(free_port()), "--time", "00:05:00", "--out", str(out)]) == 0
    return out


def _job_env(work: Path) -> dict[str, str]:
    """What a user's shell would pass: the venv's torchrun first on PATH; gloo on loopback (the
    simulated hosts share it); a temp dir of the job's own (torchrun's files of a cancelled job)."""
    (work / "jobtmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "MESHTRAIN_HOST_ID"}  # it would make both hosts one
    bindir = str(Path(sys.executable).parent)
    return {**env, "PATH": f"{bindir}{os.pathsep}{env.get('PATH', '')}", "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1", "TMPDIR": str(work / "jobtmp")}


def _losses(run: Path) -> dict[int, float]:
    """step -> loss; a resumed run appends, so a step logged twice keeps its last value."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _log(work: Path, job: str) -> str:
    logs = list(work.glob(f"*-{job}.out"))
    return logs[0].read_text(errors="replace")[-4000:] if logs else "(no job log)"


def _run_job(cluster: SimulatedSlurm, work: Path, script: Path) -> tuple[str, dict[str, str]]:
    job = cluster.sbatch(script, cwd=work, env=_job_env(work))
    return job, cluster.wait(job, JOB_TIMEOUT)


def _outside_exit_barrier(log: str) -> str:
    """``log`` without torch's agent's report of a failed exit barrier: a job step's agents meet once
    their workers are done, and under load the agent that hosts the store can leave first, so
    another agent's last read fails and torch logs it (its ``logger.exception``, one prefix per line)
    after the job's work is done; nothing of meshtrain's."""
    marks = {m.group(1) for m in re.finditer(r"(agent/server/api\.py:\d+\]) Error waiting on exit barrier", log)}
    return "\n".join(ln for ln in log.splitlines() if not any(m in ln for m in marks))


@pytest.mark.timeout(200)
def test_scancel_leaves_a_checkpoint_that_a_new_job_resumes(cluster, work):
    run = work / "cancelled"
    script = _script(work, run)
    job = cluster.sbatch(script, cwd=work, env=_job_env(work))
    latest = run / "checkpoints" / "latest"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not latest.exists():  # the first checkpoint (step 2) is committed: cancel at once
        info = cluster.job(job)
        assert info.get("JobState") in ("PENDING", "CONFIGURING", "RUNNING"), (info, _log(work, job))
        assert time.monotonic() < deadline, f"no checkpoint after {JOB_TIMEOUT}s\n{_log(work, job)}"
        time.sleep(0.02)
    cluster.scancel(job)
    info = cluster.wait(job, 30)
    assert info["JobState"] == "CANCELLED", (info, _log(work, job))
    saved = int(latest.read_text().strip().rsplit("-", 1)[1])
    assert 2 <= saved < STEPS, f"the job saved step {saved} before the cancel landed: it ran to the end"

    job2, info = _run_job(cluster, work, script)  # the same script again: resume = "auto"
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _log(work, job2)
    rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumed_at = len(rows) - 1 - rows[::-1].index(saved + 1)  # the new job's first row (the old one may have
    assert rows[resumed_at:] == list(range(saved + 1, STEPS + 1))  # logged past its checkpoint before the cancel)
    assert info["NodeList"] == "sim[0-1]" and info["NumNodes"] == "2"
    assert _losses(run) == _losses(work / "reference")  # every step, the cancelled job's and the resumed one's, bitwise
    assert {"metrics.jsonl", "summary.json", "config.toml", "loss.png", "checkpoints"} <= {p.name for p in run.iterdir()}
    assert json.loads((run / "summary.json").read_text())["steps"] == STEPS
    latest_now = (run / "checkpoints" / "latest").read_text().strip()
    assert latest_now.endswith(f"{STEPS:08d}") and (run / "checkpoints" / latest_now / "metadata.json").is_file()
    assert "Traceback" not in _outside_exit_barrier(_log(work, job2))
