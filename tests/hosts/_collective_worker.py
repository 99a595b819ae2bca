"""One rank of test_collectives_across_hosts, under torchrun on simulated hosts (meshtrain/simhosts.py).

Runs every collective x every algorithm that accepts the group (``algorithms_for(op, "shm")``: the
shm collectives only on a one-host group) and "auto" x the sizes given, on the world, on two
subgroups that span hosts (an odd one in scrambled order, a reversed pair) and on each host's own
group. Every rank can compute every rank's input (a deterministic function of its global rank:
``_reference.make_input`` below 1M elements; integer-valued floats from 1M, whose sums are exact in
any order, so results are compared bitwise), so each checks its result against plain torch.
``--ops/--algorithms/--groups`` narrow the matrix.

Prints one ``FAIL`` line per wrong result and goes on; stops at the first error that is not a
wrong value (a timeout, a lost peer: the group may be out of step after it), printing ``ERROR``.
Exits 1 if anything failed, after ``OK rank R: N cases in S s`` otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Callable

import torch

import meshtrain.comm as mc
from meshtrain.comm.algorithms import algorithms_for

from tests.comm._reference import assert_reduced, make_input, reduce_ref
from tests.hosts._say import say

OPS = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "all_to_all", "gather", "scatter", "barrier")
REGISTRY_OP = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
SEED = 7


def layout_groups(hosts: list[str]) -> dict[str, list[int]]:
    """Named groups of global ranks for this world: world, cross-host ones, one per host."""
    p = len(hosts)
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    per_host = list(by_host.values())
    odd = list(reversed(range(p)))
    if p >= 5:  # an odd subgroup in scrambled order: 2+1+2 ranks: [4, 1, 0]
        del odd[1:3]
    elif p % 2 == 0:  # 2+2: [3, 1, 0], a ring of gloo (3->1, 0->3) and shm (1->0) links
        del odd[1]
    groups = {"world": list(range(p)), "cross_odd": odd, "cross_pair": [per_host[1][0], per_host[0][-1]]}
    for ranks in per_host:  # each host's own group, named after its simulated hostname
        if len(ranks) > 1:
            groups["on_" + hosts[ranks[0]].split("/")[0]] = ranks
    return groups


def spans_hosts(ranks: list[int], hosts: list[str]) -> bool:
    return len({hosts[r] for r in ranks}) > 1


def _bits(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes())


EXACT_FROM = 1 << 20  # from this size float32 sums use integer-valued inputs: exact, compared bitwise


def exact_input(seed: int, rank: int, n: int) -> torch.Tensor:
    """Integers in [-1000, 1000) as float32: their sums over a few ranks are exact in any order, so
    every algorithm must match plain torch bitwise (and they cost far less than randn + assert_close
    at 16M elements on a loaded 2-core machine)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int32).to(torch.float32)


def assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got, want):
        bad = (got != want).nonzero().flatten()
        i = int(bad[0]) if bad.numel() else -1
        raise AssertionError(f"{what}: {bad.numel()} of {want.numel()} elements differ, first at {i}: "
                             f"got {got.flatten()[i].item() if i >= 0 else got.shape}, "
                             f"want {want.flatten()[i].item() if i >= 0 else want.shape}")


class Matrix:
    """The cases of one rank; ``run`` records wrong values and raises on anything else."""

    def __init__(self, rank: int, hosts: list[str], scratch: Path) -> None:
        self.rank, self.hosts, self.scratch = rank, hosts, scratch
        self.fails: list[str] = []
        self.verbose = False
        self.cases = 0
        self.bits: list[int] = []  # crcs of this group's all_reduce results, compared across members
        self._cache: dict[tuple, torch.Tensor] = {}

    def x(self, r: int, n: int, dtype: torch.dtype, op: str, exact: bool) -> torch.Tensor:
        """Global rank r's input of n elements (cached: every rank makes every member's input)."""
        key = ("x", r, n, dtype, op == "prod", exact)
        if key not in self._cache:
            self._cache[key] = exact_input(SEED, r, n) if exact else make_input(SEED + n, r, (n,), dtype, op)
        return self._cache[key]

    def check_reduced(self, got: torch.Tensor, xs: list[torch.Tensor], op: str, exact: bool) -> None:
        """``got`` against the plain-torch reduction of ``xs`` (cached: ring and auto share it)."""
        key = ("ref", tuple((x.data_ptr(), x.numel()) for x in xs), op, exact)
        if key not in self._cache:
            if exact:
                want = xs[0].clone()
                for x in xs[1:]:
                    want += x
            else:
                want = reduce_ref(xs, op)
            self._cache[key] = want
        if exact:
            assert_equal(got, self._cache[key], "reduced values")
        else:
            assert_reduced(got, self._cache[key], op, len(xs))

    def clear(self) -> None:
        self._cache.clear()

    def run(self, name: str, fn: Callable[[], None]) -> None:
        self.cases += 1
        t0 = time.monotonic()
        try:
            fn()
            if self.verbose:
                say(f"case rank {self.rank} {time.monotonic() - t0:6.2f}s {name}")
        except AssertionError as exc:
            self.fails.append(f"FAIL rank {self.rank}: {name}: {str(exc)[:300]}")
            say(self.fails[-1])
        except Exception as exc:
            raise RuntimeError(f"{name}: {type(exc).__name__}: {exc}") from exc

    def op_cases(self, op: str, g: mc.Group, granks: list[int], gname: str, n: int, algo: str,
                 dtype: torch.dtype, redop: str, root: int) -> Callable[[], None]:
        """The check of one (op, group, size, algorithm, dtype) on this rank."""
        q, me = len(granks), granks.index(self.rank)
        exact = n >= EXACT_FROM and dtype == torch.float32 and redop == "sum"
        xs = [self.x(r, n, dtype, redop, exact) for r in granks]
        c = max(1, n // q)  # per-destination block of the personalized and reduce-scatter ops

        def parts(r: int) -> list[torch.Tensor]:  # rank r's q blocks, each different
            full = self.x(r, c * q, dtype, redop, exact)
            return [full[j * c:(j + 1) * c] for j in range(q)]

        def all_reduce() -> None:
            t = xs[me].clone()
            mc.all_reduce(t, op=redop, group=g, algorithm=algo)
            self.check_reduced(t, xs, redop, exact)
            self.bits.append(_bits(t))

        def reduce() -> None:
            t = xs[me].clone()
            mc.reduce(t, root, op=redop, group=g, algorithm=algo)
            if self.rank == root:
                self.check_reduced(t, xs, redop, exact)
            else:
                assert_equal(t, xs[me], "a non-root's input changed")

        def broadcast() -> None:
            t = xs[me].clone()
            mc.broadcast(t, root, group=g, algorithm=algo)
            assert_equal(t, xs[granks.index(root)], "not the root's tensor")

        def all_gather() -> None:
            outs = [torch.full((n,), -1, dtype=dtype) for _ in granks]
            mc.all_gather(outs, xs[me], group=g, algorithm=algo)
            bad = [i for i in range(q) if not torch.equal(outs[i], xs[i])]
            assert not bad, f"wrong blocks from group ranks {bad}"

        def all_gather_into_tensor() -> None:
            out = torch.full((q * n,), -1, dtype=dtype)
            mc.all_gather_into_tensor(out, xs[me], group=g, algorithm=algo)
            bad = [i for i in range(q) if not torch.equal(out[i * n:(i + 1) * n], xs[i])]
            assert not bad, f"wrong blocks from group ranks {bad}"

        def reduce_scatter() -> None:
            out = torch.full((c,), -1, dtype=dtype)
            mc.reduce_scatter(out, [b.clone() for b in parts(self.rank)], op=redop, group=g, algorithm=algo)
            self.check_reduced(out, [parts(r)[me] for r in granks], redop, exact)

        def reduce_scatter_tensor() -> None:
            out = torch.full((c,), -1, dtype=dtype)
            mc.reduce_scatter_tensor(out, torch.cat(parts(self.rank)), op=redop, group=g, algorithm=algo)
            self.check_reduced(out, [parts(r)[me] for r in granks], redop, exact)

        def all_to_all() -> None:
            outs = [torch.full((c,), -1, dtype=dtype) for _ in granks]
            mc.all_to_all(outs, [b.clone() for b in parts(self.rank)], group=g, algorithm=algo)
            bad = [j for j in range(q) if not torch.equal(outs[j], parts(granks[j])[me])]
            assert not bad, f"wrong blocks from group ranks {bad}"

        def gather() -> None:
            lst = [torch.full((n,), -1, dtype=dtype) for _ in granks] if self.rank == root else None
            mc.gather(xs[me], lst, dst=root, group=g, algorithm=algo)
            if lst is not None:
                bad = [i for i in range(q) if not torch.equal(lst[i], xs[i])]
                assert not bad, f"wrong blocks from group ranks {bad}"

        def scatter() -> None:
            out = torch.full((c,), -1, dtype=dtype)
            src = [b.clone() for b in parts(root)] if self.rank == root else None
            mc.scatter(out, src, src=root, group=g, algorithm=algo)
            assert_equal(out, parts(root)[me], "not the root's block for this rank")

        def barrier() -> None:  # every member's mark must exist once anyone leaves the barrier
            tag = f"{gname}-{n}"  # the same on every member: one barrier per group and size
            (self.scratch / f"{tag}-{self.rank}").touch()
            mc.barrier(group=g)
            missing = [r for r in granks if not (self.scratch / f"{tag}-{r}").exists()]
            assert not missing, f"left the barrier before ranks {missing} reached it"

        return {"all_reduce": all_reduce, "reduce": reduce, "broadcast": broadcast, "all_gather": all_gather,
                "all_gather_into_tensor": all_gather_into_tensor, "reduce_scatter": reduce_scatter,
                "reduce_scatter_tensor": reduce_scatter_tensor, "all_to_all": all_to_all, "gather": gather,
                "scatter": scatter, "barrier": barrier}[op]

    def check_same_bits(self, g: mc.Group, granks: list[int], what: str) -> None:
        """Every member of ``g`` must hold bitwise the same all_reduce results (crc of them all)."""
        got = [torch.empty(1, dtype=torch.int64) for _ in granks]
        mc.all_gather(got, torch.tensor([zlib.crc32(str(self.bits).encode())]), group=g, algorithm="direct")
        crcs = [int(x) for x in got]

        def same() -> None:
            assert len(set(crcs)) == 1, f"members' all_reduce results differ: crcs {crcs}"

        self.run(f"bitwise-equal all_reduce results {what}", same)
        self.bits = []


def algorithms(op: str, granks: list[int], hosts: list[str], only: str) -> list[str | None]:
    """Every algorithm that accepts this op and group, and "auto" (barrier takes none)."""
    if op == "barrier":
        return [None]
    algos = algorithms_for(REGISTRY_OP.get(op, op), "shm") + ["auto"]
    if spans_hosts(granks, hosts) and "shm" in algos:
        algos.remove("shm")  # needs one host: its refusal is checked on the world instead
    return [x for x in algos if not only or x in only.split(",")]


def run_matrix(m: Matrix, a: argparse.Namespace, groups: dict[str, list[int]], made: dict[str, mc.Group],
               sync: mc.Group) -> None:
    for si, n in enumerate(int(s) for s in a.sizes.split(",")):
        for gname, granks in groups.items():
            if m.rank in granks:
                g = made[gname]
                root = granks[(si + 1) % len(granks)]  # not always group rank 0
                for op in a.ops.split(","):
                    variants = [(torch.float32, "sum")]
                    if a.dtypes and op in ("all_reduce", "reduce", "reduce_scatter_tensor"):
                        variants += [(torch.int64, "max"), (torch.bfloat16, "avg")]
                    for algo in algorithms(op, granks, m.hosts, a.algorithms):
                        for dtype, redop in variants:
                            name = f"{op} group={gname}{granks} n={n} algorithm={algo} {str(dtype)[6:]} {redop}"
                            m.run(name, m.op_cases(op, g, granks, gname, n, algo, dtype, redop, root))
                m.check_same_bits(g, granks, f"group={gname} n={n}")
            # Ranks outside the group wait here, under the sync group's long timeout, rather than
            # in the next group's first collective, whose short timeout is for hangs, not for this.
            mc.barrier(group=sync)
        m.clear()
    if "world" in groups:  # the shm collectives need one host: refused, not hung, on the world
        try:
            mc.all_reduce(torch.ones(4), group=made["world"], algorithm="shm")
            m.fails.append(f"FAIL rank {m.rank}: algorithm='shm' on a cross-host group was not refused")
        except ValueError as exc:
            if "one host" not in str(exc):
                m.fails.append(f"FAIL rank {m.rank}: the refusal of algorithm='shm' says {exc}")
        mc.barrier()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True, help="comma-separated element counts")
    ap.add_argument("--hosts", type=int, required=True, help="how many distinct hosts the ranks must see")
    ap.add_argument("--scratch", required=True, help="a directory every simulated host sees (for barrier)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--algorithms", default="", help="restrict to these (default: all that accept the group)")
    ap.add_argument("--groups", default="", help="restrict to these group names (default: all)")
    ap.add_argument("--dtypes", action="store_true", help="also int64 max and bfloat16 avg for the reductions")
    ap.add_argument("--timeout", type=float, default=20.0, help="every collective's timeout (s)")
    ap.add_argument("--verbose", action="store_true", help="print every case with its time")
    # "--then" separates phases (their own sizes, ops, ...) run one after another in one launch:
    # starting the simulated hosts costs more than most phases
    segments: list[list[str]] = [[]]
    for arg in sys.argv[1:]:
        segments.append([]) if arg == "--then" else segments[-1].append(arg)
    a = ap.parse_args(segments[0])
    phases = [a] + [ap.parse_args([*seg, "--hosts", str(a.hosts), "--scratch", a.scratch]) for seg in segments[1:]]

    comm = mc.init(transport="auto", timeout=a.timeout, init_timeout=60)
    rank, hosts = mc.get_rank(), list(comm.transport.hosts)
    assert comm.transport.kind == "shm" and comm.transport.remote is not None, "auto did not pick shm + gloo"
    assert len(set(hosts)) == a.hosts, f"expected {a.hosts} distinct hosts, the ranks see {sorted(set(hosts))}"
    every = layout_groups(hosts)
    made = {name: mc.new_group(ranks) for name, ranks in every.items()}  # every rank makes every group
    sync = mc.new_group(list(range(len(hosts))), timeout=600)
    m = Matrix(rank, hosts, Path(a.scratch))
    m.verbose = a.verbose
    t0 = time.monotonic()
    try:
        for phase in phases:
            groups = {k: v for k, v in every.items() if not phase.groups or k in phase.groups.split(",")}
            run_matrix(m, phase, groups, made, sync)
    except Exception:  # noqa: BLE001 - reported, then the process ends without waiting on its peers
        say(f"ERROR rank {rank} after {time.monotonic() - t0:.1f}s, {m.cases} cases: "
            f"{traceback.format_exc(limit=3)}")
        os._exit(1)
    mc.destroy()
    if m.fails:
        say(f"FAILED rank {rank}: {len(m.fails)} of {m.cases} cases")
        return 1
    say(f"OK rank {rank}: {m.cases} cases in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
