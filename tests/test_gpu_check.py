"""``make gpu-check`` on a machine without CUDA: exits non-zero at once, says why, writes nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu-check would run for real")
def test_gpu_check_refuses_without_cuda():
    before = (ROOT / "gpu-check").exists()
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "sees no CUDA device" in res.stderr and "NVIDIA GPU" in res.stderr
    assert (ROOT / "gpu-check").exists() == before and not (ROOT / "gpu-check.tmp").exists()
