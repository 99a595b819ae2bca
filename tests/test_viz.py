"""``meshtrain viz schedule`` and the Gantt drawing: PNGs of simulated schedules and measured traces,
bubbles printed, and bad input rejected without a partial PNG."""

import json
import os

import pytest

from meshtrain.cli import main
from meshtrain.errors import DataError
from meshtrain.parallel.pipeline import ScheduleError, bubble_fraction, build_schedule, simulate
from meshtrain.viz import draw_timeline, load_trace, read_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_trace(path, timeline, pp, m, name="1f1b", virtual=1):
    """A trace as the engine writes it: events in seconds, ranks interleaved in wall-clock order."""
    events = [{"rank": r, "kind": a.kind, "microbatch": a.microbatch, "stage": a.stage, "start": s, "end": e}
              for r, acts in enumerate(timeline) for a, s, e in acts]
    events.sort(key=lambda ev: ev["start"])
    path.write_text(json.dumps({"pp": pp, "microbatches": m, "schedule": name, "virtual": virtual,
                                "events": events}))


def _measured_like(pp, m):
    """A 'measured' 1F1B timeline: seconds from a wall-clock origin, with a communication delay after
    every action so that the measured bubble differs from the ideal one."""
    timeline = simulate(build_schedule("1f1b", pp, m), f_time=1.0, b_time=2.0)
    return [[(a, 1000.0 + 0.01 * s * 1.1, 1000.0 + 0.01 * (e * 1.1 - 0.1)) for a, s, e in acts]
            for acts in timeline]


def test_draw_timeline_writes_a_png_and_returns_the_bubble(tmp_path):
    timeline = simulate(build_schedule("interleaved", 2, 4, 2))
    out = tmp_path / "sub" / "g.png"
    old = os.umask(0o022)
    try:
        bubble = draw_timeline(timeline, str(out), title="interleaved")
    finally:
        os.umask(old)
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert out.stat().st_mode & 0o777 == 0o644  # readable as any file the umask allows (not mkstemp's 0600)
    assert bubble == pytest.approx(bubble_fraction(timeline))
    assert [p.name for p in out.parent.iterdir()] == ["g.png"]  # no temporary left behind


def test_draw_timeline_leaves_no_partial_png_when_writing_fails(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def broken_savefig(self, fname, **kw):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    out = tmp_path / "g.png"
    with pytest.raises(OSError, match="disk full"):
        draw_timeline(simulate(build_schedule("afab", 2, 2)), str(out))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, theory", [
    (["--schedule", "1f1b"], "27.3%"),  # 3/11
    (["--schedule", "afab"], "27.3%"),
    (["--schedule", "interleaved", "--virtual", "2"], "15.8%"),  # 3/19
])
def test_cli_draws_the_simulated_schedule_and_prints_both_bubbles(argv, theory, tmp_path, capsys):
    out = tmp_path / "s.png"
    assert main(["viz", "schedule", "--pp", "4", "--microbatches", "8", *argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"theoretical bubble {theory}" in text and f"simulated bubble {theory}" in text
    assert f"wrote {out}" in text
    assert out.stat().st_size > 1000 and out.read_bytes()[:8] == PNG_MAGIC


def test_load_trace_round_trips_a_timeline(tmp_path):
    timeline = _measured_like(3, 4)
    trace = tmp_path / "t.json"
    _write_trace(trace, timeline, 3, 4)
    assert load_trace(str(trace)) == timeline
    meta = read_trace(str(trace))
    assert (meta.pp, meta.microbatches, meta.schedule, meta.virtual) == (3, 4, "1f1b", 1)


def test_cli_draws_a_trace_and_prints_measured_beside_theoretical(tmp_path, capsys):
    timeline = _measured_like(4, 8)
    trace, out = tmp_path / "trace.json", tmp_path / "m.png"
    _write_trace(trace, timeline, 4, 8)
    measured = bubble_fraction(timeline)
    assert measured > 3 / 11 + 0.01  # the delays make it worse than the ideal pipeline
    assert main(["viz", "schedule", "--trace", str(trace), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"measured bubble {measured:.1%}   theoretical 27.3%" in text
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_cli_bad_schedule_name_exits_nonzero_with_the_valid_names(tmp_path, capsys):
    out = tmp_path / "never.png"
    rc = main(["viz", "schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zigzag", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc != 0
    assert "unknown pipeline schedule 'zigzag': choose one of afab, 1f1b, interleaved" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, needle", [
    (["--pp", "4", "--microbatches", "2"], "fewer micro-batches (m=2) than pipeline stages (pp=4)"),
    (["--pp", "4", "--microbatches", "6", "--schedule", "interleaved"], "divisible by pp"),
    (["--pp", "4"], "--pp and --microbatches are required without --trace"),
    (["--trace", "no-such-trace.json"], "cannot read pipeline trace 'no-such-trace.json'"),
])
def test_cli_bad_input_exits_nonzero_with_message(argv, needle, tmp_path, capsys):
    out = tmp_path / "never.png"
    assert main(["viz", "schedule", *argv, "--out", str(out)]) != 0
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_cli_rejects_a_trace_that_disagrees_with_options_or_itself(tmp_path, capsys):
    trace, out = tmp_path / "t.json", tmp_path / "never.png"
    _write_trace(trace, _measured_like(2, 2), 2, 2)
    assert main(["viz", "schedule", "--trace", str(trace), "--pp", "4", "--out", str(out)]) != 0
    assert "--pp 4 disagrees with the trace's 2" in capsys.readouterr().err
    doc = json.loads(trace.read_text())
    doc["events"][0]["rank"] = 1  # stage 0 runs on rank 0, never on rank 1
    trace.write_text(json.dumps(doc))
    with pytest.raises(ScheduleError, match="own the stage"):
        read_trace(str(trace))
    trace.write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        read_trace(str(trace))
    assert not out.exists()
