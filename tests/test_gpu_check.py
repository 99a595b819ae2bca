"""``make gpu-check`` (scripts/gpu_check.sh). On this machine, without CUDA: it exits non-zero at
once, says why, writes nothing. In a copy of the script with no .venv beside it and a stand-in
``python3`` on PATH: it takes a python3 whose torch sees CUDA as it is (no .venv, no pip, the
checkout on PYTHONPATH) and names it, and it bootstraps .venv only where nothing imports torch."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# A python3 that answers gpu-check's calls as a machine's python3 would, and logs each call as
# "PYTHONPATH|arguments". STUB_TORCH: "cuda" (a CUDA build on a GPU), "cpu" (no GPU) or "none".
STUB_PYTHON = r"""#!/usr/bin/env bash
here=$(dirname "$0")
if [ "$1" = -c ]; then echo "$PYTHONPATH|-c PROBE" >> "$here/calls.log"; else echo "$PYTHONPATH|$*" >> "$here/calls.log"; fi
case "$1 ${2:-}" in
  "-c "*)
    case "$STUB_TORCH" in
      cuda) printf '%s\n' "$0 (Python 3.12.0): torch 2.13.0+cu128, CUDA 12.8, Stub GPU" "hypothesis"; exit 0 ;;
      cpu) printf '%s\n' "$0 (Python 3.12.0): torch 2.13.0+cpu, CUDA None, no CUDA device" ""; exit 1 ;;
      *) printf '%s\n' "$0 (Python 3.12.0): no torch" ""; exit 2 ;;
    esac ;;
  "-m pytest") echo "4 passed in 9.00s" ;;
  "-m meshtrain.cli") echo "ratio meshtrain/plain: median 1.000 over 3 trials" ;;
  "- "*) cat > /dev/null; echo "- skipped: stub" ;;
  *) echo "stub python3: unexpected call: $*" >&2; exit 3 ;;
esac
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu-check would run for real")
def test_gpu_check_refuses_without_cuda():
    before = (ROOT / "gpu-check").exists()
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "sees no CUDA device" in res.stderr and "NVIDIA GPU" in res.stderr
    # then the interpreters it tried (.venv's, python3), each with what it has
    assert any(line.startswith("  ") and ": " in line for line in res.stderr.splitlines())
    assert (ROOT / "gpu-check").exists() == before and not (ROOT / "gpu-check.tmp").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gpu_check_runs_the_script_and_nothing_else():
    # a bootstrap first would create .venv and pip-install torch: no registry on some GPU machines
    res = subprocess.run(["make", "-n", "-C", str(ROOT), "gpu-check"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "bootstrap" not in res.stdout and "bash scripts/gpu_check.sh" in res.stdout


def _run_copy(tmp_path: Path, torch_kind: str) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    """Run a copy of scripts/ (no .venv beside it) with the stand-in python3 first on PATH."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("gpu_check.sh", "bootstrap.sh"):
        shutil.copy(ROOT / "scripts" / name, checkout / "scripts" / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STUB_PYTHON)
    (bin_dir / "git").write_text("#!/bin/sh\necho stubsha\n")  # the report's commit line
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PYTHONPATH")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", STUB_TORCH=torch_kind)
    res = subprocess.run(["bash", str(checkout / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                         timeout=60, env=env)
    log = bin_dir / "calls.log"
    return res, checkout, log.read_text().splitlines() if log.exists() else []


def test_gpu_check_uses_a_cuda_python3_as_it_is(tmp_path):
    res, checkout, calls = _run_copy(tmp_path, "cuda")
    assert res.returncode == 0, res.stderr
    stub = str(tmp_path / "bin" / "python3")
    assert f"gpu-check: python python3 = {stub} (Python 3.12.0): torch 2.13.0+cu128" in res.stdout
    assert "lacks hypothesis (nothing is installed)" in res.stdout
    report = (checkout / "gpu-check" / "report.md").read_text()
    assert f"- interpreter: `python3` = {stub} (Python 3.12.0): torch 2.13.0+cu128, CUDA 12.8, Stub GPU" in report
    assert "- it lacks: hypothesis" in report and "- commit: stubsha" in report
    assert "4 passed" in report and "ratio meshtrain/plain" in report and "- skipped: stub" in report
    assert not (checkout / ".venv").exists()
    paths, args = zip(*(c.split("|", 1) for c in calls))
    assert all(p.split(":")[0] == str(checkout) for p in paths)  # the checkout first on PYTHONPATH
    assert args[0] == "-c PROBE" and args[1].startswith("-m pytest -m cuda")
    assert args[2].startswith("-m meshtrain.cli bench loop") and "--device cuda" in args[2]
    assert all(a.startswith("- ") for a in args[3:6])  # the 8b, fp16 and 8b-offload scripts on stdin
    assert [a.split()[:3] for a in args[6:8]] == [["-m", "meshtrain.cli", "plan"]] * 2
    assert args[8].split()[:5] == ["-m", "meshtrain.cli", "bench", "plan", "--collect"]  # the runs' checks
    assert len(args) == 9  # no pip, no venv


def test_gpu_check_without_cuda_installs_nothing(tmp_path):
    res, checkout, calls = _run_copy(tmp_path, "cpu")
    assert res.returncode == 1 and "sees no CUDA device" in res.stderr
    assert "python3: " in res.stderr and "torch 2.13.0+cpu, CUDA None, no CUDA device" in res.stderr
    assert [c.split("|", 1)[1] for c in calls] == ["-c PROBE"]  # asked once; nothing installed
    assert not (checkout / ".venv").exists() and not (checkout / "gpu-check").exists()


def test_gpu_check_bootstraps_only_where_nothing_imports_torch(tmp_path):
    res, checkout, calls = _run_copy(tmp_path, "none")
    assert res.returncode == 1
    assert "no interpreter imports torch; bootstrapping .venv" in res.stderr
    assert "bootstrapping .venv failed" in res.stderr  # the stand-in cannot make a venv
    assert [c.split("|", 1)[1] for c in calls] == ["-c PROBE", "-m venv .venv"]
