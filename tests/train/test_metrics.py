"""The CPU peak behind MFU (``meshtrain.hardware``): measured by the launcher, kept at its highest, read by
the workers; and the rows of a run's metrics.jsonl read back."""

from __future__ import annotations

import torch

from meshtrain import hardware


def test_cpu_peak_is_measured_once_and_kept_at_its_highest(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    readings = iter([5e10, 3e10])  # the second measurement, on a busier machine, reads lower
    monkeypatch.setattr(hardware, "measure_cpu_peak", lambda: next(readings))
    assert hardware.device_peak(cpu, refresh=False) == 5e10  # no cache yet: a worker measures too
    assert hardware.device_peak(cpu) == 5e10  # the launcher measures again; the lower reading is dropped

    def must_not_measure():
        raise AssertionError("a worker re-measured although the launcher had cached the peak")

    monkeypatch.setattr(hardware, "measure_cpu_peak", must_not_measure)
    assert hardware.device_peak(cpu, refresh=False) == 5e10


def test_read_rows_skips_a_half_written_line_and_reads_no_file_as_none(tmp_path):
    from meshtrain.train.metrics import read_rows

    path = tmp_path / "metrics.jsonl"
    assert read_rows(path) == []
    path.write_text('{"step": 1, "loss": 2.5}\n{"event": "world_change", "step": 1}\n{"step": 2, "lo')
    assert read_rows(path) == [{"step": 1, "loss": 2.5}, {"event": "world_change", "step": 1}]
