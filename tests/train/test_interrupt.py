"""An interrupted run keeps its work and says so in one line (``meshtrain/train/interrupt.py``).

SIGTERM to ``meshtrain train`` (what Slurm and Kubernetes send), to one of its worker processes, and
SIGINT to the whole process group (a terminal's Ctrl-C), on processes and on threads: every rank
stops after the same step, that step is saved although ``checkpoint.every = 0``, stderr holds one
line naming it and the resume command and no traceback, and the exit code is 143 / 130. The resume
command continues with the uninterrupted run's losses bitwise. A second Ctrl-C exits at once. The
runs are signalled once ``metrics.jsonl`` has a row, never after a blind sleep."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.train import interrupt

from .test_restart import _workers

STEPS = 30  # ~4 s of training on 4 processes after the first row: the signal lands mid-run
ARGS = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
        "--train.seq_len=32", "--train.warmup_steps=1", f"--train.steps={STEPS}", "--parallel.dp=2",
        "--parallel.tp=2", "--checkpoint.every=0", "--no-progress"]
THREADS = "--comm.transport=local"
LINE = re.compile(r"^meshtrain train: interrupted by (SIGINT \(Ctrl-C\)|SIGTERM) after step (\d+) of (\d+): every rank "
                  r"stopped there and saved checkpoint (\S+); resume with: (.+) \(exit code (\d+)\)$")


def _losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _rows(run: Path) -> int:
    try:
        return len(_losses(run)) if (run / "metrics.jsonl").is_file() else 0
    except ValueError:  # a line caught half-written
        return 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, float]]:
    """The uninterrupted run (threads: every layout and transport gives the same losses bitwise)."""
    out = tmp_path_factory.mktemp("interrupt") / "ref"
    assert main(["train", f"--out={out}", *ARGS, THREADS]) == 0
    return _losses(out)


def _start(out: Path, *extra: str, driver: list[str] | None = None) -> subprocess.Popen:
    """``meshtrain train`` in a session of its own, so that a signal to its process group (Ctrl-C)
    reaches it and its workers, not pytest."""
    cmd = [sys.executable, *(driver or ["-m", "meshtrain.cli", "train"]), f"--out={out}", *ARGS, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _when_training(proc: subprocess.Popen, out: Path, timeout: float = 90) -> None:
    """Return once the run has logged a step (it is then training and has its signal handlers)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and not _rows(out):
        time.sleep(0.01)
    if proc.poll() is not None or not _rows(out):
        proc.kill()
        pytest.fail(f"the run logged no step (exit {proc.poll()}):\n{proc.communicate()[1][-3000:]}")


def _training(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """A run into ``tmp_path/run`` (``_start``), returned once it is training."""
    out = tmp_path / "run"
    proc = _start(out, *extra)
    _when_training(proc, out)
    return proc, out


def _finish(proc: subprocess.Popen, timeout: float = 60) -> str:
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the run did not end within {timeout} s of the signal:\n{proc.communicate()[1][-3000:]}")


def _check_stopped(out: Path, err: str, rc: int, signum: int) -> tuple[int, str]:
    """One line, no traceback, the exit code, and a checkpoint of the step the run stopped at; returns
    (that step, the resume command)."""
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if "interrupted" in x]
    assert len(lines) == 1, err[-3000:]
    m = LINE.match(lines[0])
    assert m, lines[0]
    step = int(m.group(2))
    assert rc == interrupt.exit_code(signum) == int(m.group(6)), err[-3000:]
    assert (m.group(1).startswith("SIGINT")) == (signum == signal.SIGINT)
    assert 1 <= step < STEPS and [s for s, _ in _losses(out)] == list(range(1, step + 1))
    assert m.group(4) == str(out / "checkpoints" / f"step-{step:08d}")
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{step:08d}"
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == [f"step-{step:08d}"]
    return step, m.group(5)


def _resume_matches(command: str, out: Path, reference: list[tuple[int, float]]) -> None:
    """Run the printed resume command here (as threads) and compare every loss with the reference."""
    argv = shlex.split(command)
    assert argv[:2] == ["meshtrain", "train"] and argv[-2:] == [f"--out={out}", "--checkpoint.resume=auto"]
    assert main([*argv[1:], THREADS]) == 0
    assert _losses(out) == reference  # every step once, bitwise


@pytest.mark.timeout(120)
def test_sigterm_to_the_launcher_saves_the_step_it_stopped_at(tmp_path, reference):
    proc, out = _training(tmp_path)
    proc.send_signal(signal.SIGTERM)  # to the launcher alone: it passes the stop on to its workers
    err = _finish(proc)
    _, command = _check_stopped(out, err, proc.returncode, signal.SIGTERM)
    _resume_matches(command, out, reference)


@pytest.mark.timeout(120)
def test_sigterm_to_one_worker_stops_every_rank_after_the_same_step(tmp_path):
    proc, out = _training(tmp_path)
    workers = _workers(proc.pid)
    assert len(workers) == 4, workers
    os.kill(workers[-1], signal.SIGTERM)  # the others learn of it from the all-reduced stop flag
    err = _finish(proc)
    _check_stopped(out, err, proc.returncode, signal.SIGTERM)


@pytest.mark.timeout(120)
def test_ctrl_c_on_processes_saves_and_ends_in_one_line(tmp_path):
    proc, out = _training(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the launcher and every worker get it
    err = _finish(proc)
    _check_stopped(out, err, proc.returncode, signal.SIGINT)


@pytest.mark.timeout(120)
def test_ctrl_c_on_threads_saves_and_the_resume_gives_the_same_losses(tmp_path, reference):
    out = tmp_path / "run"
    proc = _start(out, THREADS)
    _when_training(proc, out)
    os.killpg(proc.pid, signal.SIGINT)
    err = _finish(proc)
    assert "terminate called" not in err and "Aborted" not in err, err[-3000:]
    _, command = _check_stopped(out, err, proc.returncode, signal.SIGINT)
    assert THREADS in shlex.split(command)  # the command as it was given
    _resume_matches(command, out, reference)


def _check_at_once(proc: subprocess.Popen, sent: float) -> str:
    err = _finish(proc, timeout=30)
    took = time.monotonic() - sent
    assert proc.returncode == interrupt.EXIT_SIGINT, err[-3000:]
    assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if "interrupted" in x]
    assert len(lines) == 1 and lines[0].startswith("meshtrain train: interrupted again by SIGINT (Ctrl-C): stopped "
                                                   "at once without saving; there is no checkpoint yet"), err[-3000:]
    assert took < 10, f"the second Ctrl-C took {took:.1f} s"
    return err


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_exits_at_once_on_processes(tmp_path):
    proc, out = _training(tmp_path)
    workers = _workers(proc.pid)
    os.kill(workers[-1], signal.SIGSTOP)  # a rank that never reaches the step boundary: the stop hangs
    proc.send_signal(signal.SIGINT)
    time.sleep(interrupt.DEBOUNCE_S + 0.3)  # past the window in which a second SIGINT is the same Ctrl-C
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _check_at_once(proc, sent)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}")], "a worker outlived the launcher"
    assert not (out / "checkpoints").exists()


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_exits_at_once_on_threads(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, THREADS, driver=[str(Path(__file__).with_name("_slow_stop.py"))])  # its stop saves for 60 s
    _when_training(proc, out)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(interrupt.DEBOUNCE_S + 0.3)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _check_at_once(proc, sent)


def _signal_after_the_first_row(out: Path, signum: int) -> threading.Thread:
    def send() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _rows(out):
            time.sleep(0.005)
        os.kill(os.getpid(), signum)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(60)
def test_with_checkpointing_disabled_the_line_says_nothing_was_saved(tmp_path, capsys):
    out = tmp_path / "run"
    killer = _signal_after_the_first_row(out, signal.SIGTERM)  # in-process: main() holds the handlers
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # one landing after main() must not end pytest
    try:
        rc = main(["train", f"--out={out}", *ARGS, THREADS, "--checkpoint.enabled=false"])
        killer.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert rc == interrupt.EXIT_SIGTERM, err
    (line,) = [x for x in err.splitlines() if "interrupted" in x]
    assert re.match(r"meshtrain train: interrupted by SIGTERM after step \d+ of 30: every rank stopped there, but "
                    r"nothing was saved: checkpointing is disabled \(checkpoint.enabled = false\)", line), line
    assert not (out / "checkpoints").exists()


@pytest.mark.timeout(60)
def test_keep_last_k_removes_older_checkpoints_once_a_newer_one_is_committed(tmp_path):
    out = tmp_path / "run"
    assert main(["train", f"--out={out}", *ARGS[:-2], "--train.steps=5", "--checkpoint.every=1",
                 "--checkpoint.keep=2", "--no-progress", THREADS]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-00000004", "step-00000005"]


def test_the_resume_command_is_the_call_with_out_and_resume_auto():
    got = interrupt.resume_argv(["meshtrain", "train"], "my run.toml",
                                ["--train.lr=1e-3", "--checkpoint.resume", "old/ckpt", "--checkpoint.resume=x",
                                 "--out=elsewhere"], "runs/a b", ["--no-progress"])
    assert shlex.split(got) == ["meshtrain", "train", "--config", "my run.toml", "--train.lr=1e-3", "--no-progress",
                                "--out=runs/a b", "--checkpoint.resume=auto"]


def test_the_lost_rank_advice_names_a_checkpoint_only_when_there_is_one(tmp_path):
    msg = ("rank(s) [3] (host h) lost: no heartbeat for 4s. Rank 0 stops: the job cannot go on without every rank; "
           "see the lost ranks' logs, then restart the job")
    root = tmp_path / "checkpoints"
    assert interrupt.restart_hint(msg, str(root)).endswith("then restart the job (no checkpoint was saved yet, so it "
                                                           "trains from step 1)")
    (root / "step-00000007").mkdir(parents=True)
    (root / "step-00000007" / "metadata.json").write_text("{}")
    assert interrupt.restart_hint(msg, str(root)).endswith(f"restart the job (resuming from the last checkpoint, "
                                                           f"{root / 'step-00000007'}, with --checkpoint.resume=auto)")
    assert interrupt.restart_hint("another error", str(root)) == "another error"
