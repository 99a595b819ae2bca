"""``meshtrain bench comm``'s trial shape: every algorithm of a size makes the same number of calls."""

from meshtrain.bench.comm import _same_calls, trial_order


def test_every_algorithm_of_a_size_makes_the_fastest_ones_count_of_calls():
    cases = {"auto": {"iters": 44, "first": 0.0045}, "native": {"iters": 200, "first": 0.0006}}
    _same_calls(cases, {"target_s": 0.2})
    assert [c["iters"] for c in cases.values()] == [200, 200]


def test_a_slow_algorithm_bounds_the_count_to_five_targets_of_its_own():
    cases = {"ring": {"iters": 3, "first": 0.1}, "native": {"iters": 200, "first": 0.001}}
    _same_calls(cases, {"target_s": 0.2})
    assert [c["iters"] for c in cases.values()] == [10, 10]  # 5 x 0.2 s / 0.1 s
    cases = {"ring": {"iters": 3, "first": 2.0}, "native": {"iters": 200, "first": 0.001}}
    _same_calls(cases, {"target_s": 0.2})
    assert [c["iters"] for c in cases.values()] == [3, 3]  # never fewer than 3


def test_a_count_given_on_the_command_line_is_kept():
    cases = {"auto": {"iters": 1, "first": 0.01}, "native": {"iters": 1, "first": 0.001}}
    _same_calls(cases, {"target_s": 0.2, "iters": 1})
    assert [c["iters"] for c in cases.values()] == [1, 1]  # even below the floor of 3


def test_explain_prints_what_auto_kept_and_the_measured_times(monkeypatch, capsys, tmp_path):
    """``--explain`` on ranks as threads with learning switched on: every size shows the
    algorithm kept, measured among its candidates, and auto's timed calls are the kept choice's."""
    import argparse

    from meshtrain.bench import comm_cli

    monkeypatch.setenv("MESHTRAIN_AUTO_TUNE", "1")
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path))  # an empty cache: auto explores, then keeps
    p = argparse.ArgumentParser()
    comm_cli.add_arguments(p)
    args = p.parse_args(["--transport", "local", "--world", "2", "--algorithms", "auto,ring", "--sizes", "4K,64K",
                         "--iters", "3", "--trials", "1", "--explain"])
    assert comm_cli.main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("  all_reduce")]
    assert len(rows) == 2, out
    for row in rows:
        kept = row.split("->")[1].split()[0]
        assert "(measured)" in row and f" {kept} " in row.split(")", 1)[1] + " ", row


def test_each_trial_starts_one_algorithm_later():
    algos = ["auto", "shm", "ring"]
    orders = [trial_order(algos, t) for t in range(4)]
    assert orders == [["auto", "shm", "ring"], ["shm", "ring", "auto"], ["ring", "auto", "shm"],
                      ["auto", "shm", "ring"]]
    assert [o[0] for o in orders[:3]] == algos  # every algorithm leads a trial
    assert trial_order([], 2) == []


def test_explain_shows_how_each_rank_waits_for_torchs_own_op(monkeypatch, capsys):
    """``--explain`` names, per size, the wait mode each rank learned for torch's own op (look or
    park, ``native_wait``), gathered from every rank; sizes with none learned are left out."""
    from meshtrain.bench import comm as bench
    from meshtrain.bench.comm_cli import print_waits
    from meshtrain.comm.algorithms import native_wait
    from meshtrain.comm.local_run import run_local

    small, large = bench.case_count("all_gather", 4096, 4, 2) * 4, bench.case_count("all_gather", 1 << 20, 4, 2) * 4
    assert (small, large) == (4096, 1 << 20)
    assert bench.case_count("all_gather", 4100, 4, 2) * 4 == 4096  # a whole element per rank, as the bench's inputs
    now = [0.0]
    monkeypatch.setattr(native_wait, "clock", lambda: now[0])
    native_wait.reset("learn")
    try:
        for _ in range(native_wait.ROUNDS * 2 * native_wait.BLOCK + 1):  # parking is the faster here
            call = native_wait.begin(small)
            now[0] += 1.0 if call.look else 0.5
            native_wait.record(call)
        assert native_wait.kept(small) is False and native_wait.kept(large) is None
        # ranks as threads share the process's modes: each reports its own through the gather
        got = run_local(2, lambda rank: bench._wait_modes([small, large], 2))
    finally:
        native_wait.reset("learn")
    assert got == [[["park", "park"], ["-", "-"]]] * 2
    print_waits("transport=torch world=2", {4096: got[0][0], 1 << 20: got[0][1]})
    out = capsys.readouterr().out
    assert "4K -> park park" in out and "1M" not in out
    print_waits("transport=torch world=2", {4096: ["-", "-"]})
    assert capsys.readouterr().out == ""  # nothing learned: no section
