"""``meshtrain debug hang``: from the flight records the ranks dump when a collective times out,
name the rank that never arrived and where every rank stopped."""

from __future__ import annotations

import torch

from meshtrain import comm
from meshtrain.cli import main
from meshtrain.errors import CollectiveTimeout
from meshtrain.train.debug import analyze, dump_flight_record, load_flight_records


def _hang(run_dir, rank_one_dumps: bool):
    def fn(rank):
        t = torch.ones(4)
        comm.all_reduce(t)
        if rank == 1:  # rank 1 goes elsewhere and never joins the second all-reduce
            if rank_one_dumps:
                dump_flight_record(run_dir, rank)
            return "skipped"
        try:
            comm.all_reduce(torch.ones(4))
        except CollectiveTimeout:
            dump_flight_record(run_dir, rank)
            return "timed out"
        return "completed"

    return comm.run_local(3, fn, timeout=1.5)


def test_the_missing_rank_is_named(tmp_path, capsys):
    assert _hang(tmp_path, rank_one_dumps=False) == ["timed out", "skipped", "timed out"]
    records = load_flight_records(tmp_path)
    assert sorted(records) == [0, 2]
    assert main(["debug", "hang", str(tmp_path), "--world", "3"]) == 0
    out = capsys.readouterr().out
    assert "ranks [1] left no flight record" in out
    assert "ranks [1] never reached all_reduce seq" in out and "that [0, 2] waited in" in out
    assert "ranks whose last collective did not complete: [0, 2]" in out


def test_a_rank_that_stopped_early_is_named_with_its_last_collective(tmp_path):
    _hang(tmp_path, rank_one_dumps=True)
    lines = analyze(load_flight_records(tmp_path), 3)
    behind = [line for line in lines if "never reached" in line]
    assert len(behind) == 1 and "ranks [1]" in behind[0]
    first_seq = load_flight_records(tmp_path)[1][-1]["seq"]
    assert any(line.startswith("  rank 1: last all_reduce seq " + str(first_seq)) for line in lines)


def test_no_records_is_a_clear_error(tmp_path, capsys):
    assert main(["debug", "hang", str(tmp_path)]) == 2
    assert "no flight records" in capsys.readouterr().err
