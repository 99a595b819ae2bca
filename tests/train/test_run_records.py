"""A resumed run says what it loaded and keeps a true record; a failed worker is one line
(``meshtrain/train/run_records.py``, issue 56).

Every run here is ``meshtrain train`` in a subprocess on worker processes (the default shm
transport), where the symptoms were seen: a run of 10 steps under dp=2, then a resume from its
step 5 to step 15 under dp=1 tp=2, so steps 6-10 are trained twice and the layout changes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from meshtrain.train.metrics import read_rows, read_steps
from meshtrain.train.run_records import whole_run

SMALL = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
         "--train.seq_len=32", "--train.warmup_steps=1", "--checkpoint.every=5", "--no-progress"]
CLI = "import sys; from meshtrain.cli import main; sys.exit(main(sys.argv[1:]))"


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, "train", f"--out={out}", *SMALL, *extra],
                          capture_output=True, text=True, timeout=90)


def _said(err: str) -> list[str]:
    """The lines of stderr that are not notes (``# ...``), progress bars, or blank."""
    return [line for line in err.splitlines() if line.strip() and not line.startswith("#")
            and not re.search(r"\d+/\d+ \[[\d:<?]+", line)]  # tqdm: " 5/20 [00:01<00:03, ..."


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A run of 10 steps (dp=2), then its resume from step 5 to step 15 under dp=1 tp=2: the run
    directory and the resume's process."""
    run = tmp_path_factory.mktemp("records") / "run"
    first = _train(run, "--train.steps=10", "--parallel.dp=2", "--parallel.tp=1")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _train(run, "--train.steps=15", "--parallel.dp=1", "--parallel.tp=2",
                   f"--checkpoint.resume={run / 'checkpoints' / 'step-00000005'}")
    assert again.returncode == 0, again.stderr[-3000:]
    return run, again


@pytest.mark.timeout(150)
def test_the_resume_names_the_checkpoint_its_layout_and_step(resumed):
    run, proc = resumed
    line = f"# resumed from {run / 'checkpoints' / 'step-00000005'} (layout dp=2, step 5), resharded to layout dp=1 tp=2"
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]


@pytest.mark.timeout(150)
def test_the_summary_counts_this_segments_steps_and_the_runs(resumed):
    run, proc = resumed
    assert "# trained 10 steps (6-15 of 15) of a " in proc.stdout, proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["trained_steps"], summary["first_step"], summary["segment"]) == (15, 10, 6, 2)
    assert summary["resumed_from"] == str(run / "checkpoints" / "step-00000005")


@pytest.mark.timeout(150)
def test_replayed_steps_appear_once_through_the_reader_and_the_plots(resumed):
    run, _ = resumed
    rows = read_rows(run / "metrics.jsonl")
    logged = [r["step"] for r in rows if "event" not in r]
    assert logged == [*range(1, 11), *range(6, 16)]  # the file keeps what happened: 6-10 twice
    steps = read_steps(run / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 16))
    assert [r["segment"] for r in rows] == [1] * 10 + [2] * 10
    assert steps[5:10] == rows[10:15]  # steps 6-10: the resumed segment's, not the first one's
    assert steps[:5] == rows[:5]  # steps 1-5: the first segment's
    plotted, marks = whole_run(run)  # what loss.png and load_balance.png draw: the whole run, each step once
    assert plotted == steps and marks == [5]
    assert (run / "loss.png").stat().st_mtime >= (run / "checkpoints" / "step-00000015").stat().st_mtime


@pytest.mark.timeout(150)
def test_tensorboard_shows_each_replayed_step_once_the_latest(resumed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = resumed
    tb = EventAccumulator(str(run / "tensorboard"))  # reads every events file, as TensorBoard's own loader does
    tb.Reload()
    shown = [(e.step, e.value) for e in tb.Scalars("loss")]
    want = [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in read_steps(run / "metrics.jsonl")]
    assert shown == want  # steps 1-15 once each; 6-10 with the resumed segment's losses


@pytest.mark.timeout(150)
def test_the_planner_line_is_printed_once(resumed):
    _, proc = resumed
    assert len([line for line in proc.stdout.splitlines() if line.startswith("# planner:")]) == 1, proc.stdout


@pytest.mark.timeout(150)
def test_each_segments_config_is_kept(resumed):
    run, _ = resumed
    first = tomllib.loads((run / "configs" / "config.seg1.toml").read_text())
    latest = tomllib.loads((run / "config.toml").read_text())
    assert (first["parallel"]["dp"], first["parallel"]["tp"], first["train"]["steps"]) == (2, 1, 10)
    assert (latest["parallel"]["dp"], latest["parallel"]["tp"], latest["train"]["steps"]) == (1, 2, 15)
    assert sorted(p.name for p in (run / "configs").iterdir()) == ["config.seg1.toml"]


@pytest.mark.timeout(150)
def test_a_truncated_shard_ends_in_one_line_naming_the_earlier_checkpoint(resumed, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(resumed[0], run)
    shard = run / "checkpoints" / "step-00000015" / "rank-00000.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    proc = _train(run, "--train.steps=20", "--parallel.dp=2", "--parallel.tp=1", "--checkpoint.resume=auto")
    said = _said(proc.stderr)
    assert len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = said
    assert proc.stderr.rstrip().endswith(line)  # the last line
    assert line.startswith("meshtrain train: error: worker rank ") and "CheckpointError: shard file " in line, line
    assert f"(exit code {proc.returncode};" in line and proc.returncode == 2, (proc.returncode, line)
    assert f"--checkpoint.resume={run / 'checkpoints' / 'step-00000010'}" in line, line
    rank = int(line.split("worker rank ", 1)[1].split(" ", 1)[0])
    log = run / "logs" / f"rank-{rank}.log"
    assert f"traceback in {log})" in line, line
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "CheckpointError: shard file" in text, text
    assert "Traceback" in (run / "logs" / "agent.log").read_text()  # torch's agent's lines: kept, off the terminal
