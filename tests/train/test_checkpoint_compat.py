"""Checkpoints written by the format-1 code (before per-rank ZeRO shards) still load, under another
layout, and the run continues with the losses of the run that never stopped.

``fixtures/checkpoint_v1`` was written by ``python -m tests.train.test_checkpoint_compat`` with the
format-1 code (commit fcfac5b): a tiny Llama trained 2 steps on dp2 x tp2 with ZeRO-1 (whose save
gathered the full state and wrote it from the dp = 0 ranks). The reference is computed here: the
same run, continued without a stop.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from meshtrain import comm
from meshtrain.errors import CheckpointError
from meshtrain.mesh import Mesh
from meshtrain.models.llama import LlamaConfig
from meshtrain.parallel.parallel_model import ParallelModel
from meshtrain.parallel.parallelize import ParallelConfig
from meshtrain.train.checkpoint import load_checkpoint, save_checkpoint

from ..parallel._parity import LR, batches

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoint_v1")
TINY = LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
SAVED_LAYOUT, SAVED_CONFIG, K, MORE = dict(dp=2, tp=2), dict(zero_stage=1), 2, 2


def _run(rank: int, layout: dict, config: dict, root: str | None, start: int, steps: int,
         save_at: int = -1) -> list[float]:
    """Train steps start+1..start+steps of TINY (resuming from ``root`` if start > 0, saving there
    after step ``save_at``); return the losses."""
    model = ParallelModel(TINY, Mesh(**layout), ParallelConfig(**config), seed=0)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR)
    if start:
        assert load_checkpoint(root, model, opt)["step"] == start
    losses = []
    for i, d in enumerate(batches(start + steps)[start:], start=start + 1):
        losses.append(model.forward_backward(d[:, :-1], d[:, 1:]).item())
        opt.step()
        opt.zero_grad()
        if i == save_at:
            save_checkpoint(root, i, model, opt, {"step": i})
    return losses


@pytest.mark.parametrize("layout, config", [(dict(dp=2), dict(zero_stage=3)), (dict(tp=2), {})])
def test_a_format_1_checkpoint_resumes_under_another_layout(layout, config, tmp_path):
    with open(os.path.join(FIXTURE, "step-00000002", "metadata.json")) as f:
        assert json.load(f)["version"] == 1  # the fixture is the old format, not a re-save
    want = comm.run_local(4, _run, SAVED_LAYOUT, SAVED_CONFIG, None, 0, K + MORE, timeout=60)[0][K:]
    root = str(tmp_path / "ckpt")
    shutil.copytree(FIXTURE, root)
    world = layout.get("dp", 1) * layout.get("tp", 1)
    for got in comm.run_local(world, _run, layout, config, root, K, MORE, timeout=60):
        for g, w in zip(got, want, strict=True):
            assert abs(g - w) <= 1e-5 * abs(w), (got, want)


def test_an_unknown_format_version_names_the_versions_this_code_reads(tmp_path):
    root = str(tmp_path / "ckpt")
    shutil.copytree(FIXTURE, root)
    path = os.path.join(root, "step-00000002", "metadata.json")
    meta = json.load(open(path))
    meta["version"] = 99
    json.dump(meta, open(path, "w"))

    def fn(rank: int) -> str:
        model = ParallelModel(TINY, Mesh(), ParallelConfig(), seed=0)
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(root, model, None)
        return str(info.value)

    msg = comm.run_local(1, fn, timeout=30)[0]
    assert "version 99" in msg and "1, 2" in msg


if __name__ == "__main__":  # regenerate the fixture (only meaningful with the format-1 code)
    shutil.rmtree(FIXTURE, ignore_errors=True)
    comm.run_local(4, _run, SAVED_LAYOUT, SAVED_CONFIG, FIXTURE, 0, K, K, timeout=120)
    sys.exit(0)
