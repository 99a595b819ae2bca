"""``meshtrain bench compat``: bad input exits 2; a tiny run trains the same weights three ways
(torch.distributed over gloo, meshtrain.comm on the torch and on the shm transport)."""

from __future__ import annotations

import json

import pytest

from meshtrain.cli import main

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("argv,fragment", [
    (["--width", "0"], "--width must be >= 1"),
    (["--trials", "0"], "--trials must be >= 1"),
    (["--json", "/nonexistent-dir/x.json"], "does not exist"),
])
def test_bad_input_exits_2(argv, fragment, capsys):
    assert main(["bench", "compat", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_tiny_run_trains_the_same_weights_three_ways(tmp_path, capsys):
    out = tmp_path / "compat.json"
    assert main(["bench", "compat", "--width", "32", "--batch", "4", "--steps", "2", "--warmup", "1",
                 "--trials", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["same_weights"] is True
    assert set(got["ratio"]) == {"torch-gloo", "meshtrain-torch", "meshtrain-shm"}
    for mode, ratio in got["ratio"].items():
        assert ratio == pytest.approx(got["step_s"]["torch-gloo"] / got["step_s"][mode])
    assert "final weights equal in all three: True" in capsys.readouterr().out
