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


def test_a_training_hang_leaves_flight_records_that_name_the_rank(tmp_path, monkeypatch, capsys):
    """One rank of a dp2 training run stops issuing collectives at step 2; the others time out,
    dump their flight records into the run directory, and `debug hang` names the rank."""
    from meshtrain.parallel.parallel_model import ParallelModel
    from meshtrain.train.config import load_config
    from meshtrain.train.trainer import train

    real = ParallelModel.forward_backward

    def stalling(self, tokens, targets, **kwargs):
        self._calls = getattr(self, "_calls", 0) + 1
        if self._calls == 2 and comm.get_rank() == 1:
            raise SystemExit  # rank 1 leaves (as if killed) without a word to the others
        return real(self, tokens, targets, **kwargs)

    monkeypatch.setattr(ParallelModel, "forward_backward", stalling)
    config = load_config(None, ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512",
                                "--train.global_batch=4", "--train.seq_len=32", "--train.warmup_steps=1",
                                "--train.steps=3", "--parallel.dp=2", "--parallel.tp=1", f"--out={tmp_path}",
                                "--checkpoint.enabled=false"])

    def fn(rank):
        try:
            train(config, progress=False)
        except CollectiveTimeout:
            return "timed out"
        except SystemExit:
            return "left"
        return "finished"

    assert comm.run_local(2, fn, timeout=3) == ["timed out", "left"]
    assert main(["debug", "hang", str(tmp_path), "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "ranks [1] left no flight record" in out and "ranks [1] never reached" in out
