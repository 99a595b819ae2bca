"""DataParallel and ZeRO-3 in real processes over gloo, against torch's own DDP and one process."""

from __future__ import annotations

import pytest
import torch

from meshtrain.comm.launch import spawn

from ._models import assert_close_state, batches, loss_fn, make_model, make_opt, reference, shard

pytestmark = pytest.mark.timeout(240)
STEPS, BATCH = 3, 24


def _ddp_vs_ours(rank: int) -> tuple[dict, dict, list[float]]:
    """Trains the same model with torch DDP and with meshtrain's DataParallel on the same data."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshtrain.parallel.data import DataParallel

    world = dist.get_world_size()
    out = []
    grad_diffs = []
    for kind in ("ddp", "ours"):
        model = make_model(seed=100)
        dp = DDP(model, bucket_cap_mb=0.003) if kind == "ddp" else DataParallel(model, bucket_cap_mb=0.003)
        opt = make_opt(model.parameters())
        grads = []
        for x, y in batches(STEPS, BATCH):
            opt.zero_grad()
            loss_fn(dp, shard(x, rank, world), shard(y, rank, world)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        out.append((model.state_dict(), grads))
    for ga, gb in zip(out[0][1], out[1][1]):
        grad_diffs.append(max((a - b).abs().max().item() for a, b in zip(ga, gb)))
    return out[0][0], out[1][0], grad_diffs


def test_data_parallel_matches_torch_ddp_over_gloo():
    want = reference(STEPS, BATCH, seed=100)
    for ddp_state, our_state, diffs in spawn(3, _ddp_vs_ours, timeout=200):
        assert max(diffs) < 1e-6
        assert_close_state(our_state, ddp_state)
        assert_close_state(our_state, want)


def _zero3(rank: int, stage: int) -> dict:
    import meshtrain.comm as mc
    from meshtrain.parallel.zero import ZeroModel, ZeroOptimizer

    world = mc.get_world_size()
    zm = ZeroModel(make_model(seed=100 + rank), stage=stage)
    zo = ZeroOptimizer(zm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for x, y in batches(STEPS, BATCH):
        zo.zero_grad()
        loss_fn(zm, shard(x, rank, world), shard(y, rank, world)).backward()
        zo.step()
    return zm.full_state_dict()


def test_zero3_over_gloo_matches_single_process():
    want = reference(STEPS, BATCH, seed=100)
    for got in spawn(2, _zero3, 3, timeout=200):
        assert_close_state(got, want)
