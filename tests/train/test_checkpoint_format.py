"""The checkpoint format 2 pieces: boxes cut from ZeRO's flat shards, streamed shard files that
safetensors reads, reads of any box through a tiny buffer, the save-time tiling check, a file that
does not match its metadata; and that a ZeRO save or load moves no shard between ranks.

Reference values come from plain tensor slicing of the tensors written.
"""

from __future__ import annotations

import json
import math
import os
import threading

import pytest
import torch
from safetensors import safe_open

from meshtrain import comm
from meshtrain.errors import CheckpointError
from meshtrain.mesh import Mesh
from meshtrain.parallel.parallel_model import ParallelModel
from meshtrain.parallel.parallelize import ParallelConfig
from meshtrain.parallel.zero_state import flat_boxes
from meshtrain.train import checkpoint_io
from meshtrain.train.checkpoint import load_checkpoint, save_checkpoint
from meshtrain.train.checkpoint_io import (FORMAT, METADATA, VERSION, CheckpointReader, merge_sidecars,
                                           write_rank_shard)

from .test_checkpoint_compat import TINY


def _write(path: str, full: dict[str, torch.Tensor], ranks: int) -> None:
    """Write each tensor as ``ranks`` ZeRO-like flat ranges (cut into boxes), one file per rank."""
    os.makedirs(path)
    for r in range(ranks):
        pieces = []
        for key, t in full.items():
            n = t.numel()
            a, b = r * -(-n // ranks), min(n, (r + 1) * -(-n // ranks))
            for box, start in flat_boxes(list(t.shape), a, b):
                ext = [hi - lo for lo, hi in box]
                pieces.append((key, t.reshape(-1)[start : start + math.prod(ext)].view(ext), list(t.shape), box))
        write_rank_shard(path, r, pieces, {})
    entries, files, _ = merge_sidecars(path)
    meta = {"format": FORMAT, "version": VERSION, "files": files, "entries": entries, "optimizer": None}
    with open(os.path.join(path, METADATA), "w") as f:
        json.dump(meta, f)


def test_flat_ranges_tile_the_tensor_and_any_box_reads_back_through_a_tiny_buffer(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(7, 10, generator=g), "b": torch.randn(3, 4, 5, generator=g).bfloat16(),
            "c": torch.randn(11, generator=g)}
    path = str(tmp_path / "ck")
    _write(path, full, ranks=3)
    for r in range(3):  # safetensors itself reads the streamed files
        with safe_open(os.path.join(path, f"rank-{r:05d}.safetensors"), framework="pt") as f:
            assert len(list(f.keys())) > 0
    monkeypatch.setattr(checkpoint_io, "CHUNK", 24)  # a few rows per read: the chunking is exercised
    boxes = {"a": [((0, 7), (0, 10)), ((2, 5), (3, 9)), ((6, 7), (0, 1))],
             "b": [((0, 3), (0, 4), (0, 5)), ((1, 3), (1, 2), (2, 5))], "c": [((0, 11),), ((4, 9),)]}
    with CheckpointReader(path) as reader:
        for key, bs in boxes.items():
            for box in bs:
                want = full[key][tuple(slice(lo, hi) for lo, hi in box)]
                assert torch.equal(reader.read(key, list(box)), want), (key, box)
                dst = torch.empty(want.shape, dtype=torch.float64)  # converted on the way in
                reader.read_into(reader.plan(key, box), dst)
                assert torch.equal(dst, want.double()), (key, box)


def test_a_save_that_writes_an_element_twice_or_never_is_refused(tmp_path):
    t = torch.arange(12.0).view(3, 4)
    for boxes in ([((0, 2), (0, 4)), ((1, 3), (0, 4))], [((0, 2), (0, 4))]):  # overlap / a gap
        path = tmp_path / f"ck{len(boxes)}"
        os.makedirs(path)
        write_rank_shard(str(path), 0, [("x", t[slice(*b[0])], [3, 4], b) for b in boxes], {})
        with pytest.raises(CheckpointError, match="expected each element exactly once"):
            merge_sidecars(str(path))


def test_a_shard_file_that_does_not_match_its_metadata_is_named(tmp_path):
    path = str(tmp_path / "ck")
    _write(path, {"a": torch.randn(4, 6)}, ranks=2)
    meta = json.load(open(os.path.join(path, METADATA)))
    e = meta["entries"][0]
    e["box"] = [[e["box"][0][0], e["box"][0][1]], [0, 3]]  # claims fewer columns than the file holds
    json.dump(meta, open(os.path.join(path, METADATA), "w"))
    with CheckpointReader(path) as reader, pytest.raises(CheckpointError) as info:
        reader.plan("a", tuple(tuple(b) for b in e["box"]))
    msg = str(info.value)
    assert e["file"] in msg and "as metadata.json describes it" in msg and "resume from another" in msg


ACTIVE: dict[int, int] = {}  # thread (a rank) -> all-gathers it issued inside a save or load


def _counting(real):
    def gather(*a, **k):
        if threading.get_ident() in ACTIVE:
            ACTIVE[threading.get_ident()] += 1
        return real(*a, **k)
    return gather


def _zero(rank: int, stage: int, root: str, load: bool) -> tuple[int, int, int, int]:
    """dp2 ZeRO on TINY: one step, then save (or load); the all-gathers the step issued (the
    counter works) and those the save (load) issued, the bytes of this rank's fp32 master shard and
    the number of ZeRO units (stages 1/2: buckets of bucket_cap_mb; 3: one per block and the root)."""
    model = ParallelModel(TINY, Mesh(dp=2), ParallelConfig(zero_stage=stage), seed=0)
    opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3)
    d = torch.randint(0, TINY.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    ACTIVE[threading.get_ident()] = 0
    model.forward_backward(d[:, :-1], d[:, 1:])
    opt.step()
    in_step = ACTIVE[threading.get_ident()]
    ACTIVE[threading.get_ident()] = 0
    if load:
        load_checkpoint(root, model, opt)
    else:
        save_checkpoint(root, 1, model, opt, {})
    shard = sum(u.shard_size for s in model.stages.values() for u in s.units) * 4
    units = sum(len(s.units) for s in model.stages.values())
    return in_step, ACTIVE.pop(threading.get_ident()), shard, units


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_zero_save_gathers_nothing_and_each_rank_writes_its_own_shard(stage, tmp_path, monkeypatch):
    monkeypatch.setattr(comm, "all_gather_into_tensor", _counting(comm.all_gather_into_tensor))
    root = str(tmp_path)
    saved = comm.run_local(2, _zero, stage, root, False, timeout=60)
    assert all(n > 0 for n, _, _, _ in saved)  # a ZeRO step gathers its units (the counter works)
    assert [g for _, g, _, _ in saved] == [0, 0]  # no rank gathered a shard to save
    step = os.path.join(root, "step-00000001")
    for r, (_, _, shard, _) in enumerate(saved):
        size = os.path.getsize(os.path.join(step, f"rank-{r:05d}.safetensors"))
        # master + AdamW's two moments of its own shard, plus the header; nothing of the other rank
        assert 3 * shard * 0.9 < size < 3 * shard + 64 * 1024, (size, shard)
    loaded = comm.run_local(2, _zero, stage, root, True, timeout=60)
    # a load reads only this rank's shard; stages 1 and 2 then refresh their full compute parameters
    # (one all-gather per unit, into the buffers they always keep); ZeRO-3 gathers at the next forward
    assert [g for _, g, _, _ in loaded] == [0 if stage == 3 else units for _, _, _, units in loaded]
    if stage == 3:
        assert loaded[0][3] == 1 + TINY.n_layers  # the root unit (embedding, norm, head) and one per block


def test_a_checkpoint_that_does_not_fit_changes_nothing_on_any_rank(tmp_path):
    """Rank 1's shard file is gone: every rank raises, and no rank has changed a parameter or its
    optimizer state (the load checks everything before any rank reads into the model)."""
    root = str(tmp_path)

    def save(rank: int) -> None:
        model = ParallelModel(TINY, Mesh(tp=2), ParallelConfig(), seed=0)
        save_checkpoint(root, 1, model, model.build_optimizer(torch.optim.AdamW, lr=1e-3), {})

    comm.run_local(2, save, timeout=60)
    os.remove(os.path.join(root, "step-00000001", "rank-00001.safetensors"))

    def load(rank: int) -> tuple[str, bool]:
        model = ParallelModel(TINY, Mesh(tp=2), ParallelConfig(), seed=5)  # other values than saved
        opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(root, model, opt)
        same = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        return str(info.value), same and not opt.optimizers[0].state

    for msg, unchanged in comm.run_local(2, load, timeout=60):
        assert "rank-00001.safetensors is missing" in msg and unchanged
