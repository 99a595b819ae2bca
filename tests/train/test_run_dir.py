"""The run directory is owned and self-contained (``meshtrain/train/run_dir.py``): a second run into
a finished run's folder is refused unless it resumes or overwrites, a held lock refuses by name, a
stale one is taken over, two runs started at once do not share a folder; and export, generate and
resume work from any directory with the checkpoint's own tokenizer, even after the cache is emptied.

Ranks are threads (``--comm.transport=local``) except in the tests whose point is a process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.train import run_dir, tokenizer

SMALL = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
         "--train.seq_len=32", "--train.warmup_steps=1", "--no-progress", "--parallel.dp=1", "--parallel.tp=1"]
LOCAL = [*SMALL, "--comm.transport=local"]
CLI = "import sys; from meshtrain.cli import main; sys.exit(main(sys.argv[1:]))"


def _train(out: Path, *extra: str, steps: int = 2) -> int:
    return main(["train", f"--out={out}", f"--train.steps={steps}", *LOCAL, *extra])


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert _train(out) == 0
    return out


@pytest.fixture
def run(finished, tmp_path) -> Path:
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.timeout(30)
def test_a_second_run_into_a_finished_run_is_refused_and_changes_nothing(run, capsys):
    before = _files(run)
    assert _train(run) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if not ln.startswith("# ")]  # the launcher's notes come first
    assert lines[0].startswith("meshtrain train: error: ") and len(lines) == 1, err
    for said in (f"run directory {run} already holds a run", "metrics.jsonl", "checkpoints/",
                 "--checkpoint.resume=auto", "--overwrite=true", "another --out"):
        assert said in err, err
    assert _files(run) == before
    # resuming from a checkpoint of another run into it is refused too: it would not continue this one
    assert _train(run, f"--checkpoint.resume={run.parent / 'elsewhere'}") == 2
    assert "outside it" in capsys.readouterr().err and _files(run) == before


@pytest.mark.timeout(30)
def test_overwrite_starts_it_again_and_resume_continues_it(run, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    old = (run / "checkpoints" / "step-00000002" / "rank-00000.safetensors").read_bytes()
    assert _train(run, "--overwrite=true", "--train.seed=1") == 0
    assert _steps(run) == [1, 2]  # not [1, 2, 1, 2]
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000002"]
    assert (run / "checkpoints" / "step-00000002" / "rank-00000.safetensors").read_bytes() != old
    assert "overwrite = false" in (run / "config.toml").read_text()  # done: resuming it later needs no flag
    assert not (run / run_dir.LOCK).exists()

    assert _train(resumed, "--checkpoint.resume=auto", steps=4) == 0
    assert _steps(resumed) == [1, 2, 3, 4]


@pytest.mark.timeout(30)
def test_a_held_lock_refuses_by_name_and_a_stale_one_is_taken_over(run, tmp_path, capsys):
    lock = tmp_path / "fresh" / run_dir.LOCK
    lock.parent.mkdir()
    here = socket.gethostname()
    live = {"host": here, "pid": os.getpid(), "started": "2025-01-02 03:04:05 +0000", "command": "meshtrain train"}
    lock.write_text(json.dumps(live))
    assert _train(lock.parent) == 2
    err = capsys.readouterr().err
    for said in (f"run directory {lock.parent} is in use by another run", f"pid {os.getpid()} on host {here}",
                 "(started 2025-01-02 03:04:05 +0000: meshtrain train)", f"kill {os.getpid()}"):
        assert said in err, err
    assert json.loads(lock.read_text()) == live and os.listdir(lock.parent) == [run_dir.LOCK]

    # another host's: its pid cannot be judged from here, but a live holder refreshes its lock
    elsewhere = {**live, "host": "another-host"}
    lock.write_text(json.dumps(elsewhere))
    beating = threading.Event()

    def beat() -> None:
        while not beating.wait(0.2):
            os.utime(lock)

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        assert _train(lock.parent) == 2
    finally:
        beating.set()
        beater.join()
    err = capsys.readouterr().err
    assert "pid " in err and "on host another-host" in err and "still refreshes it" in err, err
    assert _train(lock.parent, "--train.steps=1") == 0  # no longer refreshed: its run ended
    err = capsys.readouterr().err
    assert f"taking over the lock {lock} of pid {os.getpid()} on another-host" in err and "its run ended" in err, err
    shutil.rmtree(lock.parent)
    lock.parent.mkdir()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({**live, "pid": dead.pid}))
    assert _train(lock.parent) == 0
    err = capsys.readouterr().err
    assert f"taking over the lock {lock} of pid {dead.pid} on {here}" in err and "no longer runs" in err, err
    assert _steps(lock.parent) == [1, 2] and not lock.exists()  # released at the end


@pytest.mark.timeout(30)
def test_the_lock_goes_with_a_failed_run_and_bad_input_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "bad"
    assert _train(out, "--data.path=nowhere") == 2  # a DataError found after the claim
    assert "does not exist" in capsys.readouterr().err and not out.exists()
    assert _train(out, f"--checkpoint.resume={tmp_path / 'none'}") == 2  # fails in the ranks
    assert "no checkpoint at" in capsys.readouterr().err
    assert not (out / run_dir.LOCK).exists()
    with pytest.raises(Exception, match="overwrite = true would delete"):
        run_dir.check_reusable(_config(out, "--overwrite=true", f"--checkpoint.resume={out / 'checkpoints'}"))


def _config(out: Path, *overrides: str):
    from meshtrain.train.config import load_config

    return load_config(None, [f"--out={out}", *overrides], check=False)


def _semaphores() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.timeout(120)
def test_two_runs_started_at_once_into_one_folder_one_runs_one_is_refused(tmp_path):
    """Real processes over shared memory (the default transport), as the symptom was seen: both
    launchers start together; one trains, the other is refused naming the folder."""
    out = tmp_path / "run"
    args = ["train", f"--out={out}", "--train.steps=2", *SMALL, "--parallel.dp=2", "--comm.transport=shm"]
    before = _semaphores()
    procs = [subprocess.Popen([sys.executable, "-c", CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=100) for p in procs]
    # each launcher's worker server (worker_processes) exits a moment after it, and its resource
    # tracker then unlinks its semaphores: wait for that, as the leftover check follows this test
    deadline = time.monotonic() + 15
    while _semaphores() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], outs
    loser = codes.index(2)
    err = outs[loser][1]
    assert f"run directory {out}" in err, err
    if "in use by another run" in err:  # refused by the lock while the other ran (else it found the finished run)
        assert f"pid {procs[1 - loser].pid} on host {socket.gethostname()}" in err, err
    else:
        assert "already holds a run" in err, err
    assert _steps(out) == [1, 2] and not (out / run_dir.LOCK).exists()


@pytest.mark.timeout(90)
def test_torchrun_rank_0_takes_the_lock_and_refuses_a_held_one(tmp_path):
    """``python -m meshtrain.train`` as torchrun starts it (one rank): a lock held by a live process
    refuses it once every rank has joined, naming the holder."""
    out = tmp_path / "run"
    out.mkdir()
    (out / run_dir.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "x"}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    small = [a for a in SMALL if a != "--no-progress"]  # a `meshtrain train` option, not a config key
    proc = subprocess.run([sys.executable, "-m", "meshtrain.train", f"--out={out}", "--train.steps=2", *small,
                           "--comm.backend=gloo", "--train.device=cpu"], env=env, capture_output=True, text=True,
                          timeout=80)
    assert proc.returncode == 2, proc.stderr
    assert "[rank 0] ConfigError: run directory" in proc.stderr and f"pid {os.getpid()}" in proc.stderr, proc.stderr
    assert os.listdir(out) == [run_dir.LOCK]


@pytest.mark.timeout(60)
def test_export_generate_and_resume_work_from_anywhere_with_the_checkpoints_tokenizer(tmp_path, monkeypatch,
                                                                                       capsys):
    """A run on a relative data path into the default runs/<date-time>, then from another directory,
    with the tokenizer cache emptied: export includes the checkpoint's tokenizer, generate samples
    with it and a resume continues with it (no BPE trained again)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(cache))
    src = tmp_path / "src"
    src.mkdir()
    text = Path(json.__file__).read_text() + Path(shutil.__file__).read_text()
    (src / "corpus.txt").write_text(text)
    monkeypatch.chdir(src)
    assert main(["train", "--train.steps=2", "--data.path=corpus.txt", *LOCAL]) == 0  # out: runs/<date-time>
    [run] = [p.resolve() for p in (src / "runs").iterdir()]
    assert json.loads((run / "data.json").read_text())["data"]["path"] == str(src / "corpus.txt")
    ckpt = run / "checkpoints" / "step-00000002"
    assert (ckpt / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    saved = json.loads((ckpt / "metadata.json").read_text())["extra"]
    assert saved["data"]["path"] == str(src / "corpus.txt") and saved["data"]["fingerprint"]
    assert saved["tokenizer"]["sha256"] == tokenizer.load_tokenizer(ckpt / "tokenizer.json").fingerprint

    shutil.rmtree(cache)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run / "checkpoints"), "--out", "hf"]) == 0
    assert f"tokenizer from {ckpt / 'tokenizer.json'}" in capsys.readouterr().out
    assert (elsewhere / "hf" / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert main(["generate", "--checkpoint", str(run / "checkpoints"), "--prompt", "def ", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")

    trained = tokenizer.STATS["trained"]
    assert main(["train", "--config", str(run / "config.toml"), "--checkpoint.resume=auto", "--train.steps=3",
                 "--no-progress"]) == 0
    assert _steps(run) == [1, 2, 3] and tokenizer.STATS["trained"] == trained
    assert not (elsewhere / "runs").exists()
