"""Shared test settings: hypothesis profiles, an isolated calibration cache, a per-test timeout
(pytest-timeout, set in pyproject.toml)."""

import atexit
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

if "MESHTRAIN_CACHE_DIR" not in os.environ:  # an isolated calibration cache, removed at exit
    _cache = tempfile.mkdtemp(prefix="meshtrain-test-cache-")
    os.environ["MESHTRAIN_CACHE_DIR"] = _cache
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

# The ranks of comm.launch.spawn fork from a server that imported torch once: start it now, so its
# import overlaps collection and its temp dir (pymp-*, kept to the end) is there before any test looks.
from meshtrain import worker_processes  # noqa: E402

worker_processes.ensure_server()

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


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test, the failure tests above all (killed ranks, timeouts, bad input), must leave
    /dev/shm and the temp dir as it found them."""
    shm0, tmp0 = _leftovers()
    yield
    shm1, tmp1 = _leftovers()
    assert not shm1 - shm0, f"left in /dev/shm: {sorted(shm1 - shm0)}"
    assert not tmp1 - tmp0, f"left in {tempfile.gettempdir()}: {sorted(tmp1 - tmp0)}"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip, saying why, where torch sees no CUDA device (CI has none)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none "
                                   f"(run `make gpu-check` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
