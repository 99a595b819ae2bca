"""A worker started where its backend or device cannot work (NCCL without CUDA, ``cuda`` without a
GPU: an sbatch script for GPUs sent to CPU nodes) stops before any process group with a named
``ConfigError`` and its fix, printed once per host (by LOCAL_RANK 0), not as torch tracebacks from
every rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from meshtrain import comm
from meshtrain.errors import ConfigError
from meshtrain.train import launch
from meshtrain.train.config import load_config, to_dict

CASES = {  # name: (overrides, what the one line must say)
    "nccl-without-cuda": (["--comm.backend=nccl", "--train.device=cuda"],
                          ["ConfigError: comm.backend = 'nccl' cannot work here", "sees no CUDA device",
                           "--comm.backend=gloo --train.device=cpu", "meshtrain launch --device cpu"]),
    "cuda-without-gpu": (["--train.device=cuda"],
                         ["ConfigError: train.device = 'cuda' but this process sees no CUDA device",
                          "use train.device = 'cpu'"]),
}
SMALL = ["--model.preset=test", "--parallel.dp=2", "--parallel.tp=1", "--comm.init_timeout_s=3"]


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening, then closed: a rank that got past the check fails there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(90)
def test_two_ranks_of_a_host_say_it_once(tmp_path):
    """The sbatch-for-GPUs case as the two worker processes torchrun --nproc-per-node 2 would start
    (its environment; CUDA hidden, so a GPU machine fails the same way): exit 2 on both ranks, one
    line on stderr in all, from LOCAL_RANK 0, and no run directory. One case: the other takes the
    same path through ``main_torchrun``, checked for both in-process below, and each process here
    costs a torch import (about 3 s of CPU on a busy 2-core machine)."""
    procs = {}
    t0 = time.monotonic()
    cases = {name: CASES[name] for name in ("nccl-without-cuda",)}
    for name, (overrides, _) in cases.items():
        port = str(_closed_port())
        for rank in (0, 1):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                   "CUDA_VISIBLE_DEVICES": ""}
            procs[name, rank] = subprocess.Popen(
                [sys.executable, "-m", "meshtrain.train", f"--out={tmp_path / name}", *SMALL, *overrides],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = {key: p.communicate(timeout=80) for key, p in procs.items()}
    elapsed = time.monotonic() - t0
    for name, (_, said) in cases.items():
        assert [procs[name, r].returncode for r in (0, 1)] == [2, 2], outs
        assert outs[name, 1][1] == "", outs[name, 1]  # silent: LOCAL_RANK 0 speaks for the host
        lines = [ln for ln in outs[name, 0][1].splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("meshtrain.train: error: [host "), outs[name, 0][1]
        assert all(s in lines[0] for s in said), lines[0]
        assert not (tmp_path / name).exists()
    assert elapsed < 60


@pytest.mark.parametrize("case", list(CASES))
def test_the_check_comes_before_any_process_group(tmp_path, monkeypatch, capsys, case):
    """In-process: comm.init is never reached, by main_torchrun (either local rank) or by worker
    (the path of `meshtrain train`'s own processes)."""
    overrides, said = CASES[case]

    def no_init(*args, **kwargs):
        raise AssertionError("comm.init was called")

    monkeypatch.setattr(comm, "init", no_init)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = [f"--out={tmp_path / 'run'}", *SMALL, *overrides]
    for local_rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert launch.main_torchrun(args) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == lines and all(s in err for s in said) == bool(lines), err
    with pytest.raises(ConfigError, match=said[0].split(": ", 1)[1].replace("(", r"\(")):
        launch.worker(to_dict(load_config(None, args)))
    assert not (tmp_path / "run").exists()


def test_a_backend_and_device_that_work_pass(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for overrides in ([], ["--comm.backend=gloo", "--train.device=cpu"], ["--train.device=auto"]):
        launch.check_backend_and_device(load_config(None, overrides))
