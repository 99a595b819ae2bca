"""Shared test settings: hypothesis profiles, an isolated calibration cache, a per-test timeout
(pytest-timeout, set in pyproject.toml), the leftover check, and what two xdist workers need
(``_parallel_suite``)."""

import atexit
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

from . import _parallel_suite as parallel

parallel.give_worker_its_temp_dir()  # first: what follows makes temp dirs
# an isolated calibration cache, removed at exit; an xdist worker makes its own rather than share the
# one the controller made (the controller imports this file too)
if "MESHTRAIN_CACHE_DIR" not in os.environ or os.environ.get("MESHTRAIN_SUITE_CACHE_MADE"):
    _cache = tempfile.mkdtemp(prefix="meshtrain-test-cache-")
    os.environ["MESHTRAIN_CACHE_DIR"] = _cache
    os.environ["MESHTRAIN_SUITE_CACHE_MADE"] = "1"
    atexit.register(shutil.rmtree, _cache, True)
# torch's compiler caches (inductor: the meta-device model build of test_preset_sizes already
# makes one) default to <tmp>/torchinductor_<user>: keep them in the run's own directory, so a
# fresh machine's temp dir ends the suite as it began (CI's .ci/run gives a fresh one).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["MESHTRAIN_CACHE_DIR"], "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.environ["MESHTRAIN_CACHE_DIR"], "triton"))

# Byte-compile meshtrain and the tests' worker modules once: the suite starts a few hundred fresh
# interpreters (torchrun's workers and agents, CLI subprocesses, simulated hosts and Slurm jobs), and
# where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) none of them writes a .pyc, so each
# recompiled every module it imported (~0.4 s an interpreter that imports the trainer).
# compileall writes them whatever that setting, and skips those up to date.
import compileall  # noqa: E402
import pathlib  # noqa: E402

for _tree in ("meshtrain", "tests"):
    compileall.compile_dir(pathlib.Path(__file__).resolve().parent.parent / _tree, quiet=2)

from meshtrain import worker_processes  # noqa: E402

# One intra-op thread: most tests run ranks as threads of this process, which then share the
# machine's cores (CI has 2); each rank with an intra-op pool of its own oversubscribes them and
# tests/parallel ran 1.2x slower so. The benches and the launcher set their own counts.
import torch  # noqa: E402

torch.set_num_threads(1)

# CI runs derandomized so a red build is reproducible; locally HYPOTHESIS_PROFILE=dev explores more.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# What meshtrain and the torch machinery it drives create: its shm segments, an elastic run's
# in-memory replicas (a failed run keeps them by design; a test that fails one points
# MESHTRAIN_REPLICA_DIR elsewhere), torch's shared tensors and multiprocessing's semaphores in
# /dev/shm; its scratch and bench directories, the elastic agent's and multiprocessing's in the
# temp dir. Other programs' files (pip's tmp*, an editor's)
# are not the suite's to judge, so a busy machine does not fail it.
SHM_OURS = ("meshtrain.", "meshtrain-mem-", "torch_", "sem.mp-")
TMP_OURS = ("meshtrain", "torchelastic_", "pymp-")


def _leftovers() -> tuple[set[str], set[str]]:
    """Entries of /dev/shm and of the temp dir that meshtrain's runs create."""
    shm = {n for n in os.listdir("/dev/shm") if n.startswith(SHM_OURS)} if os.path.isdir("/dev/shm") else set()
    tmp = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(TMP_OURS)}
    return shm, tmp


_SHM_AT_START: set[str] = set()


def pytest_configure(config):
    """The controller of an xdist run makes the workers' shared directory and notes /dev/shm (checked
    at the end: the workers share it, so no one test's view is its own); a process that runs tests
    starts the fork server: comm.launch.spawn's ranks fork from it, so torch is imported once, its
    import overlaps collection, and its temp dir (pymp-*, kept to the end) is there before any test
    looks."""
    if parallel.is_controller(config):
        parallel.make_shared_dir()
        _SHM_AT_START.update(_leftovers()[0])
        return
    # under pytest's global capture, as at conftest import: the ranks forked later inherit the
    # server's stdout and stderr, which then land in the running test's captured output, not the terminal
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.resume_global_capture()
    try:
        worker_processes.ensure_server()
    finally:
        if capture is not None:
            capture.suspend_global_capture()


def pytest_sessionfinish(session, exitstatus):
    """The controller of an xdist run: fail the run if /dev/shm holds meshtrain's names it did not
    hold at the start (rerun without -n to see which test left them)."""
    if not parallel.is_controller(session.config):
        return
    left = sorted(_leftovers()[0] - _SHM_AT_START)
    shutil.rmtree(os.environ[parallel.SHARED_ENV], ignore_errors=True)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.line("")  # end the progress line
        reporter.write_line(f"left in /dev/shm by the run: {left} (rerun with -n 0 to see which test)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def nothing_left_behind(request):
    """Every test, the failure tests above all (killed ranks, timeouts, bad input), must leave
    /dev/shm and the temp dir as it found them (under xdist: its worker's temp dir; /dev/shm is
    checked once for the run). A test marked ``alone`` has the host to itself meanwhile."""
    with parallel.host_share(alone=request.node.get_closest_marker("alone") is not None):
        shm0, tmp0 = _leftovers()
        yield
        shm1, tmp1 = _leftovers()
    if not parallel.WORKER:
        assert not shm1 - shm0, f"left in /dev/shm: {sorted(shm1 - shm0)}"
    assert not tmp1 - tmp0, f"left in {tempfile.gettempdir()}: {sorted(tmp1 - tmp0)}"


def pytest_collection_modifyitems(config, items):
    """The slowest files first (``_parallel_suite.slowest_first``); tests marked ``cuda`` skip, saying
    why, where torch sees no CUDA device (CI has none)."""
    import torch

    parallel.slowest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none "
                                   f"(run `make gpu-check` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
