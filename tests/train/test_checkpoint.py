"""Checkpoints: save under one layout, resume under another with the losses of the run that never
stopped; the files (each tensor once, ``latest``, keep); every CheckpointError; no pickle loaded.

Ranks are threads (``comm.run_local``). The reference for a resume is the same run under layout A
without a stop: it saves at step K (saving changes nothing) and keeps training.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from meshtrain import comm
from meshtrain.errors import CheckpointError
from meshtrain.mesh import Mesh
from meshtrain.models.llama import Llama
from meshtrain.parallel.parallel_model import ParallelModel
from meshtrain.parallel.parallelize import ParallelConfig
from meshtrain.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

from .._malicious import evil_pickle
from ..parallel._parity import CFG, LR, batches

K, MORE = 2, 2  # steps before the save, steps after it


def _build(layout: dict, config: dict, cfg=CFG) -> tuple[ParallelModel, object]:
    model = ParallelModel(cfg, Mesh(**layout), ParallelConfig(**config), seed=0)
    return model, model.build_optimizer(torch.optim.AdamW, lr=LR)


def _train(rank: int, layout: dict, config: dict, root: str, start: int, steps: int,
           save_at: tuple[int, ...] = (), load: bool = False, keep: int = 3) -> dict:
    """Train steps start+1..start+steps (optionally resuming from ``root`` first, and saving after
    the steps in ``save_at``); return the losses, the loaded extra and the final local parameters."""
    model, opt = _build(layout, config)
    extra = load_checkpoint(root, model, opt) if load else None
    losses = []
    for i, d in enumerate(batches(start + steps)[start:], start=start + 1):
        losses.append(model.forward_backward(d[:, :-1], d[:, 1:]).item())
        opt.step()
        opt.zero_grad()
        if i in save_at:
            save_checkpoint(root, i, model, opt, {"step": i, "loader": {"epoch": 0, "index": 4 * i},
                                                  "rng": torch.Generator().manual_seed(i).get_state()}, keep=keep)
    if config.get("zero_stage") == 3:  # ZeRO-3 frees the full parameters between steps
        params = {}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "extra": extra, "params": params}


def _world(layout: dict) -> int:
    return math.prod(v for k, v in layout.items() if k != "dp_replicate")  # dp counts the replicas


def _solo(fn, *args):
    """Run ``fn(*args)`` as the only rank of a one-rank world; return its result."""
    return comm.run_local(1, lambda rank: fn(*args), timeout=60)[0]


# -- (1) resume: another layout within 1e-5, the same layout bitwise --------------------------------

RESUMES = {
    "tp2->tp1": ((dict(tp=2), {}), (dict(), {})),
    "pp2-1f1b->tp2": ((dict(pp=2), dict(microbatches=2, schedule="1f1b")), (dict(tp=2), {})),
    "dp2-zero1->pp2xtp2": ((dict(dp=2), dict(zero_stage=1)), (dict(pp=2, tp=2), dict(microbatches=2))),
    "tp2xdp2->cp2-zero3": ((dict(tp=2, dp=2), dict(sequence_parallel=True)), (dict(cp=2), dict(zero_stage=3))),
    "pp2-interleaved-zero2->dp2": ((dict(pp=2), dict(microbatches=2, schedule="interleaved", virtual_stages=2,
                                                    zero_stage=2)), (dict(dp=2), {})),
    # ZeRO to ZeRO: tp-sliced flat shards of dp2 re-cut into dp4 shards of whole parameters
    "tp2xdp2-zero3->dp4-zero2": ((dict(tp=2, dp=2), dict(zero_stage=3)), (dict(dp=4), dict(zero_stage=2))),
    # HSDP (2 replicas of dp2 ZeRO-3 shards) to tp2, and back into HSDP from dp2
    "hsdp-zero3->tp2": ((dict(dp=4, dp_replicate=2), dict(zero_stage=3)), (dict(tp=2), {})),
    "dp2->hsdp-zero2": ((dict(dp=2), {}), (dict(dp=4, dp_replicate=2), dict(zero_stage=2))),
}


def test_hsdp_save_is_written_by_the_first_replica_only(tmp_path):
    """Under dp_replicate = 2 the two replicas hold the same shards: only replica 0 (ranks 0, 1) writes."""
    root = str(tmp_path)
    comm.run_local(4, _train, dict(dp=4, dp_replicate=2), {"zero_stage": 2}, root, 0, 1, (1,), timeout=60)
    step = os.path.join(root, "step-00000001")
    assert sorted(os.listdir(step)) == ["metadata.json", "rank-00000.safetensors", "rank-00001.safetensors"]


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_under_another_layout_continues_the_losses(name, tmp_path):
    (la, ca), (lb, cb) = RESUMES[name]
    root = str(tmp_path)
    a = comm.run_local(_world(la), _train, la, ca, root, 0, K + MORE, (K,), timeout=60)[0]
    b = comm.run_local(_world(lb), _train, lb, cb, root, K, MORE, (), True, timeout=60)
    for r in b:
        for got, want in zip(r["losses"], a["losses"][K:], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], a["losses"])
        assert r["extra"]["step"] == K and r["extra"]["loader"] == {"epoch": 0, "index": 4 * K}
        assert torch.equal(r["extra"]["rng"], torch.Generator().manual_seed(K).get_state())


@pytest.mark.parametrize("zero", [0, 2])
def test_same_layout_resume_is_bitwise(zero, tmp_path):
    layout, config = dict(dp=2), {"zero_stage": zero}
    root = str(tmp_path)
    a = comm.run_local(2, _train, layout, config, root, 0, K + MORE, (K,), timeout=60)
    b = comm.run_local(2, _train, layout, config, root, K, MORE, (), True, timeout=60)
    for ra, rb in zip(a, b):
        assert torch.equal(torch.tensor(rb["losses"]), torch.tensor(ra["losses"][K:]))
        for n, p in ra["params"].items():
            assert torch.equal(rb["params"][n], p), n


# -- (2) the files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [0, 2])
def test_each_tensor_written_once_latest_and_keep(zero, tmp_path):
    layout = dict(dp=2, tp=2)
    root = str(tmp_path)
    comm.run_local(4, _train, layout, {"zero_stage": zero}, root, 0, 3, (1, 2, 3), False, 2, timeout=60)
    assert sorted(os.listdir(root)) == ["latest", "step-00000002", "step-00000003"]
    assert latest_checkpoint(root) == os.path.join(root, "step-00000003")
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "step-00000003"
    step = os.path.join(root, "step-00000003")
    # without ZeRO only the dp = 0 ranks (0 and 1: tp 0 and 1) write; under ZeRO every rank writes
    # its own shard; sidecars were merged and removed
    writers = [0, 1, 2, 3] if zero else [0, 1]
    assert sorted(os.listdir(step)) == ["metadata.json"] + [f"rank-{r:05d}.safetensors" for r in writers]
    with open(os.path.join(step, "metadata.json")) as f:
        meta = json.load(f)
    full = dict(Llama(CFG).named_parameters())
    want_keys = {f"model/{n}" for n in full} | {f"optim/{n}/{k}" for n in full for k in ("exp_avg", "exp_avg_sq")}
    by_key: dict[str, list[dict]] = {}
    for e in meta["entries"]:
        by_key.setdefault(e["key"], []).append(e)
    assert set(by_key) == want_keys
    for key, es in by_key.items():
        name = key.split("/")[1]
        assert {tuple(e["shape"]) for e in es} == {tuple(full[name].shape)}, key
        count = torch.zeros(full[name].shape, dtype=torch.int32)
        for e in es:
            count[tuple(slice(lo, hi) for lo, hi in e["box"])] += 1
        assert torch.equal(count, torch.ones_like(count)), key  # every element written exactly once
        if not zero:
            assert len(es) == (1 if "norm" in name else 2), key  # tp slices; norms are whole
    stored = 0
    for r in writers:  # safetensors itself reads every piece, with the extent its box says
        fname = f"rank-{r:05d}.safetensors"
        with safe_open(os.path.join(step, fname), framework="pt") as f:
            stored += len(list(f.keys()))
            for e in (e for e in meta["entries"] if e["file"] == fname):
                assert list(f.get_tensor(e["name"]).shape) == [hi - lo for lo, hi in e["box"]], e
    assert stored == len(meta["entries"])
    assert set(meta["optimizer"]["scalars"]) == set(full)
    assert meta["optimizer"]["scalars"]["norm.weight"]["step"]["__tensor__"] == [3.0]
    assert meta["optimizer"]["param_groups"][0]["lr"] == LR
    assert meta["layout"] == {"dp": 2, "pp": 1, "cp": 1, "tp": 2, "ep": 1} and meta["parallel"]["zero_stage"] == zero


# -- (3) errors ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A root with two one-rank checkpoints (steps 1 and 2)."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    comm.run_local(1, _train, {}, {}, root, 0, 2, (1, 2), timeout=60)
    return root


@pytest.fixture
def root(saved, tmp_path) -> str:
    """A private copy of ``saved`` to damage."""
    dst = str(tmp_path / "root")
    shutil.copytree(saved, dst)
    return dst


def _load_error(path: str, cfg=CFG, with_optimizer: bool = True) -> str:
    def fn() -> str:
        model, opt = _build({}, {}, cfg)
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path, model, opt if with_optimizer else None)
        return str(info.value)

    return _solo(fn)


def test_no_checkpoint_at_the_path(tmp_path):
    assert "no checkpoint at" in _load_error(str(tmp_path / "nowhere"))
    assert "no checkpoint at" in _load_error(str(tmp_path))
    assert latest_checkpoint(str(tmp_path)) is None


def test_torn_write_names_the_incomplete_dir_and_the_previous_good_one(root):
    os.remove(os.path.join(root, "step-00000002", "metadata.json"))
    for path in (root, os.path.join(root, "step-00000002")):
        msg = _load_error(path)
        assert "step-00000002 is incomplete" in msg and "metadata.json" in msg
        assert "previous complete checkpoint" in msg and "step-00000001" in msg


def test_crash_before_rename_leaves_latest_on_the_previous_checkpoint(root):
    shutil.rmtree(os.path.join(root, "step-00000002"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step-00000001\n")
    tmp = os.path.join(root, "step-00000002.tmp")
    os.makedirs(tmp)
    with open(os.path.join(root, "step-00000001", "rank-00000.safetensors"), "rb") as f:
        partial = f.read()[:1000]
    with open(os.path.join(tmp, "rank-00000.safetensors"), "wb") as f:
        f.write(partial)
    assert latest_checkpoint(root) == os.path.join(root, "step-00000001")
    os.remove(os.path.join(root, "latest"))  # even without the pointer, .tmp never counts
    assert latest_checkpoint(root) == os.path.join(root, "step-00000001")

    def fn() -> int:
        model, opt = _build({}, {})
        return load_checkpoint(root, model, opt)["step"]

    assert _solo(fn) == 1
    assert "step-00000002.tmp is incomplete" in _load_error(tmp)


@pytest.mark.parametrize("damage, match", [
    ("delete", "rank-00000.safetensors is missing"),
    ("truncate", "rank-00000.safetensors is .* bytes but was written with .*truncated or corrupt"),
    ("flip", "rank-00000.safetensors is corrupt: its sha256 differs"),
])
def test_missing_or_damaged_shard_file_is_named(root, damage, match):
    path = os.path.join(root, "step-00000002", "rank-00000.safetensors")
    data = open(path, "rb").read()
    if damage == "delete":
        os.remove(path)
    else:
        data = data[:-100] if damage == "truncate" else data[:-100] + bytes(b ^ 0xFF for b in data[-100:])
        with open(path, "wb") as f:
            f.write(data)
    assert re.search(match, _load_error(root))


def test_missing_tensor_and_shape_mismatch_name_the_parameter(root):
    msg = _load_error(root, replace(CFG, n_layers=CFG.n_layers + 1))
    assert f"no tensor 'model/layers.{CFG.n_layers}." in msg and "config must match" in msg
    msg = _load_error(root, replace(CFG, dim=CFG.dim // 2))
    assert "parameter tok_emb.weight" in msg and "config must match" in msg
    assert str((CFG.vocab_size, CFG.dim)) in msg and str((CFG.vocab_size, CFG.dim // 2)) in msg


def test_optimizer_state_absent(tmp_path):
    root = str(tmp_path)

    def fn() -> str:
        model, opt = _build({}, {})
        save_checkpoint(root, 0, model, None, {})
        load_checkpoint(root, model, None)  # weights alone are fine
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(root, model, opt)
        return str(info.value)

    assert "has no optimizer state" in _solo(fn) and "optimizer=None" in _solo(fn)


def test_bad_extra_writes_nothing(tmp_path):
    def fn() -> str:
        model, opt = _build({}, {})
        with pytest.raises(CheckpointError) as info:
            save_checkpoint(str(tmp_path), 1, model, opt, {"x": object()})
        return str(info.value)

    assert "not JSON-serialisable" in _solo(fn)
    assert os.listdir(tmp_path) == []


def test_a_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    root = str(tmp_path)
    comm.run_local(2, _train, dict(tp=2), {}, root, 0, 1, (1,), timeout=60)
    os.remove(os.path.join(root, "step-00000001", "rank-00001.safetensors"))  # only tp rank 1 reads it

    def fn(rank: int) -> str:
        model, opt = _build(dict(tp=2), {})
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(root, model, opt)
        return str(info.value)

    msgs = comm.run_local(2, fn, timeout=60)
    assert all("rank-00001.safetensors is missing" in m for m in msgs), msgs
    assert "failed on rank 1" in msgs[0]


# -- (4) malicious input ---------------------------------------------------------------------------


def test_planted_pickles_are_never_loaded(root, tmp_path, monkeypatch):
    marker = str(tmp_path / "pwned")
    step = os.path.join(root, "step-00000002")
    for name in ("model.pt", "optimizer.pt", "rank-00000.pt", "extra.pkl"):
        with open(os.path.join(step, name), "wb") as f:
            f.write(evil_pickle(marker))

    def refuse(*a, **k):
        raise AssertionError("the checkpoint loader must not unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)

    def fn() -> int:
        model, opt = _build({}, {})
        return load_checkpoint(root, model, opt)["step"]

    assert _solo(fn) == 2  # the planted files are ignored
    # metadata pointing at a pickle: refused by name, never opened
    meta_path = os.path.join(step, "metadata.json")
    meta = json.load(open(meta_path))
    meta["entries"][0]["file"] = "rank-00000.pt"
    json.dump(meta, open(meta_path, "w"))
    assert "not a shard of this checkpoint" in _load_error(root)
    # a pickle disguised as the shard file: fails the size / hash check, never unpickled
    meta["entries"][0]["file"] = "rank-00000.safetensors"
    json.dump(meta, open(meta_path, "w"))
    shutil.copy(os.path.join(step, "rank-00000.pt"), os.path.join(step, "rank-00000.safetensors"))
    assert "rank-00000.safetensors" in _load_error(root)
    assert not os.path.exists(marker)
