"""``meshtrain bench loop``: bad input exits 2 with a message; one tiny real run writes both sides'
figures and a ratio that is consistent with them."""

from __future__ import annotations

import json

import pytest

from meshtrain.cli import main

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


def test_tiny_run_reports_both_loops(tmp_path, capsys):
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
