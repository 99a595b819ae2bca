"""``python -m meshtrain.train`` across 2 simulated hosts x 2 ranks (shm inside a host, gloo between)
gives the losses of the same layout on one host (its ranks as threads: comm.transport = "local").

Tolerance: bitwise where every cross-rank sum of the layout has 2 terms (a + b == b + a in floating
point, whatever algorithm either transport picks); within 1e-5 relative otherwise, where 4-term sums
are added in the order of the algorithm each transport's ``auto`` picks (as test_trainer allows
between layouts).
"""

from __future__ import annotations

import json

import pytest

from meshtrain.cli import main

from ._util import run_hosts, skip_without_namespaces

STEPS = 4
COMMON = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
          "--train.seq_len=32", "--train.warmup_steps=2", f"--train.steps={STEPS}", "--checkpoint.enabled=false"]
# name: (overrides, bitwise?). Plain dp across hosts (buckets all-reduced over gloo between the
# hosts) is dp2xtp2's dp and test_kill_across_hosts' runs; dp4's own launch (11 s) is not repeated.
LAYOUTS = {
    "dp2xtp2": (["--parallel.dp=2", "--parallel.tp=2"], True),
    "pp2xdp2": (["--parallel.dp=2", "--parallel.tp=1", "--parallel.pp=2", "--parallel.microbatches=2"], True),
    "zero3-dp4": (["--parallel.dp=4", "--parallel.tp=1", "--parallel.zero_stage=3"], False),
    "cp2xdp2": (["--parallel.dp=2", "--parallel.tp=1", "--parallel.cp=2"], False),  # grads summed over dp x cp
}


def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_across_two_hosts_matches_one_host(layout, tmp_path):
    skip_without_namespaces()
    overrides, bitwise = LAYOUTS[layout]
    # The one-host reference first: it also builds the tokenizer and token caches the hosts then read.
    assert main(["train", f"--out={tmp_path / 'one'}", "--comm.transport=local", "--no-progress",
                 *COMMON, *overrides]) == 0
    run_hosts(tmp_path, (2, 2), ["-m", "meshtrain.train", "--out", str(tmp_path / "hosts-run"),
                                 "--comm.transport=auto", "--comm.timeout_s=30", *COMMON, *overrides], timeout=170)
    want, got = _metrics(tmp_path / "one"), _metrics(tmp_path / "hosts-run")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["samples"] for r in got] == [r["samples"] for r in want]
    if bitwise:
        assert [r["loss"] for r in got] == [r["loss"] for r in want]
    else:
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
        assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)
