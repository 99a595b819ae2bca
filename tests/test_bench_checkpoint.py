"""``meshtrain bench checkpoint``: bad input exits 2 with a message; a tiny real run reports every
rank's peaks of every phase and the ratios to the training peak."""

from __future__ import annotations

import json

import pytest

from meshtrain.cli import main

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("argv,fragment", [
    (["--world", "1"], "--world must be >= 2"),
    (["--batch", "6"], "not a multiple of --world"),
    (["--dim", "100"], "set --dim"),
])
def test_bad_input_exits_2(argv, fragment, capsys):
    assert main(["bench", "checkpoint", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_tiny_run_reports_each_phase_per_rank(tmp_path, capsys):
    out = tmp_path / "ckpt.json"
    rc = main(["bench", "checkpoint", "--world", "2", "--dim", "96", "--layers", "2", "--vocab", "512",
               "--steps", "1", "--batch", "2", "--seq", "16", "--dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text())
    for run, phases in (("train_save_load", ("train", "save", "load")), ("resume", ("load", "train"))):
        assert [r["rank"] for r in rec[run]] == [0, 1]
        for r in rec[run]:
            for p in phases:  # a phase's peak is at least the RSS it started from
                assert r[f"{p}_peak"] >= r[f"{p}_start"] > 0, (run, p, r)
    assert rec["checkpoint_bytes"] > 0 and list(tmp_path.iterdir()) == [out]  # the checkpoint is removed
    text = capsys.readouterr().out
    assert "save/train" in text and "load/train" in text and "max ratio over ranks" in text
