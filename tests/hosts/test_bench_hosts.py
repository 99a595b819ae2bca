"""``meshtrain bench comm --hosts N``: the bench across simulated hosts against gloo's collective.

Tiny sizes and one trial: this checks the records, the ratios and the refusals, not the timings.
"""

from __future__ import annotations

import json

import pytest

from meshtrain.cli import main

from ._util import skip_without_namespaces


@pytest.mark.timeout(240)
# one op: the bench's plumbing is the same for every op (7 s a launch on 2 cores), and each
# algorithm's results across hosts are checked by test_collectives_across_hosts' matrix
@pytest.mark.parametrize("op, extra", [("all_reduce", "hierarchical,ring")])
def test_bench_hosts_writes_records_with_ratios_to_gloo(op, extra, tmp_path, capsys):
    skip_without_namespaces()
    js, png = tmp_path / "h.json", tmp_path / "h.png"
    rc = main(["bench", "comm", "--hosts", "2", "--world", "2", "--op", op, "--algorithms", extra,
               "--sizes", "1K,4K", "--iters", "1", "--warmup", "0", "--trials", "1",
               "--json", str(js), "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "busbw ratio to gloo" in out and "auto ran" in out
    data = json.loads(js.read_text())
    recs = data["records"]
    algos = ["auto", *extra.split(","), "native"]
    assert {(r["algorithm"], r["size"]) for r in recs} == {(a, s) for a in algos for s in (1024, 4096)}
    gloo = {r["size"]: r for r in recs if r["algorithm"] == "native"}
    for r in recs:
        assert r["wrong"] == 0 and r["time_us"] > 0 and r["busbw"] > 0
        assert (r["hosts"], r["ranks_per_host"], r["world_size"], r["op"]) == (2, 2, 4, op)
        assert r["ratio_to_gloo"] == pytest.approx(r["busbw"] / gloo[r["size"]]["busbw"])
    assert all(r["auto_choice"] for r in recs if r["algorithm"] == "auto")  # what auto ran, per size
    assert data["hosts"] == 2 and data["ranks_per_host"] == [2]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_hosts_refuses_without_namespaces(monkeypatch, tmp_path, capsys):
    import meshtrain.simhosts

    monkeypatch.setattr(meshtrain.simhosts, "namespaces_unavailable", lambda: "simulated hosts need root")
    js = tmp_path / "never.json"
    assert main(["bench", "comm", "--hosts", "2", "--sizes", "1K", "--json", str(js)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--hosts needs simulated hosts" in err[0] and "need root" in err[0]
    assert not js.exists()
