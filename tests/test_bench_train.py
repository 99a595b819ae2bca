"""``meshtrain bench train``: bad input exits 2 with a message; one real tiny run produces a record."""

from __future__ import annotations

import json

import pytest

from meshtrain.cli import main

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("argv,fragment", [
    (["--impls", "meshtrain-ddp"], "unknown implementation"),
    (["--world", "two"], "comma list of integers"),
    (["--world", "0"], "world sizes must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--preset", "test", "--seq", "4096"], "exceeds"),
    (["--json", "/nonexistent-dir/x.json"], "does not exist"),
])
def test_bad_input_exits_2(argv, fragment, capsys):
    assert main(["bench", "train", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_tiny_compare_run_writes_records(tmp_path, capsys):
    out = tmp_path / "train.json"
    rc = main(["bench", "train", "--compare", "--impls", "meshtrain-zero3,meshtrain-dp-shm", "--world", "2", "--preset", "test",
               "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "1", "--json", str(out)])
    assert rc == 0
    recs = {r["impl"]: r for r in json.loads(out.read_text())["records"]}
    assert set(recs) == {"meshtrain-zero3", "torch-fsdp2", "meshtrain-dp-shm", "torch-ddp"}
    shm = recs["meshtrain-dp-shm"]  # DataParallel on the shm transport, against DDP on gloo
    assert shm["peer"] == "torch-ddp" and shm["loss"] == pytest.approx(recs["torch-ddp"]["loss"], rel=1e-4)
    assert any(c.endswith(":shm") for c in shm["collectives"]), shm["collectives"]
    z, f = recs["meshtrain-zero3"], recs["torch-fsdp2"]
    assert z["peer"] == "torch-fsdp2" and z["ratio_to_peer"] == pytest.approx(z["tokens_per_s"] / f["tokens_per_s"])
    assert z["peak_mem_bytes"] > 0 and z["tokens_per_s"] > 0
    assert z["loss"] == pytest.approx(f["loss"], rel=1e-4)  # same model, data and optimizer
    assert "meshtrain-zero3" in capsys.readouterr().out
