"""The README's examples run as written (issue 56): every command of its code blocks, and every
complete ``meshtrain`` command in its prose, is either run here or named in ``NOT_HERE`` with the
test that runs it instead, so an example added to the README without a test fails this file.

The ``meshtrain`` commands run as written through the command's own entry point
(``meshtrain.cli.main``, in this process: an interpreter per example would cost the suite seconds
each), in a fresh directory; the ``meshtrain train`` examples with one flag appended:
``--train.steps`` capped at ``CAP`` (a later flag wins), since their 50-120 steps would cost the
suite minutes and the flags, the layout's start and its files are what the README promises. The
resume example continues the first one (its ``my.toml`` is that run's config.toml). The Python
blocks run unchanged in a subprocess each.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CAP = 2

NOT_HERE = {
    ("make", "run"): "the README's main job: a fresh clone runs it before an issue is resolved",
    ("make", "test"): "this suite",
    ("torchrun", "--nnodes"): "names real hosts (HOST0, /shared): tests/hosts/test_training_across_hosts.py runs "
                              "the same `-m meshtrain.train` workers on simulated hosts",
    ("torchrun", "--standalone"): "runs the reader's own my_script.py: tests/comm/test_shm_failures.py runs "
                                  "torchrun --standalone with meshtrain.comm",
    ("meshtrain", "bench"): "a benchmark: tests/test_bench_*.py run each at small sizes",
}
"""Commands not run here, by their first two words, and why."""


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def _commands() -> list[list[str]]:
    """Every command line of the bash blocks (continuations joined, comments dropped), then the
    complete ``meshtrain`` commands quoted in the prose (those without placeholders)."""
    out = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    for quoted in re.findall(r"`(meshtrain [^`]+)`", README):
        argv = shlex.split(quoted)
        if len(argv) > 2 and not any(re.fullmatch(r"[A-Z_]+|\S*\|\S*", a) for a in argv):  # DIR, slurm|k8s
            out.append(argv)
    return out


def _key(argv: list[str]) -> tuple[str, str]:
    name = "meshtrain" if argv[0].endswith("bin/meshtrain") else argv[0]
    return name, argv[1]


def _cli(argv: list[str], cwd: Path, monkeypatch, capfd) -> tuple[str, str]:
    """``argv`` (a ``meshtrain`` command) through the CLI's entry point in ``cwd``: the
    launcher's stdout and stderr, which must hold no error."""
    from meshtrain.cli import main

    monkeypatch.chdir(cwd)
    rc = main(argv[1:])
    out, err = capfd.readouterr()
    assert rc == 0, f"{shlex.join(argv)} exited {rc}:\n{err[-3000:]}"
    assert "Traceback" not in err and "error" not in err.lower(), err[-3000:]
    return out, err


def _steps(run: Path) -> list[int]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["step"] for r in rows if "loss" in r]


def test_every_readme_command_is_run_here_or_named_with_its_test():
    train = [a for a in _commands() if _key(a) == ("meshtrain", "train")]
    others = [a for a in _commands() if _key(a) not in NOT_HERE and _key(a) != ("meshtrain", "train")]
    assert len(train) == 5, train  # the Training block: print-config, pp2 x tp2, resume, own data, MoE
    assert sorted(_key(a) for a in others) == [("meshtrain", "plan"), ("meshtrain", "viz")], others
    assert len(_blocks("python")) == 2


@pytest.mark.timeout(240)
def test_the_training_examples_run_as_written(tmp_path, monkeypatch, capfd):
    cwd = tmp_path / "work"
    cwd.mkdir()
    texts = cwd / "my_texts"  # the reader's own data: a text file and a jsonl file
    texts.mkdir()
    (texts / "a.txt").write_text(Path(json.__file__).read_text())
    (texts / "b.jsonl").write_text("".join(json.dumps({"text": Path(m.__file__).read_text()}) + "\n"
                                           for m in (shutil, shlex, re)))
    printed, exp1, resume, own, moe = [a for a in _commands() if _key(a) == ("meshtrain", "train")]

    assert printed[2:] == ["--print-config"]
    config = tomllib.loads(_cli(printed, cwd, monkeypatch, capfd)[0])
    assert {"model", "data", "train", "parallel", "comm", "checkpoint"} <= set(config)

    _cli([*exp1, f"--train.steps={CAP}"], cwd, monkeypatch, capfd)
    run = cwd / "runs" / "exp1"
    assert _steps(run) == list(range(1, CAP + 1)) and (run / "checkpoints" / f"step-{CAP:08d}").is_dir()

    assert resume[2:4] == ["--config", "my.toml"]
    shutil.copy(run / "config.toml", cwd / "my.toml")  # the run just made, continued from its checkpoint
    _cli([*resume, f"--train.steps={CAP + 2}"], cwd, monkeypatch, capfd)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == str(run / "checkpoints" / f"step-{CAP:08d}"), summary
    assert _steps(run) == list(range(1, CAP + 3))

    assert any(a.startswith("--data.path=my_texts") for a in own)
    _cli([*own, f"--train.steps={CAP}"], cwd, monkeypatch, capfd)
    [dated] = [p for p in (cwd / "runs").iterdir() if p.name != "exp1"]  # runs/<date-time>
    assert _steps(dated) == list(range(1, CAP + 1))
    data = json.loads((dated / "data.json").read_text())["data"]
    assert data["path"] == str(texts) and (dated / "tokenizer.json").is_file()

    shutil.rmtree(cwd / "runs")
    _cli([*moe, f"--train.steps={CAP}"], cwd, monkeypatch, capfd)
    [dated] = list((cwd / "runs").iterdir())
    assert _steps(dated) == list(range(1, CAP + 1)) and (dated / "load_balance.png").is_file()


@pytest.mark.timeout(120)
def test_the_plan_and_viz_examples_run_as_written(tmp_path, monkeypatch, capfd):
    for argv in [a for a in _commands() if _key(a) in (("meshtrain", "plan"), ("meshtrain", "viz"))]:
        assert _cli(argv, tmp_path, monkeypatch, capfd)[0].strip(), argv


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", [0, 1])
def test_the_python_examples_run_as_written(tmp_path, index):
    proc = subprocess.run([sys.executable, "-c", _blocks("python")[index]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if index == 0:  # 4 ranks' ring all-reduce of their rank: 0 + 1 + 2 + 3 on every rank
        assert proc.stdout.count("tensor([6., 6., 6., 6.])") == 4, proc.stdout
