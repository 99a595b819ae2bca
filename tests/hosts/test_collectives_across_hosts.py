"""Every collective across simulated hosts (shm inside a host, gloo between): see _collective_worker.

What is covered (each worker checks its own results against plain torch, on every rank):

* 2 hosts x 2 ranks, 1 and 1K elements: every op x every algorithm that accepts the group
  (``algorithms_for(op, "shm")``; "shm" only on a one-host group) + "auto", on the world, an odd
  cross-host group in scrambled order, a reversed cross-host pair and each host's own group;
  float32 sums, plus int64 max and bfloat16 avg for the reductions; algorithm="shm" refused on
  the world; every member's all_reduce results bitwise equal.
* the same matrix at 1M elements (4 MiB per rank; ring steps of 1-4 MiB over links that mix shm
  and gloo: before commit 098f4eb they deadlocked above 2 MiB, and this case and the next failed).
* 16M elements (64 MiB) only for all_reduce, all_gather_into_tensor and reduce_scatter_tensor with
  ring and auto on the world and the odd cross-host group: the bandwidth paths, at a bounded cost.
* 3 hosts of 2, 1 and 2 ranks (an odd world, a one-rank host), 1 and 1K elements, full matrix.

The worker's comm timeout is 20 s, so a hang fails within it instead of at the test's timeout.
"""

from __future__ import annotations

import pytest

from ._util import run_hosts, skip_without_namespaces

M, SIXTEEN_M = 1 << 20, 16 << 20

CASES = {  # the 2x2 cases run as phases of one launch ("--then"): starting the hosts costs more than a phase
    "2x2-small,1M,16M": ((2, 2), ["--sizes", "1,1024", "--dtypes", "--then", "--sizes", str(M), "--then",
                                  "--sizes", str(SIXTEEN_M), "--ops", "all_reduce,all_gather_into_tensor,reduce_scatter_tensor",
                                  "--algorithms", "ring,auto", "--groups", "world,cross_odd"]),
    "3hosts-2+1+2-small": ((2, 1, 2), ["--sizes", "1,1024", "--dtypes"]),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_collective_matrix_across_hosts(case, tmp_path):
    skip_without_namespaces()
    nproc, args = CASES[case]
    scratch = tmp_path / "barrier"
    scratch.mkdir()
    hosts = run_hosts(tmp_path, nproc, ["-m", "tests.hosts._collective_worker", "--hosts", str(len(nproc)),
                                        "--scratch", str(scratch), *args], timeout=230)
    oks = [ln for k in range(hosts.n) for ln in hosts.log(k).splitlines() if ln.startswith("OK rank")]
    assert len(oks) == sum(nproc), oks  # every rank ran its cases to the end
