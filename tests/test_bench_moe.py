"""``meshtrain bench moe``: bad input exits 2; a ``--tiny`` run (moe-test on 2 ranks) writes a
well-formed record whose ratios come from its own measurements; the per-expert loop computes what
the grouped experts compute; the dispatcher's clock sees the backward of both calls."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from meshtrain.bench import moe
from meshtrain.cli import main

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("argv,fragment", [
    (["--parts", "dispatch,nope"], "--parts"),
    (["--trials", "0"], "--trials must be >= 1"),
    (["--ep", "3"], "--ep 3 must be >= 2 and divide"),
    (["--experts", "8,x"], "comma list of integers"),
    (["--preset", "test"], "unknown or dense model"),
    (["--json", "/nonexistent-dir/x.json"], "does not exist"),
])
def test_bad_input_exits_2(argv, fragment, capsys):
    assert main(["bench", "moe", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_loop_and_grouped_experts_agree():
    r = moe.run_experts(8, 16, 24, 40, 2, reps=1, trials=1)
    assert r["same"] and r["max_rel_diff"] < 1e-5 and r["rows"] == 80


def test_routing_matrices_cover_every_assignment():
    mats = moe.routing_matrices("moe-test", 2, 2, 8)
    assert len(mats) == 3  # moe-test: 4 layers, the first dense
    for m in mats:
        assert [sum(row) for row in m] == [8 * 2, 8 * 2]  # dropless: each rank's 8 tokens x top-2


def test_tiny_run_writes_ratios_from_its_own_measurements(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", "--tiny", "--trials", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    printed = capsys.readouterr().out
    for part in ("## dispatch", "## experts", "## train"):
        assert part in printed

    (d,) = got["dispatch"]
    assert d["world"] == 2 and d["wrong"] == {"meshtrain-shm": 0, "gloo": 0}
    for name, times in d["trials_round_s"].items():
        assert len(times) == 2 and d["round_s"][name] == pytest.approx(statistics.median(times))
    assert d["ratio"] == pytest.approx(d["round_s"]["gloo"] / d["round_s"]["meshtrain-shm"])
    assert d["trials_ratio"] == pytest.approx([g / m for g, m in zip(d["trials_round_s"]["gloo"],
                                                                     d["trials_round_s"]["meshtrain-shm"])])

    assert [r["experts"] for r in got["experts"]] == [4, 8]
    for r in got["experts"]:
        assert r["same"] is True
        assert r["ratio"] == pytest.approx(r["step_s"]["loop"] / r["step_s"]["grouped"])

    t = got["train"]
    ep2, ep1 = t["layouts"]["2"], t["layouts"]["1"]
    assert ep2["label"] == "ep2 x dp1" and ep1["label"] == "ep1 x dp2" and t["same_losses"] is True
    assert t["ratio"] == pytest.approx(ep2["tokens_per_s"] / ep1["tokens_per_s"])
    assert ep2["tokens_per_s"] == pytest.approx(statistics.median(ep2["trials_tokens_per_s"]))
    assert 0 < ep2["all_to_all_share"] <= ep2["dispatch_share"] < 1  # the all-to-alls lie inside the dispatcher
    assert ep1["all_to_all_share"] == 0  # ep1: no all-to-all at all
    assert all(v > 0 for v in ep2["parts_s"].values())  # forward and backward of dispatch and combine timed
    assert ep2["local_params"] < ep1["local_params"]  # half the experts per rank


def test_dispatch_clock_times_both_calls_forward_and_backward():
    from meshtrain.models.moe import LocalDispatcher

    clock = moe.DispatchClock()
    d = moe.TimedDispatcher(LocalDispatcher(4), clock)
    x = torch.randn(6, 3, requires_grad=True)
    idx = torch.tensor([[0, 1], [2, 3], [1, -1], [0, 3], [2, 2], [3, 0]])
    routed, counts, state = d.dispatch(x, idx)
    y = d.combine(routed * 2, state)
    assert sum(counts) == 11 and y.shape == (12, 3)
    y.sum().backward()
    assert all(v > 0 for v in clock.seconds.values()), clock.seconds
    ref = torch.zeros(6, 3)
    ref += 2 * (idx >= 0).sum(1, keepdim=True)  # each kept assignment adds 2 to its token's gradient
    torch.testing.assert_close(x.grad, ref)
