"""``meshtrain bench pipeline``: the engine's measured activations follow the schedule (1F1B holds
pp micro-batches on stage 0, AFAB all m), traces feed ``viz schedule``, bad input exits 2."""

from __future__ import annotations

import json

import pytest

from meshtrain.bench.pipeline import run
from meshtrain.cli import main
from meshtrain.parallel.pipeline.schedule import build_schedule, peak_in_flight


def test_peak_activations_follow_the_schedule():
    pp, m = 2, 6
    recs = {r["schedule"]: r for r in run(pp, m, ("afab", "1f1b"), compute="sleep", steps=1, warmup=0, f_ms=1.0)}
    afab, ofob = recs["afab"]["peak_activation_bytes"], recs["1f1b"]["peak_activation_bytes"]
    per_mb = afab[0] / m  # every micro-batch saves the same bytes on a sleep stage
    for rank in range(pp):
        for name, peaks in (("afab", afab), ("1f1b", ofob)):
            assert peaks[rank] == per_mb * peak_in_flight(build_schedule(name, pp, m)[rank])
    assert ofob[0] / afab[0] == pytest.approx(pp / m)
    for r in recs.values():
        assert 0 <= r["measured_bubble"] < 1 and r["theoretical_bubble"] == pytest.approx((pp - 1) / (m + pp - 1))


def test_model_compute_runs_every_schedule():
    recs = run(2, 2, ("afab", "1f1b", "interleaved"), virtual=2, compute="model", steps=1, warmup=0, layers=4, seq=16)
    assert [r["schedule"] for r in recs] == ["afab", "1f1b", "interleaved"]
    assert all(len(r["trace"]["events"]) == 2 * 2 * 2 * r["virtual"] for r in recs)  # F and B, 2 mb, 2 ranks


def test_cli_writes_json_and_traces_that_viz_draws(tmp_path, capsys):
    out = tmp_path / "pipe.json"
    rc = main(["bench", "pipeline", "--pp", "2", "--microbatches", "4", "--f-ms", "1", "--steps", "1",
               "--warmup", "0", "--json", str(out), "--trace-dir", str(tmp_path)])
    assert rc == 0
    records = json.loads(out.read_text())["records"]
    assert {r["schedule"] for r in records} == {"afab", "1f1b", "interleaved"}
    assert all({"measured_bubble", "theoretical_bubble", "peak_activation_bytes"} <= r.keys() for r in records)
    png = tmp_path / "trace.png"
    assert main(["viz", "schedule", "--trace", str(tmp_path / "pipeline-1f1b.json"), "--out", str(png)]) == 0
    assert png.stat().st_size > 0
    assert "measured" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--pp", "4", "--microbatches", "2", "--schedules", "1f1b"], "fewer micro-batches"),
    (["--schedules", "gpipe"], "gpipe"),
    (["--pp", "0"], "--pp must be >= 1"),
    (["--compute", "model", "--layers", "4"], "--layers 4 cannot fill"),
])
def test_bad_input_exits_2_with_the_reason(argv, msg, capsys):
    assert main(["bench", "pipeline", *argv]) == 2
    assert msg in capsys.readouterr().err
