"""``meshtrain bench loop``: bad input exits 2 with a message; one tiny real run writes both sides'
figures and a ratio that is consistent with them, on the CPU and through the accelerator double;
the device is resolved outside any communicator."""

from __future__ import annotations

import json

import pytest
import torch

from meshtrain import comm
from meshtrain.cli import main
from meshtrain.train.trainer import resolve_device

from ._accelerator import as_accelerator

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("argv,fragment", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--warmup", "0"], "--warmup must be >= 1"),
    (["--preset", "test", "--seq", "4096"], "exceeds the test preset's max_seq_len"),
    (["--json", "/nonexistent-dir/x.json"], "does not exist"),
])
def test_bad_input_exits_2(argv, fragment, capsys):
    assert main(["bench", "loop", *argv]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "cpu-as-accelerator"])
def test_tiny_run_reports_both_loops(tmp_path, capsys, monkeypatch, accelerator):
    fused: list[bool | None] = []
    if accelerator:  # the device branches (fused AdamW, backward on its own thread) on CPU tensors
        as_accelerator(monkeypatch)

        class AdamW(torch.optim.AdamW):
            def __init__(self, *args, **kwargs):
                fused.append(kwargs.get("fused"))
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(torch.optim, "AdamW", AdamW)
    out = tmp_path / "loop.json"
    rc = main(["bench", "loop", "--preset", "test", "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "1",
               "--trials", "2", "--json", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    assert len(got["trials"]) == 2 and got["device"] == "cpu"
    for t in got["trials"]:
        assert t["meshtrain_tokens_per_s"] > 0 and t["plain_tokens_per_s"] > 0
        assert t["ratio"] == pytest.approx(t["meshtrain_tokens_per_s"] / t["plain_tokens_per_s"])
        assert 0 < t["meshtrain_mfu"] < 1 and t["plain_mfu"] == pytest.approx(
            t["meshtrain_mfu"] * t["plain_tokens_per_s"] / t["meshtrain_tokens_per_s"])
    assert min(got["ratio_range"]) <= got["median"]["ratio"] <= max(got["ratio_range"])
    assert "ratio meshtrain/plain" in capsys.readouterr().out
    assert (True in fused) == accelerator  # the plain loop's AdamW is fused on a device


def test_the_device_is_resolved_outside_a_communicator(monkeypatch):
    """``bench loop --device cuda`` resolves its device before any communicator exists; on a GPU
    that asked for the communicator's rank and crashed (issue 32). CUDA is faked: only which
    device is chosen is tested."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not comm.is_initialized()
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "3")  # torchrun's: 3 % 2 visible devices
    assert resolve_device("cuda") == torch.device("cuda", 1)
    # inside a communicator its rank chooses (ranks as threads take the GPUs in turn)
    assert comm.run_local(2, lambda rank: resolve_device("cuda")) == [torch.device("cuda", 0), torch.device("cuda", 1)]
