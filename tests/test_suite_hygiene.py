"""The suite's own machinery: its leftover check judges only what meshtrain's runs create, so other
programs writing to the temp dir or /dev/shm meanwhile (pip's tmp*, an editor's swap files) do not
fail it; under two xdist workers a leak still fails the run and an ``alone`` test runs alone."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import _parallel_suite as parallel
from .conftest import _leftovers

ROOT = Path(__file__).resolve().parents[1]


def test_the_leftover_check_sees_meshtrain_names_only():
    root = tempfile.gettempdir()
    ours, theirs = os.path.join(root, "meshtrain-run-1-probe"), os.path.join(root, "tmpprobe-pip-unpack")
    shm_ours, shm_theirs = "/dev/shm/meshtrain.1.probe", "/dev/shm/someone-elses-probe"
    made = [ours, theirs] + ([shm_ours, shm_theirs] if os.path.isdir("/dev/shm") else [])
    try:
        for path in made:
            open(path, "w").close()
        shm, tmp = _leftovers()
        assert "meshtrain-run-1-probe" in tmp and "tmpprobe-pip-unpack" not in tmp, tmp
        if os.path.isdir("/dev/shm"):
            assert "meshtrain.1.probe" in shm and "someone-elses-probe" not in shm, shm
    finally:
        for path in made:
            os.remove(path)


def test_an_alone_test_holds_the_host_while_the_others_share_it(tmp_path, monkeypatch):
    """``host_share``: two shared holders overlap; an ``alone`` one waits for the holder it finds,
    and a shared request made while it waits starts only after it (writer first). No sleeps: each
    step waits for the state it needs, so a busy machine cannot reorder them."""
    monkeypatch.setattr(parallel, "WORKER", "gw9")
    monkeypatch.setenv(parallel.SHARED_ENV, str(tmp_path))
    events: list[str] = []
    first_in, release = threading.Event(), threading.Event()

    def hold(name: str, alone: bool, until: threading.Event | None = None) -> None:
        with parallel.host_share(alone):
            events.append(f"{name} in")
            if until is not None:
                first_in.set()
                assert until.wait(10)
            events.append(f"{name} out")

    shared = threading.Thread(target=hold, args=("shared", False, release))
    shared.start()
    assert first_in.wait(10)
    with parallel.host_share(False):  # a second shared holder gets in beside the first
        events.append("beside")
    alone = threading.Thread(target=hold, args=("alone", True))
    alone.start()
    gate_path = parallel._lock_paths()[0]
    deadline = time.monotonic() + 10
    with open(gate_path, "a") as gate:  # until the alone test holds the gate (and waits for the lock)
        while True:
            try:
                fcntl.flock(gate, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                break
            fcntl.flock(gate, fcntl.LOCK_UN)
            assert time.monotonic() < deadline, "the alone test never took the gate"
            time.sleep(0.005)
    late = threading.Thread(target=hold, args=("late", False))
    late.start()
    release.set()
    for t in (shared, alone, late):
        t.join(10)
    assert events == ["shared in", "beside", "shared out", "alone in", "alone out", "late in", "late out"], events


def test_two_workers_find_a_leak_at_the_end_and_keep_an_alone_test_alone(tmp_path):
    """The suite's own machinery under ``-n 2`` (a run of two small files with this conftest): a
    name left in /dev/shm fails the run naming it, the ``alone`` test overlaps no other, and what
    forked ranks print is their test's captured output."""
    leak = f"meshtrain.{os.getpid()}.suite-probe"
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "test_a.py").write_text(
        "import time, pytest\n"
        "@pytest.mark.alone\n"
        "def test_alone(): t = time.time(); time.sleep(1.0); print('ALONE', t, time.time())\n"
        f"def test_leak(): open('/dev/shm/{leak}', 'w').close()\n")
    (probe / "test_b.py").write_text("import time\nfrom meshtrain.comm.launch import spawn\n" + "".join(
        f"def test_b{i}(): t = time.time(); time.sleep(0.3); print('OTHER', t, time.time())\n" for i in range(6))
        # ranks forked from the worker's fork server: their output belongs to the test, not the terminal
        + "def test_ranks_print(): spawn(2, print, 'RANK-SAYS', transport=None)\n")
    # the inner run's temp dir is a short one: its workers' fork-server sockets lie four levels below
    # it, and a Unix socket's path may not pass 107 bytes (below this worker's own it would)
    short = tempfile.mkdtemp(prefix="x", dir="/tmp")
    # a run of its own: not this worker's xdist ids, shared dir or cache
    fresh_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST_", "MESHTRAIN_SUITE_"))
                 and k not in ("MESHTRAIN_CACHE_DIR", "PYTEST_CURRENT_TEST")}
    try:
        got = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-p", "tests.conftest",
                              "-p", "no:cacheprovider", "-rA", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(probe),
                              str(probe)], cwd=ROOT, capture_output=True, text=True, timeout=100,
                             env={**fresh_env, "TMPDIR": short})
    finally:
        if os.path.exists(f"/dev/shm/{leak}"):
            os.remove(f"/dev/shm/{leak}")
        shutil.rmtree(short, ignore_errors=True)
    out = got.stdout + got.stderr
    # (the line may name more: the outer suite's other worker shares /dev/shm meanwhile)
    said = [line for line in out.splitlines() if line.startswith("left in /dev/shm by the run:")]
    assert got.returncode == 1 and len(said) == 1 and repr(leak) in said[0], out
    spans = {kind: [] for kind in ("ALONE", "OTHER")}
    for line in out.splitlines():
        if line.startswith(("ALONE ", "OTHER ")):
            kind, start, end = line.split()
            spans[kind].append((float(start), float(end)))
    assert len(spans["ALONE"]) == 1 and len(spans["OTHER"]) == 6, out
    passes = out.index("= PASSES =")  # -rA: the passed tests' captured output, each under its name
    assert out.count("RANK-SAYS") == 2 and out.index("RANK-SAYS") > passes, out
    (a0, a1), = spans["ALONE"]
    assert all(end <= a0 or start >= a1 for start, end in spans["OTHER"]), spans
