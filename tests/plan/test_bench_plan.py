"""``meshtrain bench plan`` in miniature: one (model, layout) pair predicted and trained in the same
test, with generous bounds (the CPU is shared, so only the order of magnitude is checked)."""

from meshtrain.plan.bench import PAIRS, compare, train_args
from meshtrain.plan.clusters import this_host


def test_bench_has_at_least_twelve_pairs_of_distinct_layouts():
    assert len(PAIRS) >= 12 and len(set(PAIRS)) == len(PAIRS)
    args = train_args("tp=2,pp=2,m=2", "10m", 3, 4, 32, "out")
    assert "--parallel.tp=2" in args and "--parallel.pp=2" in args and "--parallel.sequence_parallel=true" in args


def test_predicted_and_measured_step_and_memory_agree_in_magnitude(tmp_path):
    # the fastest of 4 steps after 2 warm-up ones (other work shares the 2 cores: a median once read
    # 11x the prediction), within a factor of 20 either way
    row = compare("test", "dp=1", this_host(), steps=6, global_batch=4, seq=32, out=tmp_path / "run")
    assert 1 / 20 < row["best_step_ratio"] < 20, row
    # the resident set also holds the interpreter and torch, which the prediction leaves out
    assert 0 < row["predicted_mem_bytes"] < row["measured_mem_bytes"], row
