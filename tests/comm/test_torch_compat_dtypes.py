"""Every dtype gloo moves, ReduceOp BAND/BOR/BXOR, all_to_all_single, Work.wait(timeout) and
get_future, differentially: one scenario written against a ``dist`` module runs under
torch.distributed (gloo processes) and under meshtrain.comm (threads; processes on the torch
transport through ``init_process_group``; processes on the shm transport), every meshtrain
algorithm of each operation included. Results must equal gloo's and plain torch's (computed here
from the same inputs); wrong calls must raise an exception of torch's type (meshtrain's messages
may be better, never of another class)."""

from __future__ import annotations

import datetime
from typing import Any, Callable

import pytest
import torch

import meshtrain.comm as mc
from meshtrain.comm.launch import spawn

from .test_torch_compat import run_procs

pytestmark = pytest.mark.timeout(120)

P = 3  # odd: averages of the inputs below are exact, and power-of-two folds run
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
COMPLEX = [torch.complex64, torch.complex128]
# gloo: "Invalid scalar type" for int16 everywhere and complex in gather; meshtrain moves both
GLOO_REFUSES = (torch.int16,)
OPS = {d: ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"] for d in INTS}
OPS.update({d: ["SUM", "PRODUCT", "MIN", "MAX", "AVG"] for d in FLOATS})
OPS.update({d: ["SUM", "AVG"] for d in COMPLEX})
# Every algorithm runs for every dtype on threads; in processes (slower: a store round trip per
# metadata check on the torch transport) for these dtypes, and auto, ring, native/shm for the others.
SWEEP = (torch.uint8, torch.int16, torch.bool, torch.bfloat16, torch.complex64)
N = 7  # elements per rank (and per reduce_scatter block): chunks of uneven sizes


def _name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def data(dtype: torch.dtype, op: str, rank: int, n: int = N) -> torch.Tensor:
    """Rank ``rank``'s input: full-range integers (sums and products wrap alike), small floats
    (exact sums and products even in bfloat16), and for AVG base + (rank - 1) * step, whose mean
    over 3 ranks is exact."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + len(op))
    if op == "AVG":  # the same base and step on every rank
        same = torch.Generator().manual_seed(17 * n)
        base, step = (torch.randint(-4, 5, (2, n), generator=same).double() for _ in range(2))
        x = base + (rank - 1) * step
        return (torch.complex(x[0], x[1]) if dtype.is_complex else x[0]).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        re, im = (torch.randint(-4, 5, (n,), generator=g).double() for _ in range(2))
        return torch.complex(re, im).to(dtype)
    if dtype.is_floating_point:
        hi = 2 if op == "PRODUCT" else 8
        return torch.randint(-hi, hi + 1, (n,), generator=g).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dtype)


def reference(dtype: torch.dtype, op: str, n: int = N) -> torch.Tensor:
    """The reduction over the P ranks' inputs with plain torch (no communication)."""
    xs = [data(dtype, op, r, n) for r in range(P)]
    fold: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "SUM": (lambda a, b: a | b) if dtype == torch.bool else (lambda a, b: a + b),
        "AVG": lambda a, b: a + b,
        "PRODUCT": (lambda a, b: a & b) if dtype == torch.bool else (lambda a, b: a * b),
        "MIN": torch.minimum, "MAX": torch.maximum,
        "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor,
    }
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = fold[op](acc, x).to(dtype)  # the dtype's own arithmetic: integers wrap
    return acc / P if op == "AVG" else acc


# ------------------------------------------------------------------------------------ scenario


def _algos(dist: Any, op: str, dtype: torch.dtype) -> list[str | None]:
    """Every meshtrain algorithm of ``op`` on this transport (native only for what gloo moves);
    None (no keyword) for torch."""
    if not hasattr(dist, "run_local"):
        return [None]
    from meshtrain.comm.algorithms import algorithms_for

    kind = dist.current().transport.kind
    names = algorithms_for(op, kind) if kind == "local" or dtype in SWEEP else ["auto", "ring", "native", "shm"]
    names = [a for a in names if a in algorithms_for(op, kind)]
    return [a for a in names if a != "native" or _gloo(dtype)]


def _kw(algo: str | None) -> dict[str, str]:
    return {} if algo is None else {"algorithm": algo}


def _gloo(dtype: torch.dtype) -> bool:
    return dtype not in GLOO_REFUSES


def reductions(dist: Any, rank: int, torch_gloo: bool) -> dict[str, Any]:
    """all_reduce, reduce (to rank 1), reduce_scatter_tensor and reduce_scatter for every dtype and
    op, with every algorithm; key 'coll/dtype/op' -> {algorithm: output}."""
    out: dict[str, Any] = {}
    for dtype, ops in OPS.items():
        if torch_gloo and not _gloo(dtype):
            continue
        for op in ops:
            rop = getattr(dist.ReduceOp, op)
            key = f"{_name(dtype)}/{op}"
            res: dict[str, dict[str, torch.Tensor]] = {}
            for algo in _algos(dist, "all_reduce", dtype):
                t = data(dtype, op, rank)
                dist.all_reduce(t, op=rop, **_kw(algo))
                res.setdefault("all_reduce", {})[str(algo)] = t
            for algo in _algos(dist, "reduce", dtype):
                t = data(dtype, op, rank)
                dist.reduce(t, 1, op=rop, **_kw(algo))
                if rank == 1:  # the others' tensors are unspecified in torch
                    res.setdefault("reduce", {})[str(algo)] = t
            for algo in _algos(dist, "reduce_scatter", dtype):
                full = data(dtype, op, rank, N * P)
                o = torch.empty(N, dtype=dtype)
                dist.reduce_scatter_tensor(o, full, op=rop, **_kw(algo))
                res.setdefault("reduce_scatter_tensor", {})[str(algo)] = o
                o2 = torch.empty(N, dtype=dtype)
                dist.reduce_scatter(o2, list(full.chunk(P)), op=rop, **_kw(algo))
                res.setdefault("reduce_scatter", {})[str(algo)] = o2
            for coll, by_algo in res.items():
                out[f"{coll}/{key}"] = by_algo
    return out


def movement(dist: Any, rank: int, torch_gloo: bool) -> dict[str, Any]:
    """broadcast, all_gather(_into_tensor), gather, scatter, all_to_all, all_to_all_single (equal
    and uneven splits) and a batch_isend_irecv ring, for every dtype."""
    out: dict[str, Any] = {}
    for dtype in INTS + FLOATS + COMPLEX:
        if torch_gloo and not _gloo(dtype):
            continue
        d, x = _name(dtype), data(dtype, "SUM", rank)
        t = x.clone()
        dist.broadcast(t, 1)
        out[f"broadcast/{d}"] = t
        outs = [torch.empty_like(x) for _ in range(P)]
        dist.all_gather(outs, x)
        out[f"all_gather/{d}"] = outs
        whole = torch.empty(P * N, dtype=dtype)
        dist.all_gather_into_tensor(whole, x)
        out[f"all_gather_into_tensor/{d}"] = whole
        if not (torch_gloo and dtype.is_complex):  # gloo's gather: "Invalid scalar type"
            lst = [torch.empty_like(x) for _ in range(P)] if rank == 2 else None
            dist.gather(x, lst, dst=2)
            out[f"gather/{d}"] = lst
        mine = torch.empty(2, dtype=dtype)
        dist.scatter(mine, list(data(dtype, "SUM", rank, 2 * P).chunk(P)) if rank == 0 else None, src=0)
        out[f"scatter/{d}"] = mine
        a2a = [torch.empty(2, dtype=dtype) for _ in range(P)]
        dist.all_to_all(a2a, list(data(dtype, "SUM", rank, 2 * P).chunk(P)))
        out[f"all_to_all/{d}"] = a2a
        single = torch.empty(2 * P, 3, dtype=dtype)
        dist.all_to_all_single(single, data(dtype, "SUM", rank, 6 * P).view(2 * P, 3))
        out[f"all_to_all_single/{d}"] = single
        # uneven: rank r sends j + 1 rows to rank j, so it receives r + 1 rows from each rank
        rows_in = [j + 1 for j in range(P)]
        uneven = torch.empty((rank + 1) * P, 2, dtype=dtype)
        dist.all_to_all_single(uneven, data(dtype, "SUM", rank, 2 * sum(rows_in)).view(-1, 2),
                               [rank + 1] * P, rows_in)
        out[f"all_to_all_single_uneven/{d}"] = uneven
        recv = torch.empty_like(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, (rank - 1) % P),
                                        dist.P2POp(dist.isend, x, (rank + 1) % P)])
        for w in works:
            w.wait()
        out[f"ring/{d}"] = recv
    return out


def futures(dist: Any, rank: int) -> dict[str, Any]:
    """Async collectives: get_future()'s values, then(), and wait(timeout) as a timedelta."""
    out: dict[str, Any] = {}
    t = data(torch.int32, "BXOR", rank)
    work = dist.all_reduce(t, op=dist.ReduceOp.BXOR, async_op=True)
    chained = work.get_future().then(lambda f: f.value()[0] + 1)
    out["wait"] = work.wait(timeout=datetime.timedelta(seconds=20))
    out["all_reduce"] = work.get_future().wait()
    out["then"] = chained.wait()
    outs = [torch.empty(N, dtype=torch.uint8) for _ in range(P)]
    out["all_gather"] = dist.all_gather(outs, data(torch.uint8, "SUM", rank), async_op=True).get_future().wait()
    b = data(torch.bool, "SUM", rank)
    out["broadcast"] = dist.broadcast(b, 2, async_op=True).get_future().wait()
    # (int8: for complex, torch's future holds its view_as_real copy, meshtrain's the output itself)
    single = torch.empty(P, dtype=torch.int8)
    w = dist.all_to_all_single(single, data(torch.int8, "SUM", rank, P), async_op=True)
    out["all_to_all_single"] = w.get_future().wait()
    out["barrier"] = dist.barrier(async_op=True).get_future().wait()
    return out


def bad_calls(dist: Any) -> dict[str, str | None]:
    """Wrong calls (the same on every rank); the name of the exception each raises."""
    def raises(fn: Callable[[], Any]) -> str | None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the class is the result
            return f"{type(exc).__module__}.{type(exc).__qualname__}"
        return None

    f, i32, c64 = torch.ones(4), torch.ones(4, dtype=torch.int32), torch.ones(4, dtype=torch.complex64)
    ro = dist.ReduceOp
    return {
        "all_reduce float BAND": raises(lambda: dist.all_reduce(f.clone(), op=ro.BAND)),
        "all_reduce float BOR": raises(lambda: dist.all_reduce(f.clone(), op=ro.BOR)),
        "all_reduce bf16 BXOR": raises(lambda: dist.all_reduce(f.bfloat16(), op=ro.BXOR)),
        "reduce float BAND": raises(lambda: dist.reduce(f.clone(), 0, op=ro.BAND)),
        "reduce_scatter_tensor float BXOR": raises(
            lambda: dist.reduce_scatter_tensor(torch.empty(4 // dist.get_world_size()), f.clone(), op=ro.BXOR)),
        "all_reduce int AVG": raises(lambda: dist.all_reduce(i32.clone(), op=ro.AVG)),
        "all_reduce complex MAX": raises(lambda: dist.all_reduce(c64.clone(), op=ro.MAX)),
        "all_reduce complex PRODUCT": raises(lambda: dist.all_reduce(c64.clone(), op=ro.PRODUCT)),
        "reduce complex MIN": raises(lambda: dist.reduce(c64.clone(), 0, op=ro.MIN)),
        "all_to_all_single split count": raises(
            lambda: dist.all_to_all_single(torch.empty(4), f, [1, 1, 1, 1, 0], [1, 1, 1, 1, 0])),
        "all_to_all_single split sum": raises(
            lambda: dist.all_to_all_single(torch.empty(dist.get_world_size()), f, None,
                                           [5] + [0] * (dist.get_world_size() - 1))),
        "all_to_all_single dtypes": raises(lambda: dist.all_to_all_single(torch.empty(4, dtype=torch.int64), f)),
        "all_to_all_single output": raises(lambda: dist.all_to_all_single([0.0] * 4, f)),
    }


def scenario(dist: Any, rank: int, torch_gloo: bool | None = None) -> dict[str, Any]:
    """What each rank saw; ``torch_gloo``: the module is torch.distributed (skip what gloo refuses)."""
    gloo = (not hasattr(dist, "run_local")) if torch_gloo is None else torch_gloo
    res = {"reductions": reductions(dist, rank, gloo), "movement": movement(dist, rank, gloo),
           "futures": futures(dist, rank)}
    if not gloo:  # meshtrain checks before communicating, so its group goes on; gloo's may not
        res["errors"] = bad_calls(dist)
        if dist.current().transport.kind == "torch":  # torch's own collective cannot take int16
            try:
                dist.all_reduce(torch.ones(2, dtype=torch.int16), algorithm="native")
                res["native_int16"] = None
            except RuntimeError as exc:
                res["native_int16"] = str(exc)
    return res


def _shm_scenario(rank: int) -> dict[str, Any]:
    assert mc.current().transport.kind == "shm"
    return scenario(mc, rank)


# --------------------------------------------------------------------------------- comparison


def _same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a} vs {b}"
        # gloo's bool sum leaves the count in the byte (3 reads as True): compare values, not bytes
        assert a.tolist() == b.tolist(), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def check_against_plain_torch(res: dict[str, Any], rank: int) -> None:
    """Every reduction (each algorithm) and movement against values computed here."""
    for key, by_algo in res["reductions"].items():
        coll, dname, op = key.split("/")
        dtype = getattr(torch, dname)
        if coll in ("all_reduce", "reduce"):
            want = reference(dtype, op)
        else:
            want = reference(dtype, op, N * P)[rank * N:(rank + 1) * N]
        for algo, got in by_algo.items():
            _same(want, got, f"rank {rank} {key} [{algo}]")
    for dtype in INTS + FLOATS + COMPLEX:
        d = _name(dtype)
        if f"broadcast/{d}" not in res["movement"]:
            continue
        mv = {k.rsplit("/", 1)[0]: v for k, v in res["movement"].items() if k.endswith(f"/{d}")}
        xs = [data(dtype, "SUM", r) for r in range(P)]
        _same(xs[1], mv["broadcast"], f"rank {rank} broadcast {d}")
        _same(xs, mv["all_gather"], f"rank {rank} all_gather {d}")
        _same(torch.cat(xs), mv["all_gather_into_tensor"], f"rank {rank} all_gather_into_tensor {d}")
        if "gather" in mv:
            _same(xs if rank == 2 else None, mv["gather"], f"rank {rank} gather {d}")
        _same(data(dtype, "SUM", 0, 2 * P).chunk(P)[rank], mv["scatter"], f"rank {rank} scatter {d}")
        _same([data(dtype, "SUM", r, 2 * P).chunk(P)[rank] for r in range(P)], mv["all_to_all"], f"all_to_all {d}")
        _same(torch.cat([data(dtype, "SUM", r, 6 * P).view(2 * P, 3)[2 * rank:2 * rank + 2] for r in range(P)]),
              mv["all_to_all_single"], f"rank {rank} all_to_all_single {d}")
        start = sum(j + 1 for j in range(rank))
        _same(torch.cat([data(dtype, "SUM", r, 2 * sum(range(1, P + 1))).view(-1, 2)[start:start + rank + 1]
                         for r in range(P)]), mv["all_to_all_single_uneven"], f"rank {rank} uneven {d}")
        _same(xs[(rank - 1) % P], mv["ring"], f"rank {rank} ring {d}")
    fut = res["futures"]
    xor = reference(torch.int32, "BXOR")
    assert fut["wait"] is True
    _same([xor], fut["all_reduce"], "future all_reduce")
    _same(xor + 1, fut["then"], "future then")
    _same([data(torch.uint8, "SUM", r) for r in range(P)], fut["all_gather"], "future all_gather")
    _same([data(torch.bool, "SUM", 2)], fut["broadcast"], "future broadcast")
    _same([torch.stack([data(torch.int8, "SUM", r, P)[rank] for r in range(P)])],
          fut["all_to_all_single"], "future all_to_all_single")
    assert fut["barrier"] == []


def compare_with_gloo(gloo: dict[str, Any], ours: dict[str, Any], rank: int) -> None:
    """Each meshtrain algorithm's result equals gloo's wherever gloo has one."""
    for key, by_algo in gloo["reductions"].items():
        for algo, got in ours["reductions"][key].items():
            _same(by_algo["None"], got, f"rank {rank} {key} [{algo}] vs gloo")
    for key, value in gloo["movement"].items():
        _same(value, ours["movement"][key], f"rank {rank} {key} vs gloo")
    _same(gloo["futures"], ours["futures"], f"rank {rank} futures vs gloo")


def _torch_bad_call_types() -> dict[str, str | None]:
    """torch.distributed's exceptions for the wrong calls, on a 1-rank gloo world in this process
    (a failed gloo collective can leave a multi-rank group unusable)."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        return bad_calls(tdist)
    finally:
        tdist.destroy_process_group()


def _check_errors(torch_types: dict[str, str | None], ours: dict[str, str | None], where: str) -> None:
    import builtins

    def cls(name: str) -> type:
        mod, _, qual = name.rpartition(".")
        if mod == "builtins":
            return getattr(builtins, qual)
        import importlib

        obj: Any = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj

    for case, want in torch_types.items():
        assert want is not None, f"torch accepted {case!r}: not a wrong call"
        got = ours[case]
        assert got is not None and issubclass(cls(got), cls(want)), f"{where} {case}: raised {got}, torch {want}"


# -------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def gloo_results() -> list[dict[str, Any]]:
    res = run_procs("torch.distributed", scenario, world=P)
    for r, per_rank in enumerate(res):
        check_against_plain_torch(per_rank, r)  # gloo itself against plain torch
    return res


@pytest.fixture(scope="module")
def torch_bad_types() -> dict[str, str | None]:
    return _torch_bad_call_types()


def test_threads_match_gloo_and_plain_torch(gloo_results, torch_bad_types) -> None:
    ours = mc.run_local(P, lambda r: scenario(mc, r), timeout=60)
    for r in range(P):
        check_against_plain_torch(ours[r], r)  # int16 and every algorithm included
        compare_with_gloo(gloo_results[r], ours[r], r)
        _check_errors(torch_bad_types, ours[r]["errors"], f"threads rank {r}")


def test_torch_transport_processes_match_gloo(gloo_results, torch_bad_types, monkeypatch) -> None:
    monkeypatch.setenv("MESHTRAIN_TRANSPORT", "torch")  # init_process_group's default is auto (shm here)
    ours = run_procs("meshtrain.comm", scenario, world=P)
    for r in range(P):
        assert "native" in ours[r]["reductions"]["all_reduce/int8/BXOR"]
        assert "cannot move torch.int16" in ours[r]["native_int16"] and "algorithm='auto'" in ours[r]["native_int16"]
        check_against_plain_torch(ours[r], r)
        compare_with_gloo(gloo_results[r], ours[r], r)
        _check_errors(torch_bad_types, ours[r]["errors"], f"torch transport rank {r}")


def test_shm_transport_processes_match_gloo(gloo_results, torch_bad_types) -> None:
    ours = spawn(P, _shm_scenario, timeout=100, comm_timeout=30, transport="shm")
    for r in range(P):
        assert "shm" in ours[r]["reductions"]["all_reduce/bool/SUM"]
        check_against_plain_torch(ours[r], r)
        compare_with_gloo(gloo_results[r], ours[r], r)
        _check_errors(torch_bad_types, ours[r]["errors"], f"shm rank {r}")
