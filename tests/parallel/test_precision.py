"""Mixed precision under ZeRO: bf16/fp16 compute with fp32 masters, reduction dtype, loss scaling."""

from __future__ import annotations

import pytest
import torch

from meshtrain import comm
from meshtrain.parallel.precision import DynamicLossScaler, MixedPrecision
from meshtrain.parallel.zero import ZeroModel, ZeroOptimizer

from ._models import batches, loss_fn, make_model, reference, shard

STEPS, BATCH = 5, 24


def _train(rank, world, stage, mp):
    model = make_model(seed=100)
    zm = ZeroModel(model, stage=stage, mixed_precision=mp)
    # SGD: its update is linear in the gradient, so half-precision rounding stays small and
    # measurable (Adam's normalisation would amplify the rounding of near-zero gradients).
    zo = ZeroOptimizer(zm, torch.optim.SGD, lr=0.05, momentum=0.9)
    comm.reset_stats()
    dtypes = {p.dtype for p in model.parameters()} if stage < 3 else {u.full.dtype for u in zm.units}
    for x, y in batches(STEPS, BATCH):
        zo.zero_grad()
        loss_fn(zm, shard(x, rank, world), shard(y, rank, world)).backward()
        zo.step()
    ops = comm.stats()[0]["ops"]
    rs = sum(ops[k]["sent_bytes"] for k in ("reduce_scatter_tensor", "all_to_all") if k in ops)
    return zm.full_state_dict(), dtypes, {u.master.dtype for u in zm.units}, rs


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_compute_keeps_fp32_masters_and_tracks_fp32_training(stage, dtype):
    want = reference(STEPS, BATCH, seed=100, opt="sgd")
    mp = MixedPrecision(param_dtype=dtype, output_dtype=torch.float32)
    for state, dtypes, master, _ in comm.run_local(2, _train, 2, stage, mp, timeout=60):
        assert dtypes == {dtype} and master == {torch.float32}
        for k, v in want.items():
            assert v.dtype == state[k].dtype == torch.float32
            if k == "shift":  # a buffer, held in the compute dtype: equal up to its rounding
                eps = torch.finfo(dtype).eps
                torch.testing.assert_close(state[k], v, atol=eps * v.abs().max().item(), rtol=eps)
                continue
            w0 = make_model(seed=100).state_dict()[k]
            # relative to how far training moved the weights, half-precision compute may drift by
            # a few units of the dtype's rounding (bf16: 2^-7, fp16: 2^-10), not more
            rel = ((state[k] - v).norm() / (v - w0).norm()).item()
            assert rel < 10 * torch.finfo(dtype).eps, (k, rel)


def test_reducing_in_bf16_halves_the_reduce_scatter_bytes():
    fp32 = comm.run_local(2, _train, 2, 2, MixedPrecision(torch.bfloat16, torch.float32), timeout=60)[0][3]
    bf16 = comm.run_local(2, _train, 2, 2, MixedPrecision(torch.bfloat16, torch.bfloat16), timeout=60)[0][3]
    assert bf16 * 2 == fp32


def test_loss_scaler_skips_the_step_on_every_rank_when_one_overflows():
    def fn(rank):
        model = make_model(seed=100)
        zm = ZeroModel(model, stage=2, mixed_precision=MixedPrecision(torch.float16, output_dtype=torch.float32))
        zo = ZeroOptimizer(zm, torch.optim.AdamW, lr=1e-2)
        scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=2)
        x, y = batches(1, 8)[0]
        before = zm.full_state_dict()
        loss = loss_fn(zm, x, y)
        if rank == 1:
            loss = loss * float("inf")  # only rank 1 overflows
        scaler.scale_loss(loss).backward()
        took1 = zo.step(scaler)
        after1 = zm.full_state_dict()
        unchanged = all(torch.equal(before[k], after1[k]) for k in before)
        scale1 = scaler.scale
        results = []
        for _ in range(2):
            zo.zero_grad()
            scaler.scale_loss(loss_fn(zm, x, y)).backward()
            results.append(zo.step(scaler))
        changed = any(not torch.equal(after1[k], v) for k, v in zm.full_state_dict().items())
        return took1, unchanged, scale1, results, scaler.scale, changed

    for took1, unchanged, scale1, results, scale, changed in comm.run_local(2, fn, timeout=60):
        assert took1 is False and unchanged and scale1 == 512.0
        assert results == [True, True] and scale == 1024.0 and changed


def test_mixed_precision_rejects_other_dtypes():
    with pytest.raises(ValueError, match="param_dtype"):
        MixedPrecision(param_dtype=torch.int8)
