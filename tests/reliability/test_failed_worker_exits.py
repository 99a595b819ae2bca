"""A worker that fails exits within seconds with its error's code, even while one of its threads
still waits in a collective (Python's exit would join that thread until the collective timeout,
holding the host's agent and the whole job: seen as a simulated host that never stopped)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

# One rank of `python -m meshtrain.train` whose training fails with bad input while a thread of an
# executor (as DataParallel's and the communicator's are) waits for ever.
SCRIPT = """
import threading, concurrent.futures, sys
import meshtrain.train.trainer as trainer
from meshtrain.errors import ConfigError
from meshtrain.train.launch import main_torchrun

def train(config, progress=True, report=False):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(threading.Event().wait)  # never set: a collective whose peer never comes
    raise ConfigError("bad input found mid-run; fix: none, this is a test")

trainer.train = train
sys.exit(main_torchrun(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_a_failed_worker_exits_though_a_thread_still_waits(tmp_path):
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", SCRIPT, f"--out={tmp_path / 'run'}", "--model.preset=test",
                               "--comm.timeout_s=300"], env=env, capture_output=True, text=True, timeout=40)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the failed worker still ran after 40 s:\n{exc.stderr}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "ConfigError: bad input found mid-run" in proc.stderr
    assert time.monotonic() - t0 < 30


def test_bad_input_exits_2_and_a_lost_peer_1_whichever_launcher_ran_it():
    """`meshtrain train` (by the failed worker's message) and a torchrun worker (by the exception)
    classify alike: bad input 2, anything else 1."""
    from meshtrain.comm.liveness import PeerLost
    from meshtrain.errors import CheckpointError, CollectiveTimeout, ConfigError, LaunchError, exit_code
    from meshtrain.parallel.pipeline.schedule import ScheduleError
    from meshtrain.train.trainer import TrainingDiverged

    for bad in (ConfigError("x"), ScheduleError("x"), CheckpointError("x"), TrainingDiverged("x"), LaunchError("x")):
        assert exit_code(bad) == 2 and exit_code(type(bad).__name__) == 2, bad
    for other in (PeerLost("x", [1]), CollectiveTimeout("x"), RuntimeError("x"), KeyboardInterrupt()):
        assert exit_code(other) == 1 and exit_code(type(other).__name__) == 1, other
