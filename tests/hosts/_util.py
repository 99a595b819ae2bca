"""Helpers shared by the simulated-host tests: skip where namespaces are unavailable, run a worker."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import pytest

from meshtrain.simhosts import SimulatedHosts, namespaces_unavailable

ROOT = Path(__file__).resolve().parents[2]


def skip_without_namespaces() -> None:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)


def run_hosts(tmp_path: Path, nproc: Sequence[int], worker: Sequence[str], timeout: float,
              env: dict[str, str] | None = None) -> SimulatedHosts:
    """Run ``worker`` on one simulated host per entry of ``nproc``; assert every host exited 0
    and left nothing in its /dev/shm. Returns the (finished) hosts, for their logs."""
    with SimulatedHosts(len(nproc), nproc, worker, tmp_path / "hosts", env=env, cwd=ROOT) as hosts:
        codes = hosts.wait(timeout)
        if codes != [0] * len(nproc):
            lines = [ln for k in range(hosts.n) for ln in hosts.log(k).splitlines()
                     if re.match(r"(FAIL|ERROR)|meshtrain\.train: error|\S*Error:", ln)]
            pytest.fail(f"exit codes {codes}; the workers said:\n" + "\n".join(lines[:40])
                        + f"\n\n{hosts.tails(2500)}", pytrace=False)
        for k in range(hosts.n):
            assert hosts.shm_left(k) == [], f"host{k} left {hosts.shm_left(k)} in its /dev/shm"
    return hosts


def tiny_job_config(steps: int, resume: bool = False) -> str:
    """The config file of the scheduler tests' job (Slurm, PyTorchJob): the test model, dp2 x tp2,
    a checkpoint every 2 steps (``resume``: continue from the latest, as a resubmitted job does)."""
    return f"""[model]
preset = "test"

[data]
max_bytes = 300000
vocab_size = 512

[train]
global_batch = 4
seq_len = 32
warmup_steps = 2
steps = {steps}

[parallel]
dp = 2
tp = 2

[comm]
timeout_s = 30

[checkpoint]
every = 2
{'resume = "auto"' + chr(10) if resume else ''}"""
