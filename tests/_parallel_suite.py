"""The suite on two pytest-xdist workers (``make test`` runs ``-n 2 --dist loadfile
--no-loadscope-reorder``).

Run one after another, the tests keep about one of CI's two cores busy: many of them wait (for a
dead rank's bound, a heartbeat, a restarted world). Two workers fill the other core. What that
needs, kept here:

* **a temp dir per worker**, so that the per-test leftover check (conftest) still sees only its own
  test's files;
* **the slowest files first**, so that both workers finish together (xdist hands out files in
  collection order as workers free up; a 90-s file taken last would run alone at the end);
* **a host to itself** for the tests that time it (``@pytest.mark.alone``): a readers-writer lock
  over the run's shared temp dir; every other test holds it shared.

/dev/shm cannot be split per worker (meshtrain's, torch's and multiprocessing's names all go there),
so under xdist its leftover check is made once for the whole run, by the controller (conftest).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from typing import Iterator

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""This process's xdist worker id ("gw0"), None when the suite runs in one process."""

SLOWEST_FIRST = (
    "tests/hosts/test_elastic_hosts.py", "tests/cluster/test_slurm.py", "tests/hosts/test_kill_across_hosts.py",
    "tests/parallel/test_parity.py", "tests/hosts/test_training_across_hosts.py", "tests/test_readme.py",
    "tests/hosts/test_interrupt_across_hosts.py",
    "tests/parallel/test_autocast_compile.py", "tests/train/test_trainer.py",
    "tests/hosts/test_collectives_across_hosts.py", "tests/train/test_elastic.py", "tests/comm/test_gloo_processes.py",
    "tests/reliability/test_bad_input.py", "tests/train/test_checkpoint.py", "tests/plan/test_bench_plan.py",
    "tests/reliability/test_bad_launch_env.py", "tests/train/test_restart.py", "tests/comm/test_shm_failures.py",
)
"""The files that take 23-120 s each on a 2-core VM (``--durations=0``), about slowest first."""


SHARED_ENV = "MESHTRAIN_SUITE_SHARED_TMP"
"""The directory the controller makes for the run's workers: their temp dirs and the host lock."""


def is_controller(config) -> bool:
    """True in the process that hands tests to xdist workers (it runs none itself)."""
    opt = config.option
    return not hasattr(config, "workerinput") and bool(getattr(opt, "numprocesses", 0)) \
        and getattr(opt, "dist", "no") != "no"


def make_shared_dir() -> str:
    """The controller's: a fresh directory for the workers (who inherit its path), removed at the end.
    Its name is short: the fork server's socket lies three levels below (pymp-*/listener-*), and a
    Unix socket's path may not pass 107 bytes (CI's temp dir already takes 51)."""
    path = tempfile.mkdtemp(prefix="x")
    os.environ[SHARED_ENV] = path
    return path


def give_worker_its_temp_dir() -> None:
    """Under xdist, point TMPDIR (and ``tempfile``) at a directory of this worker's own, inside the
    controller's; the processes the tests start inherit it. Called before anything makes a temp file."""
    if not WORKER:
        return
    own = os.path.join(os.environ[SHARED_ENV], WORKER)
    os.makedirs(own, exist_ok=True)
    os.environ["TMPDIR"] = own
    tempfile.tempdir = None  # recomputed from TMPDIR at the next call


def slowest_first(items: list) -> None:
    """Reorder ``items`` in place: the files of ``SLOWEST_FIRST`` first, in its order, then the rest
    as collected (a stable sort: the order inside a file is kept)."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def _lock_paths() -> tuple[str, str]:
    base = os.path.join(os.environ[SHARED_ENV], "host")
    return base + ".gate", base + ".lock"


@contextlib.contextmanager
def host_share(alone: bool) -> Iterator[None]:
    """Hold the host shared (any test) or alone (a test that times it) for the block. Writer first:
    a waiting ``alone`` test closes the gate, so the other worker starts no new test meanwhile and
    the wait is at most the test it is in. No-op outside xdist."""
    if not WORKER:
        yield
        return
    gate_path, lock_path = _lock_paths()
    with open(gate_path, "a") as gate, open(lock_path, "a") as lock:
        if alone:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(lock, fcntl.LOCK_EX)
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(lock, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
