"""The suite's leftover check judges only what meshtrain's runs create, so other programs writing
to the temp dir or /dev/shm meanwhile (pip's tmp*, an editor's swap files) do not fail it."""

from __future__ import annotations

import os
import tempfile

from .conftest import _leftovers


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
