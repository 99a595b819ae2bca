"""``python -m meshtrain.train`` across 2 simulated hosts x 2 ranks (shm inside a host, gloo between)
gives the losses of the same layout on one host (its ranks as threads: comm.transport = "local").

Tolerance: bitwise where every cross-rank sum of the layout has 2 terms (a + b == b + a in floating
point, whatever algorithm either transport picks); within 1e-5 relative otherwise, where 4-term sums
are added in the order of the algorithm each transport's ``auto`` picks (as test_trainer allows
between layouts).

Every layout runs in one launch of the hosts (``_layouts_worker``: ``python -m meshtrain.train``'s
entry point once per layout, each in a process of its own forked after the imports): starting the
hosts' 6 interpreters costs more than a layout's run, and a launch per layout cost 11-16 s each.
Each layout keeps its own test, its own run directories and its own exit codes.
"""

from __future__ import annotations

import json
import re

import pytest

from meshtrain.cli import main
from meshtrain.simhosts import SimulatedHosts

from ._util import ROOT, skip_without_namespaces

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
    # a mixture of experts whose all-to-all crosses the hosts (ep4 over 2 x 2 ranks), small buckets
    # reduced on their own thread all through backward: 4-term sums
    "moe-dp4-ep4": (["--model.preset=moe-test", "--parallel.dp=4", "--parallel.tp=1", "--parallel.ep=4",
                     "--parallel.bucket_cap_mb=0.004"], False),
}
RANKS = 4


def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """Every layout's one-host reference, then every layout across the hosts in one launch; the
    hosts' exit codes, each host's log and /dev/shm leftovers. Asserts nothing: each test judges its
    own layout."""
    skip_without_namespaces()
    d = tmp_path_factory.mktemp("layouts")
    phases: list[str] = []
    for name, (overrides, _) in LAYOUTS.items():
        # The one-host reference first: it also builds the tokenizer and token caches the hosts then read.
        assert main(["train", f"--out={d / name / 'one'}", "--comm.transport=local", "--no-progress",
                     *COMMON, *overrides]) == 0
        phases += [*(["--then"] if phases else []), name, "--out", str(d / name / "hosts-run"),
                   "--comm.transport=auto", "--comm.timeout_s=30", *COMMON, *overrides]
    with SimulatedHosts(2, 2, [str(ROOT / "tests" / "hosts" / "_layouts_worker.py"), *phases], d / "hosts",
                        cwd=ROOT) as hosts:
        codes = hosts.wait(230)
        shm = [hosts.shm_left(k) for k in range(hosts.n)]
    return d, codes, [hosts.log(k) for k in range(hosts.n)], shm


@pytest.mark.timeout(300)  # the first test's includes the module's launch (every layout's)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_across_two_hosts_matches_one_host(layout, launch):
    d, codes, logs, shm = launch
    overrides, bitwise = LAYOUTS[layout]
    exits = [int(m) for log in logs for m in re.findall(rf"^layout {re.escape(layout)}: rank \d+ exit (-?\d+)$",
                                                          log, re.M)]
    if exits != [0] * RANKS:
        lines = [ln for log in logs for ln in log.splitlines()
                 if re.match(r"(FAIL|ERROR|layout )|meshtrain\.train: error|\S*Error:", ln)]
        tails = "\n".join(f"----- host{k} -----\n{log[-2500:]}" for k, log in enumerate(logs))
        pytest.fail(f"{layout}: the ranks' exit codes {exits}; the workers said:\n" + "\n".join(lines[:40])
                    + f"\n\n{tails}", pytrace=False)
    assert codes == [0, 0], f"the hosts exited {codes} (the worker exits 0 once every layout has run)"
    for k, left in enumerate(shm):
        assert left == [], f"host{k} left {left} in its /dev/shm"
    want, got = _metrics(d / layout / "one"), _metrics(d / layout / "hosts-run")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["samples"] for r in got] == [r["samples"] for r in want]
    if bitwise:
        assert [r["loss"] for r in got] == [r["loss"] for r in want]
    else:
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
        assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)
