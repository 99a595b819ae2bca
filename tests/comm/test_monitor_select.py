"""Stats, flight recorder, cost-model selection/calibration, and the fusion buffer pool."""

import json

import pytest
import torch

import meshtrain.comm as mc
from meshtrain.comm import select
from meshtrain.comm.algorithms import REGISTRY


def test_stats_count_ops_bytes_and_sent_bytes():
    def fn(rank):
        g = mc.new_group([0, 1])
        x = torch.ones(1000)
        for _ in range(3):
            mc.all_reduce(x, algorithm="ring")
        if rank in (0, 1):
            mc.broadcast(torch.ones(10), 0, group=g, algorithm="direct")
        return mc.stats()

    out = mc.run_local(4, fn)
    world = out[0][0]["ops"]["all_reduce"]
    assert world["count"] == 3 and world["bytes"] == 3 * 4000
    # ring all-reduce sends 2(p-1)/p of the buffer per rank
    assert world["sent_bytes"] == 3 * 2 * 3 * 1000  # 2(p-1) steps x 250 floats x 4 bytes
    assert out[0][1]["ops"]["broadcast"]["sent_bytes"] == 40  # root sends to one peer
    assert out[1][1]["ops"]["broadcast"]["sent_bytes"] == 0
    assert 1 not in out[2]  # rank 2 never used group 1


def test_flight_recorder_keeps_last_n_and_dumps_json(tmp_path):
    def fn(rank):
        for i in range(5):
            mc.all_reduce(torch.ones(3 + i), algorithm="tree")
        return mc.flight_recorder(), mc.dump_flight_recorder(str(tmp_path / f"fr{rank}.json"))

    out = mc.run_local(2, fn)
    recs, path = out[1]
    assert [r["seq"] for r in recs if r["op"] == "all_reduce"][-5:] == [1, 2, 3, 4, 5]
    last = recs[-1]
    assert last["shapes"] == [[7]] and last["dtype"] == "float32" and last["state"] == "completed"
    assert last["end"] >= last["start"]
    data = json.loads(open(path).read())
    assert data["rank"] == 1 and data["records"][-1]["seq"] == 5


def test_flight_recorder_records_failure():
    def fn(rank):
        try:
            mc.all_reduce(torch.ones(2 + rank), algorithm="ring")
        except mc.CollectiveMismatch:
            return mc.flight_recorder()[-1]["state"]

    assert mc.run_local(2, fn) == ["failed: CollectiveMismatch"] * 2


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_cost_model_orders_algorithms_as_theory_says(p):
    m = select.CostModel(alpha=1e-4, beta=1e-9, gamma=2.5e-10)
    small = min(REGISTRY["all_reduce"], key=lambda a: m.predict("all_reduce", a, 8, p))
    big = min(REGISTRY["all_reduce"], key=lambda a: m.predict("all_reduce", a, 1 << 28, p))
    assert small in ("recursive_doubling", "tree", "direct", "halving_doubling")  # latency-bound: few rounds
    assert big in ("ring", "halving_doubling")  # bandwidth-bound: 2(p-1)/p n beta
    xs = select.crossovers(m, "all_reduce", p)
    assert xs[0][0] == 64 and xs[-1][1] == big


def test_auto_agrees_across_ranks_and_calibration_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path))

    def fn(rank):
        x = torch.ones(257)
        mc.all_reduce(x)  # auto on threads: the defaults, no hidden calibration exchange
        implicit = mc.current().world.cost_model.source
        mc.calibrate(force=False)  # explicit (collective): measured once, then from the cache
        model = mc.current().world.cost_model
        return model.source, select.choose(mc.current().world, "all_reduce", 1 << 22), x[0].item(), implicit

    first = mc.run_local(3, fn)
    assert {r[3] for r in first} == {"default"}
    assert {r[0] for r in first} == {"measured"} and len({r[1] for r in first}) == 1
    assert all(r[2] == 3.0 for r in first)
    cached = json.loads((tmp_path / "calibration.json").read_text())
    assert any(k.startswith("local::3:") for k in cached)
    second = mc.run_local(3, fn)
    assert {r[0] for r in second} == {"cache"}


def test_coalesced_reuses_its_pool_buffer():
    def fn(rank):
        ts = [torch.full((n,), float(rank + 1)) for n in (3, 1, 7)]
        mc.all_reduce_coalesced(ts, algorithm="ring")
        pool = mc.current().world.pool
        before = pool.nbytes()
        ptr = pool.get("fusion", 11, torch.float32, torch.device("cpu")).data_ptr()
        mc.all_reduce_coalesced([torch.ones(5), torch.ones(6)], algorithm="ring")
        same = pool.get("fusion", 11, torch.float32, torch.device("cpu")).data_ptr() == ptr
        return ts, before == pool.nbytes(), same

    for ts, no_growth, same in mc.run_local(3, fn):
        assert all(torch.equal(t, torch.full_like(t, 6.0)) for t in ts)
        assert no_growth and same


def test_auto_takes_nccl_own_collectives_on_an_nccl_group():
    """No NCCL here: a stand-in group whose torch transport reports the nccl backend (as
    dist.get_backend does on a CUDA process group) must get 'native' for every op that has it,
    and a gloo one must not (it is priced by the model)."""
    from types import SimpleNamespace

    from meshtrain.comm.algorithms import algorithms_for

    def group(backend: str) -> SimpleNamespace:
        t = SimpleNamespace(kind="torch", backend=backend)
        comm = SimpleNamespace(transport=t, preferred_algorithm=None)
        return SimpleNamespace(comm=comm, size=4, ranks=[0, 1, 2, 3], hosts=["h"] * 4,
                               cost_model=select.default_model("torch"))

    ops = [op for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
           if "native" in algorithms_for(op, "torch")]
    assert ops, "the torch transport offers native collectives"
    for op in ops:
        assert select.choose(group("nccl"), op, 1 << 20) == "native"
        assert select.choose(group("cpu:gloo,cuda:nccl"), op, 1 << 20) == "native"
    assert any(select.choose(group("gloo"), op, 1 << 20) != "native" for op in ops)
    # gloo: its own all_reduce from select.NATIVE_FROM_GLOO on, the cost model below it
    lo, _ = select.NATIVE_FROM_GLOO["all_reduce"]
    assert select.choose(group("gloo"), "all_reduce", lo) == "native"
    assert select.choose(group("gloo"), "all_reduce", lo // 2) != "native"
    _, hi = select.NATIVE_FROM_GLOO_BOARD["all_gather"]
    assert select.choose(group("gloo"), "all_gather", hi // 2) == "native"
    assert select.choose(group("gloo"), "all_gather", hi) != "native"
    assert select.choose(group("gloo"), "reduce_scatter", 1 << 24) != "native"
    # a group of two takes gloo's own at every size
    pair = group("gloo")
    pair.size, pair.ranks, pair.hosts = 2, [0, 1], ["h"] * 2
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert select.choose(pair, op, 4096) == "native" and select.choose(pair, op, 1 << 26) == "native"
        # but not for a dtype gloo cannot move (int16): meshtrain's own algorithms then
        assert select.choose(pair, op, 4096, native_ok=False) != "native"
    # across hosts (no board: the check would run beside gloo's op) only the all_reduce rule holds
    pair = group("gloo")
    pair.size, pair.ranks, pair.hosts = 2, [0, 1], ["a", "b"]
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert select.choose(pair, op, 4096) != "native"
    assert select.choose(pair, "all_reduce", 1 << 20) == "native"


def test_algorithms_follow_the_transport_capabilities():
    """algorithms_for asks the registry, not the transport's name: a new kind gets "native" and
    "shm" exactly when its Capabilities say so."""
    from meshtrain.comm.algorithms import algorithms_for
    from meshtrain.comm.transport import base, registry

    for name, caps in (("plain", base.Capabilities()),
                       ("both", base.Capabilities(native_collectives=True, shared_memory=True))):
        registry.register(registry.TransportSpec(name, build=lambda setup: None, capabilities=caps))  # type: ignore
    try:
        assert {"native", "shm"}.isdisjoint(algorithms_for("all_reduce", "plain"))
        assert {"native", "shm"} <= set(algorithms_for("all_reduce", "both"))
        assert "shm" not in algorithms_for("gather", "both")  # no shm collective for it
        assert "shm" in algorithms_for("all_to_all", "both") and "shm" not in algorithms_for("all_to_all", "plain")
        assert base.capabilities(type("T", (), {"kind": "unknown"})()) == base.Capabilities()
    finally:
        registry.unregister("plain")
        registry.unregister("both")


def test_peer_timeout_keeps_its_reason_through_pickle():
    import pickle

    from meshtrain.comm.transport.base import PeerTimeout

    e = pickle.loads(pickle.dumps(PeerTimeout("ranks [2] never arrived", [2], never_arrived=True)))
    assert e.missing == [2] and e.never_arrived and str(e) == "ranks [2] never arrived"
    assert not pickle.loads(pickle.dumps(PeerTimeout("stalled", [1]))).never_arrived


def test_auto_answers_are_kept_per_group_and_follow_the_preferred_algorithm_and_model():
    """select.choose keeps its answers per group; a changed preferred algorithm or cost model
    must change them (a stale memo would go on answering the old choice)."""
    def fn(rank):
        g = mc.current().world
        n = 1 << 16
        first = select.choose(g, "all_reduce", n)
        kept = len(g.choices)
        again = select.choose(g, "all_reduce", n)
        mc.current().preferred_algorithm = "direct"
        preferred = select.choose(g, "all_reduce", n)
        mc.current().preferred_algorithm = None
        # two models that disagree: messages at a second each, then bytes at a second each
        answers = []
        for model in (select.CostModel(1.0, 1e-12, 1e-12), select.CostModel(1e-12, 1.0, 1e-12)):
            g.cost_model = model  # the memo is not cleared: its key must tell the models apart
            answers.append((select.choose(g, "all_reduce", n), select._choose(g, "all_reduce", n, True)))
        return first, kept, again, preferred, answers

    for first, kept, again, preferred, answers in mc.run_local(4, fn):
        assert kept == 1 and again == first
        assert preferred == "direct"
        assert all(kept_answer == fresh for kept_answer, fresh in answers)
        assert answers[0][1] != answers[1][1]  # the models really choose differently
