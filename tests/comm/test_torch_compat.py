"""torch.distributed's names on meshtrain.comm, differentially: one function written against a
``dist`` module runs once with ``torch.distributed`` (gloo processes) and once with
``meshtrain.comm`` (processes that call ``init_process_group`` themselves, and run_local threads),
and the results, exception types included, must agree with each other and with plain torch."""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import traceback
from typing import Any, Callable

import pytest
import torch

import meshtrain.comm as mc
from meshtrain import worker_processes
from meshtrain.bench import compat
from meshtrain.comm.launch import _pack, _unpack

WORLD = 4  # 2 data-parallel replicas x 2 pipeline stages
CFG = {"lr": 0.1, "steps": 3, "seed": 7, "batch": 5, "width": 4}


# ------------------------------------------------------------------------------ process harness


def _child(modname: str, rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, conn: Any) -> None:
    """One rank: env:// like torchrun (the parent holds the store, as torchrun's agent does),
    ``init_process_group`` of the module under test, ``fn(dist, rank, *args)``, then destroy."""
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                          TORCHELASTIC_RESTART_COUNT="0")
        dist = importlib.import_module(modname)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        out = fn(dist, rank, *args)
        dist.destroy_process_group()
        conn.send(("ok", _pack(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("err", traceback.format_exc()))


def run_procs(modname: str, fn: Callable[..., Any], *args: Any, world: int = WORLD, timeout: float = 90.0) -> list[Any]:
    """``fn(dist, rank, *args)`` on ``world`` fresh processes where ``dist`` is ``modname``."""
    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    pipes = [mp.Pipe(duplex=False) for _ in range(world)]
    procs = [worker_processes.start(_child, (modname, r, world, store.port, fn, args), handles=(pipes[r][1],))
             for r in range(world)]
    try:
        out = []
        for r, (reader, _) in enumerate(pipes):
            if not reader.poll(timeout):
                raise AssertionError(f"{modname}: rank {r} did not finish within {timeout}s")
            status, value = reader.recv()
            if status != "ok":
                raise AssertionError(f"{modname}: rank {r} failed:\n{value}")
            out.append(_unpack(value))
        return out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


# ------------------------------------------------------------------------- the training loop


def train(dist: Any, rank: int, dp_group: Any) -> dict[str, Any]:
    """dp2 x pp2 in torch.distributed style (``meshtrain.bench.compat.loop``, the loop `meshtrain
    bench compat` times): the config comes from rank 0 by broadcast_object_list, stage 0 (even
    ranks) sends activations to stage 1 and gets their gradients back through batch_isend_irecv,
    and each stage all-reduces its gradients over its data-parallel group."""
    out = compat.loop(dist, rank, CFG["width"], CFG["batch"], CFG["steps"], lr=CFG["lr"], seed=CFG["seed"],
                      dtype=torch.float64, dp_group=dp_group)
    return {"w": out["w"], "losses": out["losses"]}  # not the times, which differ between runs


def train_reference() -> dict[int, dict[str, Any]]:
    """The same model and data in one process with plain torch (no communication)."""
    w0, w1 = (compat.initial_weight(CFG["seed"], s, CFG["width"], torch.float64).requires_grad_() for s in (0, 1))
    gens = [torch.Generator().manual_seed(100 + replica) for replica in (0, 1)]
    losses: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(CFG["steps"]):
        grads = []
        for replica in (0, 1):
            x, y = compat.next_batch(gens[replica], CFG["batch"], CFG["width"], torch.float64)
            loss = ((x @ w0 @ w1 - y) ** 2).mean()
            losses[replica].append(loss.item())
            grads.append(torch.autograd.grad(loss, (w0, w1)))
        with torch.no_grad():
            w0 -= CFG["lr"] * (grads[0][0] + grads[1][0]) / 2
            w1 -= CFG["lr"] * (grads[0][1] + grads[1][1]) / 2
    return {r: {"w": (w0 if r % 2 == 0 else w1).detach(), "losses": losses[r // 2] if r % 2 else []}
            for r in range(WORLD)}


# ---------------------------------------------------------------------------- the API scenario


def _raises(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is the result
        return type(exc).__name__
    return None


def scenario(dist: Any, rank: int, threads: bool = False) -> dict[str, Any]:
    """Every name a trainer needs, on world 4; returns what each rank saw."""
    out: dict[str, Any] = {}
    world = dist.group.WORLD
    out["world"] = (dist.get_process_group_ranks(world), dist.get_rank(world), dist.get_world_size(world))
    out["available"] = dist.is_available()
    out["elastic"] = dist.is_torchelastic_launched()
    if not threads:
        out["backend"] = str(dist.get_backend())
    mine, subs = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    out["enum"] = (dist.get_process_group_ranks(mine), len(subs), dist.get_rank(mine), dist.get_world_size(mine),
                   dist.get_global_rank(mine, 1), dist.get_group_rank(mine, rank),
                   dist.get_global_rank(world, 3), dist.get_group_rank(world, 2))
    half, halves = dist.new_subgroups(2)
    out["halves"] = (dist.get_process_group_ranks(half), [dist.get_process_group_ranks(h) for h in halves])
    g = dist.new_group([1, 2, 3], timeout=datetime.timedelta(seconds=20), backend="gloo",
                       use_local_synchronization=False)
    t = torch.full((3,), float(rank + 1))
    if rank in (1, 2, 3):
        dist.all_reduce(t, group=g)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world)
    out["all_reduce"] = t

    # object collectives, on the world and on a subgroup
    objs: list[Any] = [{"lr": 0.5, "name": "cfg"}, (1, "two"), None] if rank == 1 else [None] * 3
    dist.broadcast_object_list(objs, src=1)
    sub_objs: list[Any] = [["from", rank]] if rank == dist.get_global_rank(mine, 0) else [None]
    dist.broadcast_object_list(sub_objs, src=dist.get_global_rank(mine, 0), group=mine)
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, {"rank": rank, "payload": "x" * (rank * 100)})
    to = [None] * WORLD if rank == 3 else None
    dist.gather_object((rank, rank ** 2), to, dst=3)
    got: list[Any] = [None]
    dist.scatter_object_list(got, [f"item{i}" * (i + 1) for i in range(WORLD)] if rank == 2 else None, src=2)
    defaults: list[Any] = [f"from rank {rank}"]  # src / dst default to global rank 0
    dist.broadcast_object_list(defaults)
    to0 = [None] * WORLD if rank == 0 else None
    dist.gather_object(rank * 3, to0)
    got0: list[Any] = [None]
    dist.scatter_object_list(got0, list(range(100, 100 + WORLD)) if rank == 0 else None)
    out["objects"] = (objs, sub_objs, gathered, to, got, defaults, to0, got0)

    # a ring through one batch (send and receive in one list)
    send, recv = torch.arange(4, dtype=torch.float32) + 10 * rank, torch.zeros(4)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, (rank - 1) % WORLD),
                                    dist.P2POp(dist.isend, send, (rank + 1) % WORLD)])
    for w in works:
        w.wait()
    out["ring"] = (len(works), recv)

    # send / recv named by group rank (group_dst / group_src) on a subgroup: group rank 1 -> 0
    pair = torch.full((2,), float(rank))
    if dist.get_rank(mine) == 1:
        dist.send(pair, group=mine, group_dst=0)
        out["group_p2p"] = pair
    else:
        out["group_p2p"] = (dist.recv(pair, group=mine, group_src=1), pair)

    dist.barrier(device_ids=[0])
    dist.barrier(group=mine)
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
    dist.monitored_barrier(group=g, timeout=datetime.timedelta(seconds=20), wait_all_ranks=True) if rank else None
    dist.destroy_process_group(g)  # a subgroup only: the world goes on

    if not threads:  # torch-made groups, passed to the module under test
        import torch.distributed as tdist

        tg = tdist.new_group([0, 2])
        u = torch.full((2,), float(rank))
        dist.all_reduce(u, group=tdist.group.WORLD)
        if rank in (0, 2):
            dist.all_reduce(u, group=tg)
        out["torch_groups"] = u

    out["train"] = train(dist, rank, mine)

    bad = {
        "init twice": lambda: dist.init_process_group("gloo"),
        "P2POp op": lambda: dist.P2POp(dist.all_reduce, torch.zeros(1), 0),
        "P2POp tensor": lambda: dist.P2POp(dist.isend, [1.0], 0),
        "batch not P2POp": lambda: dist.batch_isend_irecv([1]),
        "batch not list": lambda: dist.batch_isend_irecv("x"),
        "subgroups size 0": lambda: dist.new_subgroups(0),
        "subgroups size 3": lambda: dist.new_subgroups(3),
        "subgroups size 8": lambda: dist.new_subgroups(8),
        "enumeration empty": lambda: dist.new_subgroups_by_enumeration([]),
        "global rank": lambda: dist.get_global_rank(mine, 5),
        "group rank": lambda: dist.get_group_rank(mine, 9),
        "scatter_object output": lambda: dist.scatter_object_list([], ["a"] * WORLD),
        "gather_object list on non-dst": lambda: dist.gather_object(1, [None] * WORLD if rank != 0 else None, dst=0),
        "all_gather_object short list": lambda: dist.all_gather_object([None], rank),
        "send dst and group_dst": lambda: dist.send(torch.zeros(1), dst=1, group=mine, group_dst=1),
        "recv src and group_src": lambda: dist.recv(torch.zeros(1), src=1, group=mine, group_src=1),
        "isend neither dst": lambda: dist.isend(torch.zeros(1), group=mine),
    }
    out["errors"] = {name: _raises(fn) for name, fn in bad.items()}
    return out


def _normalise(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if k != "backend"}


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {a.keys()} != {b.keys()}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def torch_results() -> list[dict[str, Any]]:
    return run_procs("torch.distributed", scenario)


def test_processes_match_torch_distributed(torch_results: list[dict[str, Any]]) -> None:
    ours = run_procs("meshtrain.comm", scenario)
    for r in range(WORLD):
        assert torch_results[r]["backend"] == ours[r]["backend"] == "gloo"
        _assert_same(torch_results[r], ours[r], f"rank {r}")
    # every bad call raised (the same type as torch's: compared above)
    for r in range(WORLD):
        assert all(ours[r]["errors"].values()), ours[r]["errors"]


def test_threads_match_torch_distributed(torch_results: list[dict[str, Any]]) -> None:
    ours = mc.run_local(WORLD, lambda r: scenario(mc, r, threads=True), timeout=30)
    for r in range(WORLD):
        want = {k: v for k, v in torch_results[r].items() if k not in ("backend", "torch_groups")}
        _assert_same(want, ours[r], f"rank {r}")


def test_results_match_plain_torch(torch_results: list[dict[str, Any]]) -> None:
    """The torch.distributed run itself against values computed here without communication."""
    for r in (0, 1):  # group rank 0 of [0, 2] / [1, 3] received from group rank 1, global rank r + 2
        torch.testing.assert_close(torch_results[r]["group_p2p"][1], torch.full((2,), float(r + 2)))
    ref = train_reference()
    for r, res in enumerate(torch_results):
        torch.testing.assert_close(res["train"]["w"], ref[r]["w"])
        assert res["train"]["losses"] == pytest.approx(ref[r]["losses"])
        assert res["world"] == ([0, 1, 2, 3], r, 4)
        member = [0, 2] if r % 2 == 0 else [1, 3]
        assert res["enum"][0] == member and res["enum"][4] == member[1]
        assert res["halves"] == ([0, 1] if r < 2 else [2, 3], [[0, 1], [2, 3]])
        assert torch.equal(res["all_reduce"], torch.full((3,), 9.0))  # 2+3+4 on ranks 1-3, max with 1
        objs, sub_objs, gathered, to, got, defaults, to0, got0 = res["objects"]
        assert defaults == ["from rank 0"] and got0 == [100 + r]
        assert to0 == ([0, 3, 6, 9] if r == 0 else None)
        assert objs == [{"lr": 0.5, "name": "cfg"}, (1, "two"), None]
        assert sub_objs == [["from", member[0]]]
        assert gathered == [{"rank": i, "payload": "x" * (i * 100)} for i in range(WORLD)]
        assert to == ([(i, i * i) for i in range(WORLD)] if r == 3 else None)
        assert got == [f"item{r}" * (r + 1)]
        assert torch.equal(res["ring"][1], torch.arange(4, dtype=torch.float32) + 10 * ((r - 1) % WORLD))
        assert torch.equal(res["torch_groups"], torch.full((2,), 6.0 + (6.0 if r in (0, 2) else 0.0)))


def test_timeout_must_be_a_timedelta() -> None:
    import torch.distributed as tdist

    def with_float(mod: Any) -> str | None:
        try:
            return _raises(lambda: mod.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1,
                                                          timeout=5.0))
        finally:
            if mod is mc and mc.is_initialized():
                mc.destroy_process_group()
            if tdist.is_initialized():
                tdist.destroy_process_group()

    assert with_float(tdist) == with_float(mc) == "TypeError"


def test_init_process_group_with_a_store_in_one_process() -> None:
    """store + rank + world_size (no environment), a timedelta timeout, and destroy clears both."""
    import torch.distributed as tdist

    mc.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1,
                          timeout=datetime.timedelta(seconds=7))
    try:
        assert mc.is_initialized() and tdist.is_initialized()
        assert mc.group.WORLD is mc.GroupMember.WORLD is not None
        assert mc.group.WORLD.timeout == 7.0 and mc.get_backend() == "gloo"
        t = torch.ones(3)
        mc.all_reduce(t, group=tdist.group.WORLD)  # torch's own WORLD maps to meshtrain's
        assert torch.equal(t, torch.ones(3))
    finally:
        mc.destroy_process_group()
    assert not mc.is_initialized() and not tdist.is_initialized() and mc.group.WORLD is None
    with pytest.raises(ValueError):
        mc.destroy_process_group()


def test_monitored_barrier_names_missing_ranks() -> None:
    def fn(rank: int) -> None:
        if rank != 2:
            mc.monitored_barrier(timeout=datetime.timedelta(seconds=0.5))

    with pytest.raises(RuntimeError, match=r"Ranks \[2\] failed to pass monitoredBarrier"):
        mc.run_local(3, fn, timeout=10)


def test_default_timeout_and_foreign_group() -> None:
    """torch's default timeout (30 min) when none is given; a group that is neither meshtrain's nor
    torch's is a ValueError naming new_group."""
    import torch.distributed as tdist

    mc.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        assert mc.group.WORLD.timeout == 1800.0  # torch's default timeout
        with pytest.raises(ValueError, match="meshtrain.comm.new_group"):
            mc.all_reduce(torch.ones(1), group=object())
    finally:
        mc.destroy_process_group()


def test_group_peer_outside_the_group_is_named() -> None:
    """torch.distributed (gloo) hands group_dst = 2 of a 2-rank group to gloo, which waits for a
    peer that does not exist; meshtrain raises at once, naming the valid range."""
    def fn(rank: int) -> list[str]:
        pair = mc.new_group([2, 0])
        msgs = []
        if rank in (0, 2):
            for call in (lambda: mc.send(torch.zeros(1), group=pair, group_dst=2),
                         lambda: mc.irecv(torch.zeros(1), group=pair, group_src=-1)):
                with pytest.raises(ValueError) as err:
                    call()
                msgs.append(str(err.value))
        return msgs

    for msgs in mc.run_local(WORLD, fn, timeout=30)[0::2]:
        assert "group_dst = 2 is not a rank of group" in msgs[0] and "use 0..1" in msgs[0]
        assert "group_src = -1 is not a rank of group" in msgs[1]
