"""ZeRO CPU offload (``parallel.offload``, ``meshtrain/parallel/offload.py``): the same losses, norms
and saved state as without it for ZeRO-1/2/3 ("optimizer") and ZeRO-3 ("params"), through the
trainer's step code and through ``meshtrain train``; fp16 loss scaling with an overflow; checkpoints
that move between offloaded and not; where the masters, the optimizer state and the compute copy
live; and the device path (non-blocking copies, staging buffers, events) under the accelerator
double of ``tests/_accelerator.py``."""

from __future__ import annotations

import json

import pytest
import torch

from meshtrain import comm
from meshtrain.cli import main
from meshtrain.mesh import Mesh
from meshtrain.parallel.parallel_model import ParallelModel, ParallelOptimizer
from meshtrain.parallel.parallelize import ParallelConfig
from meshtrain.parallel.precision import DynamicLossScaler
from meshtrain.train.checkpoint import load_checkpoint, save_checkpoint
from meshtrain.train.step import apply_step, measure_step

from .._accelerator import as_accelerator
from ._parity import CFG, LR, batches

CASES = [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params")]
STEPS = 3
ACCELERATOR = "cpu-as-accelerator"


def _build(stage: int, offload: str, seed: int = 0, device: str = "cpu", precision: str = "fp32"):
    model = ParallelModel(CFG, Mesh(dp=2), ParallelConfig(zero_stage=stage, offload=offload, precision=precision),
                          seed=seed, device=device)
    # the same AdamW kernel both ways (offload would pick fused by itself; a plain CPU run would not)
    return model, model.build_optimizer(torch.optim.AdamW, lr=LR, fused=True)


def _steps(model: ParallelModel, opt: ParallelOptimizer, data: list[torch.Tensor],
           scaler: DynamicLossScaler | None = None) -> list[tuple]:
    """The trainer's step (``train/step.py``): unscale (fp16), clip to 1.0, step or skip."""
    out = []
    for d in data:
        d = d.to(model.engine.device)
        res = measure_step(model, opt, d[:, :-1], d[:, 1:], 1.0, scaler)
        apply_step(opt, res, scaler)
        out.append((res.loss, res.grad_norm, res.overflow))
    return out


def _state(opt: ParallelOptimizer) -> tuple[dict, dict]:
    zo = opt.optimizers[0]
    return zo.model.shard_state_dict(), zo.state_dict()


def _train(rank: int, stage: int, offload: str, device: str = "cpu") -> tuple[list, tuple]:
    model, opt = _build(stage, offload, device=device)
    return _steps(model, opt, batches(STEPS)), _state(opt)


def _same(a, b) -> bool:
    """Nested state dicts equal bitwise (tensors wherever they live)."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_offload_gives_the_losses_norms_and_state_of_no_offload():
    """Bitwise: the same AdamW kernel on the same fp32 shards, wherever they live."""
    want = {stage: comm.run_local(2, _train, stage, "none", timeout=60) for stage in (1, 2, 3)}
    for stage, offload in CASES:
        got = comm.run_local(2, _train, stage, offload, timeout=60)
        for rank in range(2):
            assert got[rank][0] == want[stage][rank][0], (stage, offload, got[rank][0], want[stage][rank][0])
            assert _same(got[rank][1], want[stage][rank][1]), (stage, offload, "saved state differs")


def _layout_run(rank: int, layout: dict, config: dict) -> list[tuple]:
    model = ParallelModel(CFG, Mesh(**layout), ParallelConfig(**config), seed=0)
    return _steps(model, model.build_optimizer(torch.optim.AdamW, lr=LR, fused=True), batches(STEPS))


@pytest.mark.parametrize("layout, config", [
    ({"dp": 4, "dp_replicate": 2}, {"zero_stage": 2, "offload": "optimizer"}),  # HSDP: replicas averaged first
    ({"dp": 2, "pp": 2}, {"zero_stage": 3, "microbatches": 2, "offload": "params"}),  # units kept across micro-batches
], ids=["hsdp-zero2", "pp2-zero3-params"])
def test_offload_composes_with_hsdp_and_pipelines(layout, config):
    ranks = layout["dp"] * layout.get("pp", 1)
    want = comm.run_local(ranks, _layout_run, layout, {**config, "offload": "none"}, timeout=60)
    assert comm.run_local(ranks, _layout_run, layout, config, timeout=60) == want


def test_the_trainer_with_offload_matches_the_trainer_without(tmp_path):
    """``meshtrain train --parallel.offload=params``: the key reaches ZeRO, and the host optimizer's
    default kernel (fused) stays within 1e-6 of a plain CPU run's per-tensor AdamW."""
    common = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
              "--train.seq_len=32", "--train.warmup_steps=1", "--no-progress", "--comm.transport=local",
              "--train.steps=3", "--parallel.dp=2", "--parallel.tp=1", "--parallel.zero_stage=3",
              "--checkpoint.enabled=false"]
    rows = {}
    for offload in ("none", "params"):
        assert main(["train", f"--out={tmp_path / offload}", *common, f"--parallel.offload={offload}"]) == 0
        rows[offload] = [json.loads(line) for line in (tmp_path / offload / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows["params"], rows["none"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"]


def test_fp16_unscales_the_shard_gradients_the_host_optimizer_reads(monkeypatch):
    """An inf put into the last rank's shard gradient at step 1 skips that step on both ranks and
    halves the scale; unscaling and clipping act on the device gradient that is then copied to the
    host, so every loss, norm and the saved state equal the run without offload."""
    real = ParallelOptimizer.unscale_
    calls: dict[int, int] = {}

    def unscale_(self, scaler):
        n = calls[id(self)] = calls.get(id(self), -1) + 1
        if n == 1 and comm.get_rank() == 1:
            self._grad_pieces()[0][0].view(-1)[0] = float("inf")
        return real(self, scaler)

    monkeypatch.setattr(ParallelOptimizer, "unscale_", unscale_)

    def fn(rank, offload):
        model, opt = _build(2, offload, precision="fp16")
        scaler = DynamicLossScaler(2.0 ** 12, growth_interval=2)
        return _steps(model, opt, batches(STEPS + 1), scaler), scaler.state_dict(), _state(opt)

    want = comm.run_local(2, fn, "none", timeout=60)
    got = comm.run_local(2, fn, "optimizer", timeout=60)
    assert [o for _, _, o in want[0][0]] == [False, True, False, False]
    for g, w in zip(got, want):
        assert g[0] == w[0] and g[1] == w[1] and _same(g[2], w[2])


def test_checkpoints_move_between_offloaded_and_not(tmp_path):
    """ZeRO-3 saved without offload resumes with offload ("optimizer": its device shard, already
    uploaded by a step of other weights, is stale after the load and is copied again), and saved
    with "params" resumes without: the saved pieces are the same fp32 masters and moments wherever
    they lived."""
    data = batches(4)

    def fn(rank):
        plain, plain_opt = _build(3, "none")
        _steps(plain, plain_opt, data[:2])
        save_checkpoint(str(tmp_path / "plain"), 2, plain, plain_opt)
        want = _steps(plain, plain_opt, data[2:])
        off, off_opt = _build(3, "params")
        _steps(off, off_opt, data[:2])
        save_checkpoint(str(tmp_path / "offloaded"), 2, off, off_opt)
        got = {}
        for saved, offload in (("plain", "optimizer"), ("offloaded", "none")):
            model, opt = _build(3, offload, seed=1)  # other weights and state until loaded
            _steps(model, opt, data[3:])
            load_checkpoint(str(tmp_path / saved), model, opt)
            got[saved] = _steps(model, opt, data[2:])
        return want, got

    for want, got in comm.run_local(2, fn, timeout=60):
        assert got["plain"] == want and got["offloaded"] == want


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda), ACCELERATOR])
def test_masters_and_optimizer_state_are_host_tensors_beside_a_compute_copy(device, monkeypatch):
    """After a step: every master and AdamW state tensor is on the host (pinned where a GPU computes),
    the compute copy (full parameters; ZeRO-3's kept shard) is another tensor on the compute
    device; "params" keeps no shard there. The device path stages gradients in a host buffer of
    its own; on the host the optimizer reads the gradient as it is. Under the accelerator double
    the device path runs and the losses still equal the run without offload."""
    accelerator = device == ACCELERATOR
    if accelerator:
        as_accelerator(monkeypatch)
        device = "cpu"

    device_path = accelerator or device == "cuda"
    pinned = device_path and torch.cuda.is_available()  # page-locked memory needs CUDA

    def fn(rank):
        out = {}
        for stage, offload in ((2, "optimizer"), (3, "optimizer"), (3, "params")):
            model, opt = _build(stage, offload, device=device)
            out[stage, offload] = _steps(model, opt, batches(2))
            zo = opt.optimizers[0]
            for u in zo.model.units:
                assert u.master.device.type == "cpu" and u.master.is_pinned() == pinned
                state = zo.optimizer.state[u.master]
                assert {"exp_avg", "exp_avg_sq"} <= state.keys()
                assert all(v.device.type == "cpu" for v in state.values() if torch.is_tensor(v))
                assert u.full.device.type == device and u.full.dtype == torch.float32
                if stage < 3:  # full parameters kept, in their own storage
                    assert u.full.untyped_storage().data_ptr() != u.master.untyped_storage().data_ptr()
                shard = u.offload.shard
                if offload == "params":
                    assert shard is None
                elif stage == 3:
                    assert shard.device.type == device and shard.data_ptr() != u.master.data_ptr()
                    assert torch.equal(shard.cpu(), u.master.detach().cpu())
                assert u.grad is None and u.master.grad is None  # zero_grad after the step
                assert (u.offload.staging is not None) == device_path, device
                if device_path:
                    assert u.offload.staging.is_pinned() == pinned
        return out

    results = comm.run_local(2, fn, timeout=120)
    if accelerator:  # the device path trains as the host path does
        for stage, offload in ((2, "optimizer"), (3, "optimizer"), (3, "params")):
            want = comm.run_local(2, _steps_of, stage, timeout=60)
            assert [r[stage, offload] for r in results] == want


def _steps_of(rank: int, stage: int) -> list[tuple]:
    model, opt = _build(stage, "none")
    return _steps(model, opt, batches(2))
