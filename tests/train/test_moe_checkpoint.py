"""Checkpoints of a mixture-of-experts model hold each expert by its global index: a resume at the
same layout is bitwise, one under another ep (1, 2, 4) or dense layout continues the losses of the
run that never stopped (routing bias included), and a model with another expert count is refused
by name. Ranks are threads; the reference is the same run without a stop."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from meshtrain import comm
from meshtrain.errors import ConfigError
from meshtrain.mesh import Mesh
from meshtrain.models.llama import PRESETS
from meshtrain.models.moe import moe_layers
from meshtrain.parallel.parallel_model import ParallelModel, unwrap
from meshtrain.parallel.parallelize import ParallelConfig
from meshtrain.train.checkpoint import load_checkpoint, save_checkpoint
from meshtrain.train.checkpoint_io import CheckpointReader

CFG = dataclasses.replace(PRESETS["moe-test"], aux_loss_coef=0.01, bias_update_rate=0.01)
K, MORE, LR = 2, 2, 1e-3


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, CFG.vocab_size, (4, 17), generator=g) for _ in range(n)]


def _train(rank: int, layout: dict, config: dict, root: str, start: int, steps: int, save: bool = False,
           load: bool = False, cfg=CFG) -> dict:
    model = ParallelModel(cfg, Mesh(**layout), ParallelConfig(**config), seed=0)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR)
    if load:
        load_checkpoint(root, model, opt)
    bias = {n: m.router.expert_bias.clone() for s in model.stages.values() for n, m in moe_layers(unwrap(s))}
    losses = []
    for i, d in enumerate(_batches(start + steps)[start:], start=start + 1):
        losses.append(model.forward_backward(d[:, :-1], d[:, 1:]).item())
        opt.step()
        opt.zero_grad()
        if save and i == K:
            save_checkpoint(root, i, model, opt, {"step": i})
    params = {} if config.get("zero_stage") else {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "bias": bias, "params": params}


def _world(layout: dict) -> int:
    return math.prod(v for k, v in layout.items() if k not in ("dp_replicate", "ep"))


RESHARDS = {
    "dp2-ep2->one-rank": ((dict(dp=2, ep=2), {}), (dict(), {})),
    "dp4-ep4->dp2xtp2-ep2": ((dict(dp=4, ep=4), {}), (dict(dp=2, tp=2, ep=2), {})),
    "hsdp-ep2-zero3->dp4-ep4-zero1": ((dict(dp=4, dp_replicate=2, ep=2), dict(zero_stage=3)),
                                      (dict(dp=4, ep=4), dict(zero_stage=1))),
    "dp2xpp2-ep2->tp2-ep1": ((dict(dp=2, pp=2, ep=2), dict(microbatches=2)), (dict(tp=2), {})),
}


@pytest.mark.parametrize("name", list(RESHARDS))
def test_moe_resume_under_another_layout_continues_the_losses(name, tmp_path):
    (la, ca), (lb, cb) = RESHARDS[name]
    a = comm.run_local(_world(la), _train, la, ca, str(tmp_path), 0, K + MORE, True, timeout=90)[0]
    # the experts are stored whole, by global index, whatever ep saved them
    reader = CheckpointReader(str(tmp_path / f"step-{K:08d}"))
    try:
        assert reader.global_shape("model/layers.1.mlp.experts.w1") == [CFG.n_experts, CFG.moe_ffn_dim, CFG.dim]
    finally:
        reader.close()
    b = comm.run_local(_world(lb), _train, lb, cb, str(tmp_path), K, MORE, False, True, timeout=90)
    for r in b:
        assert r["bias"] and any(bool(v.abs().sum()) for v in r["bias"].values())  # the bias was restored
        for got, want in zip(r["losses"], a["losses"][K:], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], a["losses"])


@pytest.mark.parametrize("layout, config", [(dict(dp=2, ep=2), {}), (dict(dp=2, ep=2), dict(zero_stage=3))])
def test_moe_same_layout_resume_is_bitwise(layout, config, tmp_path):
    a = comm.run_local(2, _train, layout, config, str(tmp_path), 0, K + MORE, True, timeout=90)
    b = comm.run_local(2, _train, layout, config, str(tmp_path), K, MORE, False, True, timeout=90)
    for ra, rb in zip(a, b):
        assert torch.equal(torch.tensor(rb["losses"]), torch.tensor(ra["losses"][K:]))
        for n, p in ra["params"].items():
            assert torch.equal(rb["params"][n], p), n


def test_another_expert_count_is_a_named_config_error(tmp_path):
    comm.run_local(1, _train, {}, {}, str(tmp_path), 0, K, True, timeout=60)
    other = dataclasses.replace(CFG, n_experts=4)
    with pytest.raises(ConfigError, match=r"holds 8 experts per layer .* model.n_experts = 4; set model.n_experts = 8"):
        comm.run_local(1, _train, {}, {}, str(tmp_path), K, 1, False, True, other, timeout=60)
