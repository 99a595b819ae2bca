"""``comm.algorithm``: a training run's collectives run with the configured algorithm (the flight
recorder shows the algorithm that ran) and train to the ``auto`` run's losses; names that run
none of training's collectives on the transport are config errors; ``select.choose`` takes the
communicator's preferred algorithm where it is valid and falls back to ``auto`` elsewhere."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from meshtrain import comm
from meshtrain.comm import select
from meshtrain.comm.algorithms import REGISTRY
from meshtrain.errors import ConfigError
from meshtrain.train.config import load_config
from meshtrain.train.config_check import TRAINING_OPS, training_algorithms
from meshtrain.train.launch import world_size
from meshtrain.train.tokenizer import prepare_data
from meshtrain.train.trainer import train

SMALL = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
         "--train.seq_len=32", "--train.warmup_steps=1"]
# dp all-reduces (DDP buckets, loss, grad norm), ZeRO-1's reduce-scatter and all-gather, and tp's
# all-reduces plus sequence parallelism's all-gathers and reduce-scatters
LAYOUT = ["--parallel.dp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.zero_stage=1"]
# the flight recorder's op names that run a ring when comm.algorithm = "ring"
RING_OPS = {"all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
            "reduce_scatter", "reduce_scatter_tensor"}


def _train(tmp_path, name: str, algorithm: str) -> tuple[list[dict], list[list[dict]], list]:
    """A 3-step run on threads: rank 0's metrics, each rank's flight recorder, and each rank's
    preferred algorithm after ``train`` returned."""
    config = load_config(None, [f"--out={tmp_path / name}", "--comm.transport=local", f"--comm.algorithm={algorithm}",
                                "--train.steps=3", *SMALL, *LAYOUT])
    prepare_data(config.data)  # once, before the ranks start (as launch() does)

    def rank(r: int) -> tuple[list[dict], str | None]:
        train(config, progress=False)
        return comm.flight_recorder(), comm.current().preferred_algorithm

    out = comm.run_local(world_size(config), rank, timeout=config.comm.timeout_s)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return rows, [o[0] for o in out], [o[1] for o in out]


def test_ring_runs_every_training_collective_with_ring_and_trains_like_auto(tmp_path):
    auto_rows, auto_recs, _ = _train(tmp_path, "auto", "auto")
    ring_rows, ring_recs, after = _train(tmp_path, "ring", "ring")

    auto_algos = {r["algorithm"] for recs in auto_recs for r in recs if r["op"] in RING_OPS and r["group_ranks"][1:]}
    assert auto_algos - {"ring"}, "auto already chose ring everywhere: this run would show nothing"
    for recs in ring_recs:
        # the world's first call is check_same_config's all-reduce, made before the run's algorithm is
        # set on purpose (ranks configured with different algorithms must meet it to be told so)
        assert (recs[0]["group"], recs[0]["seq"], recs[0]["dtype"]) == (0, 1, "float64"), recs[0]
        ran = [r for r in recs[1:] if r["op"] in RING_OPS]
        assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"} <= {r["op"] for r in ran}
        assert {(r["op"], r["algorithm"]) for r in ran if r["algorithm"] != "ring"} == set()
        assert all(r["state"] == "completed" for r in recs)
    assert after == [None] * 4  # the trainer leaves the thread's communicator as it found it

    assert [r["samples"] for r in ring_rows] == [r["samples"] for r in auto_rows]
    for got, ref in zip(ring_rows, auto_rows, strict=True):
        # ring and auto's choices sum in different orders: equal up to fp32 rounding
        assert abs(got["loss"] - ref["loss"]) <= 1e-5 * ref["loss"]
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"]


@pytest.mark.parametrize("transport,algorithm,message", [
    ("local", "native", "comm.algorithm = 'native' runs none of the collectives training uses"),
    ("local", "shm", "'shm' needs the shm transport"),
    ("torch", "shm", "on comm.transport = 'torch'"),
    ("shm", "native", "'native' needs the torch transport"),
])
def test_an_algorithm_that_runs_no_training_collective_is_a_config_error(transport, algorithm, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--comm.transport={transport}", f"--comm.algorithm={algorithm}"])
    assert message in str(err.value)
    valid = ["auto"] + training_algorithms([transport])
    assert f"use one of {', '.join(valid)}" in str(err.value) and algorithm not in valid


POINT_TO_POINT = {"ring", "tree", "recursive_doubling", "halving_doubling", "hierarchical", "direct"}


@pytest.mark.parametrize("transport,backend,extra", [
    ("local", "auto", set()), ("shm", "auto", {"shm"}), ("torch", "auto", {"native"}),
    ("auto", "auto", {"shm", "native"}), ("auto", "gloo", {"shm"}), ("auto", "nccl", {"native"}),
])
def test_every_algorithm_that_runs_a_training_collective_on_the_transport_is_accepted(transport, backend, extra):
    device = ["--train.device=cuda"] if backend == "nccl" else []
    for name in {"auto"} | POINT_TO_POINT | extra:
        cfg = load_config(None, [f"--comm.transport={transport}", f"--comm.backend={backend}", *device,
                                 f"--comm.algorithm={name}"])
        assert cfg.comm.algorithm == name
    for name in {"shm", "native"} - extra:
        with pytest.raises(ConfigError, match=f"'{name}' needs the"):
            load_config(None, [f"--comm.transport={transport}", f"--comm.backend={backend}", *device,
                               f"--comm.algorithm={name}"])


def test_the_trainer_refuses_a_name_for_the_transport_it_got(tmp_path):
    """comm.transport = "auto" leaves native vs shm to the machine: the trainer checks the kind
    the run got, on every rank, before any step."""
    config = load_config(None, [f"--out={tmp_path}", "--comm.transport=local", *SMALL], check=False)
    config.comm.algorithm = "native"  # as if validate() had allowed it for transport auto

    with pytest.raises(ConfigError, match="on the local transport this run got"):
        comm.run_local(2, lambda r: train(config, progress=False), timeout=30)
    assert not (tmp_path / "metrics.jsonl").exists()


class _Transport:
    """Just what ``choose`` reads of a transport: its kind and which ranks share this host."""

    def __init__(self, kind: str, local: bool) -> None:
        self.kind, self.local = kind, local

    def is_local(self, ranks) -> bool:
        return self.local


def _group(kind: str, preferred: str | None, *, local: bool = True, size: int = 2):
    comm_ = SimpleNamespace(transport=_Transport(kind, local), preferred_algorithm=preferred)
    # a fixed cost model, so the fallback needs no calibration
    return SimpleNamespace(comm=comm_, ranks=list(range(size)), size=size, hosts=["h"] * size,
                           cost_model=select.default_model("torch"))


def _auto(kind: str, op: str, nbytes: int, **kw) -> str:
    """What choose answers with no preference."""
    return select.choose(_group(kind, None, **kw), op, nbytes)


@pytest.mark.parametrize("kind,op,name", [
    ("local", "all_reduce", "ring"), ("local", "all_reduce", "halving_doubling"), ("local", "broadcast", "tree"),
    ("local", "all_gather", "recursive_doubling"), ("local", "reduce_scatter", "direct"),
    ("torch", "all_reduce", "ring"), ("torch", "all_to_all", "native"),  # a pair's auto is gloo's own
    ("shm", "all_reduce", "ring"), ("shm", "broadcast", "direct"),  # beat auto's shm on one host
    ("shm", "all_to_all", "direct"),
])
def test_choose_takes_a_valid_preference(kind, op, name):
    for nbytes in (8, 1 << 24):
        assert select.choose(_group(kind, name), op, nbytes) == name
    assert {_auto(kind, op, n) for n in (8, 1 << 24)} != {name}  # auto alone would not always say so


@pytest.mark.parametrize("kind,op,name,kw", [
    ("local", "all_gather", "halving_doubling", {}),  # an all-reduce algorithm only
    ("local", "reduce_scatter", "tree", {}),
    ("local", "all_to_all", "ring", {}),
    ("local", "all_reduce", "native", {}),  # native: the torch transport only
    ("shm", "all_reduce", "native", {}),
    ("torch", "all_reduce", "shm", {}),  # shm: the shm transport only
    ("shm", "all_reduce", "shm", {"local": False}),  # a group spanning hosts
    ("shm", "all_gather", "shm", {"size": 1}),
    ("shm", "gather", "shm", {}),  # no shm gather
])
def test_choose_falls_back_to_auto_where_the_preference_is_invalid(kind, op, name, kw):
    for nbytes in (8, 1 << 24):
        got = select.choose(_group(kind, name, **kw), op, nbytes)
        assert got == _auto(kind, op, nbytes, **kw) and got != name


def test_the_preference_reaches_every_collective_on_real_groups():
    """On threads: every op of the front ends (collectives, personalized, fusion) resolves auto
    to the preference where valid, else as before; the results are right either way."""
    expected = {"all_reduce": "ring", "all_reduce_coalesced": "ring", "reduce": "ring", "broadcast": "ring",
                "all_gather_into_tensor": "ring", "reduce_scatter_tensor": "ring", "gather": None, "scatter": None,
                "all_to_all": None}

    def fn(rank: int, preferred: str | None) -> tuple[dict, list]:
        comm.current().preferred_algorithm = preferred
        p, x = comm.get_world_size(), torch.full((5,), float(rank + 1))
        total = float(sum(range(1, p + 1)))
        a = x.clone()
        comm.all_reduce(a)
        b = [x.clone(), x[:2].clone()]
        comm.all_reduce_coalesced(b)
        c = x.clone()
        comm.reduce(c, dst=0)
        d = x.clone()
        comm.broadcast(d, src=1)
        e = torch.empty(5 * p)
        comm.all_gather_into_tensor(e, x)
        f = torch.empty(5)
        comm.reduce_scatter_tensor(f, torch.cat([x] * p))
        glist = [torch.empty(5) for _ in range(p)] if rank == 0 else None
        comm.gather(x, glist, dst=0)
        s = torch.empty(5)
        comm.scatter(s, [torch.full((5,), float(i)) for i in range(p)] if rank == 0 else None, src=0)
        t = [torch.empty(1) for _ in range(p)]
        comm.all_to_all(t, [torch.full((1,), float(rank * 10 + j)) for j in range(p)])
        ok = [torch.equal(a, torch.full((5,), total)), all(torch.equal(v, torch.full_like(v, total)) for v in b),
              rank != 0 or torch.equal(c, torch.full((5,), total)), torch.equal(d, torch.full((5,), 2.0)),
              torch.equal(e, torch.cat([torch.full((5,), float(i + 1)) for i in range(p)])),
              torch.equal(f, torch.full((5,), total)),
              rank != 0 or all(torch.equal(g, torch.full((5,), float(i + 1))) for i, g in enumerate(glist)),
              torch.equal(s, torch.full((5,), float(rank))),
              [v.item() for v in t] == [float(j * 10 + rank) for j in range(p)]]
        return {r["op"]: r["algorithm"] for r in comm.flight_recorder()}, ok

    base = comm.run_local(3, fn, None)
    pinned = comm.run_local(3, fn, "ring")
    for (algos, ok), (base_algos, _) in zip(pinned, base):
        assert all(ok)
        assert algos == {op: want or base_algos[op] for op, want in expected.items()}
    assert all(all(ok) for _, ok in base)
    # at these sizes auto takes something else for some op, so "ring" above came from the preference
    assert any(base[0][0][op] != "ring" for op, want in expected.items() if want == "ring")


def _symmetric(rank: int) -> dict:
    """All-reduce a symmetric tensor (what DDP's buckets are on shm) under each preference: the
    algorithm recorded, whether the in-place path ran, and whether the sum is right."""
    import meshtrain.comm as mc
    from tests.comm.test_shm_symmetric import _count_in_place

    taken = _count_in_place()
    p, out = mc.get_world_size(), {}
    t = mc.symmetric_empty(100_000)
    for pref in (None, "ring", "shm", "native"):
        mc.current().preferred_algorithm = pref
        before = taken[0]
        t.fill_(rank + 1.0)
        mc.all_reduce(t)
        out[str(pref)] = (mc.flight_recorder()[-1]["algorithm"], taken[0] - before,
                          bool((t == p * (p + 1) / 2).all()))
    return out


@pytest.mark.timeout(120)
def test_a_preference_other_than_shm_beats_the_symmetric_in_place_path():
    """On one host's shm, auto reduces a symmetric tensor in place; comm.algorithm = "ring" runs a
    ring instead, "shm" keeps the in-place path, and "native" (invalid there) leaves auto's."""
    from meshtrain.comm.launch import spawn

    for res in spawn(2, _symmetric, timeout=110, comm_timeout=30, transport="shm"):
        assert res == {"None": ("shm", 1, True), "ring": ("ring", 0, True), "shm": ("shm", 1, True),
                       "native": ("shm", 1, True)}


def test_training_ops_are_the_collectives_the_training_code_calls():
    """TRAINING_OPS (what the config check counts) names every collective that meshtrain/parallel
    and meshtrain/train call, and only those."""
    import pathlib
    import re

    import meshtrain

    root = pathlib.Path(meshtrain.__file__).parent
    called: set[str] = set()
    for sub in ("parallel", "train"):
        for path in (root / sub).rglob("*.py"):
            called |= set(re.findall(r"\bcomm\.(\w+)\(", path.read_text()))
    base = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "all_reduce_coalesced": "all_reduce"}
    assert {base.get(op, op) for op in called} & set(REGISTRY) - {"barrier"} == set(TRAINING_OPS)
