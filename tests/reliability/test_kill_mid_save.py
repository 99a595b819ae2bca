"""A writer killed (SIGKILL) in the middle of a checkpoint save: the previous checkpoint stays
loadable, ``latest`` points at it, and resuming from it gives the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import pytest

from meshtrain import worker_processes
from meshtrain.cli import main
from meshtrain.train.checkpoint import latest_checkpoint

DRIVER = Path(__file__).with_name("_kill_mid_save.py")
ARGS = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
        "--train.seq_len=32", "--train.warmup_steps=2", "--no-progress", "--comm.transport=local",
        "--parallel.dp=1", "--parallel.tp=2", "--train.steps=6", "--checkpoint.every=2"]


def _losses(run: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (before a kill and again after the resume) keeps the last."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _drive(point: str, args: list[str], log: str) -> None:
    """``python _kill_mid_save.py POINT ARGS...``, its output to ``log``: run in a process forked
    from the suite's worker server (worker_processes, torch preloaded), not a new interpreter that
    would import torch again (3-4 s of the test's ~10), and killed by the driver all the same."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [str(DRIVER), point, *args]
    runpy.run_path(str(DRIVER), run_name="__main__")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(["train", f"--out={out}", *ARGS]) == 0
    return _losses(out)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point, async_save", [("shard", False), ("shard", True), ("metadata", False),
                                               ("latest", False)])
def test_writer_killed_mid_save_keeps_the_previous_checkpoint(tmp_path, reference, point, async_save):
    out = tmp_path / "run"
    args = [f"--out={out}", *ARGS, f"--checkpoint.async_save={str(async_save).lower()}"]
    log = tmp_path / "driver.log"
    proc = worker_processes.start(_drive, (point, args, str(log)))
    proc.join(150)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        pytest.fail(f"the driver still ran after 150 s\n{log.read_text()[-3000:]}")
    assert proc.exitcode == -9, log.read_text()[-3000:]  # it really died in the save, by SIGKILL
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000002"
    assert latest_checkpoint(str(root)) == str(root / "step-00000002")
    if point == "latest":  # step 4 was complete and renamed; only the pointer was not moved yet
        assert (root / "step-00000004" / "metadata.json").is_file()
    else:
        assert (root / "step-00000004.tmp").is_dir() and not (root / "step-00000004").exists()

    assert main(["train", *args, "--checkpoint.resume=auto"]) == 0
    resumed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed if "loss" in r][-4:] == [3, 4, 5, 6]  # resumed from step 2
    assert _losses(out) == reference  # bitwise: the previous checkpoint was whole
    assert (root / "latest").read_text().strip() == "step-00000006"
    assert not list(root.glob("*.tmp"))  # the next commit removed the torn directory
