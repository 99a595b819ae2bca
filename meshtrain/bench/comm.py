"""``meshtrain bench comm``: time collectives per algorithm and transport, check every result.

Each rank builds inputs whose exact result is known (small integers in float, so sums are exact),
runs one checked call (``#wrong`` counts wrong elements, summed over ranks), then times warm
iterations. Algorithms are interleaved per size over several trials; a trial's time is the slowest
rank's mean, and the reported time is the median trial. The peer ``native`` is torch.distributed's own
collective called directly, with no meshtrain code in the path.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from .report import BUSBW_FACTOR

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
OPS = tuple(BUSBW_FACTOR)
SYMMETRIC = "shm_symmetric"  # algorithm="shm" on a tensor from comm.symmetric_empty (reduced in place)


def _inputs(op: str, count: int, p: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input, output, expected-output) for ``op`` with ``count`` elements (nccl-tests' size)."""
    def data(r: int, n: int) -> torch.Tensor:
        return ((torch.arange(n) + r) % 5 + 1).to(dtype)

    if op == "all_reduce":
        inp = data(rank, count)
        return inp, inp, sum(data(r, count).double() for r in range(p)).to(dtype)
    if op == "reduce":
        inp = data(rank, count)
        exp = sum(data(r, count).double() for r in range(p)).to(dtype) if rank == 0 else inp.clone()
        return inp, inp, exp
    if op == "broadcast":
        inp = data(rank, count)
        return inp, inp, data(0, count)
    n = count // p
    if op == "all_gather":
        inp = data(rank, n)
        return inp, torch.empty(n * p, dtype=dtype), torch.cat([data(r, n) for r in range(p)])
    if op == "reduce_scatter":
        inp = torch.cat([data(rank * p + j, n) for j in range(p)])
        exp = sum(data(r * p + rank, n).double() for r in range(p)).to(dtype)
        return inp, torch.empty(n, dtype=dtype), exp
    if op == "all_to_all":
        inp = torch.cat([data(rank * p + j, n) for j in range(p)])
        return inp, torch.empty(n * p, dtype=dtype), torch.cat([data(r * p + rank, n) for r in range(p)])
    raise ValueError(f"unknown op {op!r}: use one of {', '.join(OPS)}")


def float32_inputs(op: str, nbytes: int, p: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_inputs`` in float32 for about ``nbytes`` of data, the element count a multiple of ``p``
    (the per-call benchmarks in ``benchmarks/``)."""
    count = nbytes // 4
    return _inputs(op, count - count % p, p, rank, torch.float32)


def _call(op: str, algo: str, inp: torch.Tensor, out: torch.Tensor, p: int) -> None:
    """One call of ``op``: torch.distributed's own for ``native`` (the peer), else meshtrain's."""
    if algo == "native":
        torch_call(op, inp, out)
    else:
        mc_call(op, algo, inp, out, p)


def torch_call(op: str, inp: torch.Tensor, out: torch.Tensor) -> None:
    """``op`` through torch.distributed directly (the peer every bench compares with)."""
    import torch.distributed as dist

    from meshtrain.comm.algorithms import native

    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "reduce":
        dist.reduce(inp, 0)
    elif op == "broadcast":
        dist.broadcast(inp, 0)
    elif op == "all_gather":  # the names torch 2.13 keeps (the old ones warn on every call)
        native.ALL_GATHER_SINGLE(out, inp)
    elif op == "reduce_scatter":
        native.REDUCE_SCATTER_SINGLE(out, inp)
    elif op == "all_to_all":
        dist.all_to_all_single(out, inp)


def mc_call(op: str, algo: str, inp: torch.Tensor, out: torch.Tensor, p: int) -> None:
    """``op`` through meshtrain.comm with ``algorithm=algo`` (``native``: torch's op behind meshtrain's
    front end, check and wait)."""
    import meshtrain.comm as mc

    if op == "all_reduce":
        mc.all_reduce(inp, algorithm="shm" if algo == SYMMETRIC else algo)
    elif op == "reduce":
        mc.reduce(inp, 0, algorithm=algo)
    elif op == "broadcast":
        mc.broadcast(inp, 0, algorithm=algo)
    elif op == "all_gather":
        mc.all_gather_into_tensor(out, inp, algorithm=algo)
    elif op == "reduce_scatter":
        mc.reduce_scatter_tensor(out, inp, algorithm=algo)
    elif op == "all_to_all":
        mc.all_to_all(list(out.chunk(p)), list(inp.chunk(p)), algorithm=algo)


def _same_calls(cases: dict[str, dict[str, Any]], cfg: dict[str, Any]) -> None:
    """Give every algorithm of a size the same number of calls a trial: that of the fastest first
    call, less where it would make a slower algorithm's trial run past 5x the target. Counts taken
    from each one's own first call had differed by chance (one slow first call: 44 calls a trial
    against the peer's 200, session 15), and a mean of few calls moves more with one slow call."""
    if cfg.get("iters") or len(cases) < 2:
        return
    most = max(c["iters"] for c in cases.values())
    bound = min(math.ceil(5 * cfg["target_s"] / max(c["first"], 1e-6)) for c in cases.values())
    for c in cases.values():
        c["iters"] = max(min(most, bound), 3)


def trial_order(algorithms: list[str], trial: int) -> list[str]:
    """The order of trial ``trial``: the list rotated by ``trial``, the same on every rank, so an effect
    of running first (or after a given algorithm) does not fall on one algorithm in every trial (in
    a fixed order, auto always ran first in ``benchmarks/auto_table.py``)."""
    k = trial % len(algorithms) if algorithms else 0
    return algorithms[k:] + algorithms[:k]


def _max_over_ranks(x: float) -> float:
    import meshtrain.comm as mc

    t = torch.tensor([x], dtype=torch.float64)
    mc.all_reduce(t, op="max", algorithm="direct")
    return float(t.item())


def rank_main(rank: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Runs on every rank; rank 0 returns the records and facts of the run."""
    import meshtrain.comm as mc

    torch.set_num_threads(1)  # p ranks share few cores; one intra-op thread each is fastest
    p = mc.get_world_size()
    dtype = DTYPES[cfg["dtype"]]
    elem = torch.empty(0, dtype=dtype).element_size()
    op = cfg["op"]
    records: list[dict[str, Any]] = []
    calibration = None
    if cfg.get("calibrate"):
        from ..comm import select

        model = mc.calibrate(force=True)
        nodes = len(set(mc.current().world.hosts))
        calibration = {"alpha_us": model.alpha * 1e6, "beta_GBps": 1 / model.beta / 1e9,
                       "gamma_GBps": 1 / model.gamma / 1e9,
                       "crossovers": {o: select.crossovers(model, o, p, nodes, extra=_extra(mc.current().transport))
                                      for o in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")}}
    trials = max(int(cfg.get("trials", 3)), 1)
    for size in cfg["sizes"]:
        count = case_count(op, size, elem, p)
        cases = {}
        for algo in cfg["algorithms"]:  # one checked call each, and the iteration count
            inp, out, expected = _inputs(op, count, p, rank, dtype)
            if algo == "auto":  # time what auto keeps, not its exploring calls (comm/tune.py)
                _settle(op, inp.clone(), out.clone(), p)
            if algo == SYMMETRIC:  # the same input in symmetric memory (all_reduce only)
                inp = out = mc.symmetric_empty(count, dtype).copy_(inp)
            _call(op, algo, inp, out, p)
            result = out if op in ("all_gather", "reduce_scatter", "all_to_all") else inp
            wrong = int((result != expected).sum().item())
            wrong = int(_max_over_ranks(wrong)) if p > 1 else wrong  # any rank's errors count
            t0 = time.perf_counter()
            _call(op, algo, inp, out, p)
            first = _max_over_ranks(time.perf_counter() - t0)
            iters = cfg.get("iters") or int(min(max(math.ceil(cfg["target_s"] / max(first, 1e-6)), 3), 200))
            cases[algo] = {"inp": inp, "out": out, "wrong": wrong, "iters": iters, "first": first, "times": []}
        _same_calls(cases, cfg)
        # Trials interleave the algorithms, so drift in machine load hits all of them alike, and
        # each trial starts one algorithm later (``trial_order``), so none always runs first.
        for t in range(trials):
            for algo in trial_order(list(cases), t):
                c = cases[algo]
                for _ in range(cfg["warmup"]):
                    _call(op, algo, c["inp"], c["out"], p)
                mc.barrier()
                t0 = time.perf_counter()
                for _ in range(c["iters"]):
                    _call(op, algo, c["inp"], c["out"], p)
                c["times"].append(_max_over_ranks((time.perf_counter() - t0) / c["iters"]))
        for algo, c in cases.items():
            secs = sorted(c["times"])[len(c["times"]) // 2]  # median trial
            nbytes = count * elem
            algbw = nbytes / secs / 1e9 if secs > 0 else 0.0
            records.append({
                "transport": cfg["transport"], "backend": cfg.get("backend", ""), "op": op,
                "algorithm": algo, "world_size": p, "size": nbytes, "count": count, "dtype": cfg["dtype"],
                "redop": "sum" if op in ("all_reduce", "reduce", "reduce_scatter") else "none",
                "root": 0 if op in ("broadcast", "reduce") else -1, "time_us": secs * 1e6, "algbw": algbw,
                "busbw": algbw * BUSBW_FACTOR[op](p), "wrong": c["wrong"], "iters": c["iters"],
                "check": bool(cfg.get("check", True)) and algo != "native",
                "trials_us": [t * 1e6 for t in c["times"]],
            })
    records.sort(key=lambda r: (cfg["algorithms"].index(r["algorithm"]), r["size"]))
    waits = _wait_modes([case_count(op, size, elem, p) * elem for size in cfg["sizes"]], p)
    if rank != 0:
        return None
    tuner = mc.current().world.tuner
    return {"records": records, "calibration": calibration, "explain": tuner.explain() if tuner else [],
            "native_wait": {size: waits[i] for i, size in enumerate(cfg["sizes"])}}


def case_count(op: str, size: int, elem: int, p: int) -> int:
    """The elements of the bench's case of ``size`` bytes: a multiple of ``p`` for the ops that
    split their buffer among the ranks (times ``elem``: what ``native_wait`` keys a call on)."""
    count = max(size // elem, 0)
    return count - count % p if op in ("all_gather", "reduce_scatter", "all_to_all") else count


def _wait_modes(nbytes: list[int], p: int) -> list[list[str]]:
    """Per size, every rank's wait mode for torch's own op (``native_wait``: look, park, or ``-``
    where none was learned), as rank 0 sees them: the processes learn theirs apart."""
    import meshtrain.comm as mc
    from ..comm.algorithms import native_wait

    code = {None: 0, True: 1, False: 2}
    mine = torch.tensor([code[native_wait.kept(n)] for n in nbytes], dtype=torch.float64)
    every = torch.empty(p * len(nbytes), dtype=torch.float64)
    if p > 1:
        mc.all_gather_into_tensor(every, mine, algorithm="direct")
    else:
        every.copy_(mine)
    names = {0: "-", 1: "look", 2: "park"}
    return [[names[int(every[r * len(nbytes) + i])] for r in range(p)] for i in range(len(nbytes))]


def _settle(op: str, inp: torch.Tensor, out: torch.Tensor, p: int, limit: int = 200) -> None:
    """Call ``op`` with auto until online selection keeps a choice for it (the same number of calls
    on every rank: exploring is counted, not timed, per call)."""
    import meshtrain.comm as mc
    from ..comm import tune

    world = mc.current().world
    for _ in range(limit):
        _call(op, "auto", inp, out, p)
        if tune.settled(world):
            return


def memcpy_gbps(nbytes: int = 16 << 20, reps: int = 20) -> float:
    """Single-core memcpy bandwidth (bytes copied per second, in GB/s): the physical anchor."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9
    finally:
        torch.set_num_threads(prev)


def _floor_worker(nbytes: int, reps: int, start: Any, out: Any) -> None:
    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start.wait()  # every process copies at the same time, as the ranks of a collective do
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    out.send((time.perf_counter() - t0) / reps)
    out.close()


def copy_floor_us(world: int, nbytes: int, reps: int = 30) -> float:
    """Microseconds for ``world`` processes, all at once, each to copy ``nbytes`` from one private
    tensor to another. Every rank of an all-reduce, all-gather or reduce-scatter must at least read
    its input and write its output, so no such collective on this host can be faster: the floor
    the shm collectives are measured against (busbw per memcpy says the same for one core)."""
    import multiprocessing as mp

    from .. import worker_processes

    start = worker_processes.context().Barrier(world)
    pipes = [mp.Pipe(duplex=False) for _ in range(world)]
    procs = [worker_processes.start(_floor_worker, (nbytes, reps), handles=(start, w)) for _, w in pipes]
    try:
        return max(r.recv() for r, _ in pipes) * 1e6
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        for r, w in pipes:
            r.close()
            w.close()


def run_transport(transport: str, world: int, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Start ``world`` ranks on the registered ``transport``: threads (``run_local``) where its
    ranks are threads (local), else processes (``spawn``: over gloo for torch, shared memory for
    shm). ValueError naming the registered transports for another name."""
    from ..comm.transport import registry

    spec = registry.get(transport)
    cfg = dict(cfg, transport=transport)
    if spec.threads:
        from ..comm import run_local

        return run_local(world, rank_main, cfg, timeout=timeout, check=cfg.get("check", True), transport=transport)[0]
    from ..comm.launch import spawn

    # the records name the torch backend where the data goes through torch's group (spawn's gloo)
    cfg["backend"] = "gloo" if spec.capabilities.native_collectives else ""
    return spawn(world, rank_main, cfg, timeout=timeout * 4 + 120, comm_timeout=timeout,
                 check=cfg.get("check", True), transport=transport)[0]


def _extra(transport: Any) -> tuple[str, ...]:
    """The transport-specific algorithms ``select.crossovers`` prices: "shm" on shared memory."""
    from ..comm.transport.base import capabilities

    return ("shm",) if capabilities(transport).shared_memory else ()
