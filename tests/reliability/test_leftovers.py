"""The launcher's private temp directory: removed after the launch, and a dead launcher's is
removed by the next one (the suite's autouse fixture checks /dev/shm and the temp dir after
every test; these check the mechanism itself)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from meshtrain.train.launch import remove_stale_scratch, scratch_tmpdir


def test_scratch_dir_is_the_tempdir_inside_and_gone_after(monkeypatch):
    monkeypatch.setenv("TMPDIR", tempfile.gettempdir())
    outer = tempfile.gettempdir()
    with scratch_tmpdir() as path:
        assert os.path.isdir(path) and os.path.dirname(path) == outer
        assert os.environ["TMPDIR"] == path and tempfile.gettempdir() == path
        tempfile.mkdtemp(prefix="torchelastic_")  # what the elastic agent leaves behind
        open(os.path.join(path, "pytorch-errorfile-x.pickle"), "wb").close()
    assert not os.path.exists(path)
    assert os.environ["TMPDIR"] == outer and tempfile.gettempdir() == outer


def test_a_dead_launchers_scratch_dir_is_removed_and_a_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"meshtrain-run-{dead.pid}-abc"
    alive = tmp_path / f"meshtrain-run-{os.getpid()}-def"
    other = tmp_path / "someone-elses-dir"
    for d in (gone, alive, other):
        (d / "sub").mkdir(parents=True)
    assert remove_stale_scratch(str(tmp_path)) == [gone.name]
    assert not gone.exists() and alive.exists() and other.exists()
