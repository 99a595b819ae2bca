"""Expert parallelism against one process: every layout of ep with dp, HSDP, ZeRO, tp (+SP), pp
(1F1B, interleaved), cp and activation checkpointing trains a mixture-of-experts Llama to the
one-process losses, with the first step's gradients (router, shared and every expert by name)
and the routing bias after the first update equal. The reference is the same model in one
process with a plain PyTorch loop, computed here."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from meshtrain import comm
from meshtrain.models.llama import PRESETS, Llama, init_weights
from meshtrain.models.moe import MoEStepInfo, finish_moe_step, moe_layers, set_moe_step

from ._parity import _split, assemble

BATCH, SEQ, LR, STEPS = 4, 16, 1e-3, 3
BASE = dataclasses.replace(PRESETS["moe-test"], aux_loss_coef=0.01, bias_update_rate=0.01)
VARIANTS = {
    "seq-aux": BASE,  # softmax, sequence-level loss, the bias on, a shared expert, layer 0 dense
    "sigmoid-batch": dataclasses.replace(BASE, router_score="sigmoid", aux_loss_level="batch", route_scale=2.5,
                                         n_shared_experts=0),
}


def batches(steps: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g) for _ in range(steps)]


@functools.lru_cache(maxsize=None)
def reference(variant: str, clip: float, autocast: bool = False) -> tuple[list, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process: losses (with the clipped norm when ``clip``), the first step's gradients, and
    every layer's routing bias after the first step's update."""
    cfg = VARIANTS[variant]
    model = Llama(cfg)
    init_weights(model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads, bias = [], {}, {}
    for i, d in enumerate(batches(STEPS, cfg.vocab_size)):
        set_moe_step(model, MoEStepInfo(global_rows=BATCH))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(d[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), d[:, 1:].flatten())
        loss.backward()
        finish_moe_step(model)  # the bias moves before the optimizer step
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            bias = {n: m.router.expert_bias.clone() for n, m in moe_layers(model)}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip else None
        opt.step()
        opt.zero_grad()
        losses.append((loss.item(), norm.item()) if clip else loss.item())
    return losses, grads, bias


def train_rank(rank: int, variant: str, layout: dict, config: dict, clip: float) -> tuple[list, dict, dict]:
    from meshtrain.mesh import Mesh
    from meshtrain.parallel.parallel_model import ParallelModel, unwrap
    from meshtrain.parallel.parallelize import ParallelConfig

    cfg = VARIANTS[variant]
    model = ParallelModel(cfg, Mesh(**layout), ParallelConfig(**config), seed=0)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR)
    losses, grads, bias = [], {}, {}
    for i, d in enumerate(batches(STEPS, cfg.vocab_size)):
        losses.append(model.forward_backward(d[:, :-1], d[:, 1:]).item())
        if i == 0:
            if not config.get("zero_stage"):
                grads = {n: (p.grad.clone(), _split(p)) for n, p in model.named_parameters()}
            for stage in model.stages.values():
                bias.update({n: m.router.expert_bias.clone() for n, m in moe_layers(unwrap(stage))})
        if clip:
            losses[-1] = (losses[-1], opt.clip_grad_norm_(clip).item())
        opt.step()
        opt.zero_grad()
    return losses, grads, bias


# (id, layout, parallel config, variant). Batch-level balancing is defined per global micro-batch,
# so it matches one process only with one micro-batch; sequence-level with any number.
LAYOUTS = [
    ("dp4-ep4", dict(dp=4, ep=4), {}, "seq-aux"),
    ("dp4-ep2-sigmoid-batch", dict(dp=4, ep=2), {}, "sigmoid-batch"),
    ("dp2xtp2-ep2", dict(dp=2, tp=2, ep=2), {}, "seq-aux"),
    ("dp2xtp2+sp-ep2", dict(dp=2, tp=2, ep=2), dict(sequence_parallel=True), "seq-aux"),
    ("dp2xpp2-ep2-1f1b", dict(dp=2, pp=2, ep=2), dict(microbatches=2), "seq-aux"),
    ("dp2xpp2-ep2-interleaved", dict(dp=2, pp=2, ep=2), dict(microbatches=2, schedule="interleaved",
                                                              virtual_stages=2), "seq-aux"),
    ("dp2xpp2-ep2-afab", dict(dp=2, pp=2, ep=2), dict(microbatches=2, schedule="afab"), "seq-aux"),
    ("dp2xcp2-ep2-ac", dict(dp=2, cp=2, ep=2), dict(activation_checkpointing="full"), "seq-aux"),
    ("dp4-ep1-zero2", dict(dp=4), dict(zero_stage=2), "seq-aux"),
    ("dp4-ep2-zero1", dict(dp=4, ep=2), dict(zero_stage=1), "seq-aux"),
    ("hsdp2x2-ep2-zero3", dict(dp=4, dp_replicate=2, ep=2), dict(zero_stage=3), "seq-aux"),
    ("dp2xtp2-ep2-zero3", dict(dp=2, tp=2, ep=2), dict(zero_stage=3), "sigmoid-batch"),
]


@pytest.mark.parametrize("name, layout, config, variant", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_moe_layout_matches_one_process(name, layout, config, variant):
    zero = bool(config.get("zero_stage"))
    clip = 1.0 if zero else 0.0  # ZeRO keeps gradients in flat shards: the global norm checks them
    world = layout["dp"] * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    ref_losses, ref_grads, ref_bias = reference(variant, clip)
    out = comm.run_local(world, train_rank, variant, layout, config, clip, timeout=120)
    for losses, _, bias in out:
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-5, atol=1e-5)
        for n, b in bias.items():  # every rank holding a layer has the one-process bias
            torch.testing.assert_close(b, ref_bias[n], rtol=0, atol=1e-7)
    held = {n for _, _, b in out for n in b}
    assert held == set(ref_bias)  # every MoE layer is held somewhere and checked
    if not zero:
        got = assemble([g for _, g, _ in out])
        assert set(got) == set(ref_grads)
        for n, g in ref_grads.items():  # by name: router, shared and every expert included
            torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{n}: {m}")


def test_bf16_zero3_keeps_the_router_in_fp32_and_follows_plain_autocast():
    """ZeRO-3 in bf16 gathers and computes the experts in bf16 but the router in fp32 (a rounded
    gate changes which experts win), and trains within bf16 tolerance of plain torch.autocast."""
    from meshtrain.mesh import Mesh
    from meshtrain.parallel.parallel_model import ParallelModel
    from meshtrain.parallel.parallelize import ParallelConfig

    fp32, _, _ = reference("seq-aux", 0.0)
    bf16, _, _ = reference("seq-aux", 0.0, autocast=True)
    assert max(abs(a - b) / b for a, b in zip(bf16, fp32)) > 1e-6  # autocast changed something

    def run(rank: int) -> tuple[list[float], set]:
        cfg = VARIANTS["seq-aux"]
        model = ParallelModel(cfg, Mesh(dp=2, ep=2), ParallelConfig(zero_stage=3, precision="bf16"), seed=0)
        dtypes = {(n.split(".")[-1] if "router" in n else "other", u.param_dtype)
                  for stage in model.stages.values() for u in stage.units for n in u.names}
        opt = model.build_optimizer(torch.optim.AdamW, lr=LR)
        losses = []
        for d in batches(STEPS, cfg.vocab_size):
            losses.append(model.forward_backward(d[:, :-1], d[:, 1:]).item())
            opt.step()
            opt.zero_grad()
        return losses, dtypes

    for losses, dtypes in comm.run_local(2, run, timeout=120):
        assert dtypes == {("weight", torch.float32), ("other", torch.bfloat16)}, dtypes
        assert max(abs(a - b) / b for a, b in zip(losses, bf16)) <= 2e-2, (losses, bf16)


def test_pipeline_stages_balance_the_parameters_a_token_uses():
    """Half the layers dense, half expert-heavy: balanced by parameter count, the stage with the
    dense layers would take more layers (and most of the compute); balanced by the parameters a
    token uses (2 of 16 experts), the busiest stage's compute is lower."""
    from meshtrain.parallel.pipeline.partition import _cost, _numel, balanced_partition, split_stages

    with torch.device("meta"):
        model = Llama(dataclasses.replace(PRESETS["moe-200m"], first_dense_layers=4))
    blocks = list(model.layers.values())
    active = [_cost(b) for b in blocks]
    assert active[4] < 2 * active[0] < _numel(blocks[4]) / 2  # active vs held, for one MoE layer

    def busiest(ranges: list[range]) -> float:
        return max(sum(active[i] for i in r) for r in ranges)

    by_count = balanced_partition([float(_numel(b)) for b in blocks], 2)
    by_active = balanced_partition(active, 2)
    assert busiest(by_active) < 0.9 * busiest(by_count), (by_count, by_active)
    stages = split_stages(model, 2, [0, 1])
    assert [len(stages[s].layers) for s in (0, 1)] != [len(r) for r in by_count]
