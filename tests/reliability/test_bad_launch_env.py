"""Launch settings that cannot work (an address that does not resolve, a port out of range, a rank
outside the world, an address where nothing listens) fail at start-up, within comm.init_timeout_s,
in one line that names the setting and the fix, with exit code 2 and no run directory."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening, then closed: nothing answers there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CASES = {
    "unresolvable address": ({"MASTER_ADDR": "host7.invalid", "MASTER_PORT": "29500"},
                             ["MASTER_ADDR='host7.invalid' does not resolve", "--local-addr"]),
    "port out of range": ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"},
                          ["MASTER_PORT='99999' is not an integer in 1..65535", "--master-port"]),
    "rank outside the world": ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "2"},
                               ["RANK='2' is not an integer in 0..1"]),
    "nothing listens": ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "CLOSED"},
                        ["could not reach the rendezvous store at 127.0.0.1:", "nothing answers there"]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_a_launch_setting_that_cannot_work_fails_in_one_line(tmp_path, case):
    extra, said = CASES[case]
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", **extra}
    if env["MASTER_PORT"] == "CLOSED":
        env["MASTER_PORT"] = str(_closed_port())
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "meshtrain.train", f"--out={tmp_path / 'run'}", "--model.preset=test",
                           "--comm.transport=auto", "--comm.init_timeout_s=3", "--comm.timeout_s=60"],
                          env=env, capture_output=True, text=True, timeout=50)
    elapsed = time.monotonic() - t0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and re.match(r"meshtrain\.train: error: \[rank \d\] LaunchError: ", lines[0]), proc.stderr
    assert all(s in lines[0] for s in said), lines[0]
    assert elapsed < 40  # 3 s of init timeout + the interpreter's start, not the 60 s collective timeout
    assert not (tmp_path / "run").exists()
