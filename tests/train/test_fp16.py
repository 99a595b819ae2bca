"""``train.precision = "fp16"``: dynamic loss scaling in the trainer's step (``meshtrain/train/step.py``).

An inf forced into ONE rank's gradients at one step skips that step on every rank of each layout,
halves the scale, and the losses and clipped norms equal a plain PyTorch loop with
``torch.amp.GradScaler`` (same init scale, growth interval and injected overflow) computed here;
the scale grows after its interval; the trainer logs the scale and the skipped steps and keeps them
in checkpoints; bad values are named.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from meshtrain import comm
from meshtrain.cli import main
from meshtrain.config.check import validate
from meshtrain.errors import ConfigError
from meshtrain.models.llama import PRESETS, Llama, LlamaConfig, init_weights
from meshtrain.models.moe import MoEStepInfo, finish_moe_step, set_moe_step
from meshtrain.parallel.parallel_model import ParallelOptimizer
from meshtrain.train.config import TrainSection, load_config
from meshtrain.train.trainer import TrainingDiverged, lr_at, train

from ..parallel._parity import CFG, LR, batches
from .test_trainer import SMALL

STEPS, OVERFLOW_AT, INIT, INTERVAL, CLIP = 5, 2, 2.0 ** 16, 2, 1.0  # OVERFLOW_AT: 0-based step index
SCHEDULE = TrainSection(steps=STEPS, warmup_steps=1, lr=LR, min_lr=LR / 10)  # the trainer's warmup + cosine
MOE = dataclasses.replace(PRESETS["moe-test"], aux_loss_coef=0.01, bias_update_rate=0.01)


def _poison(g: torch.Tensor) -> None:
    g[(0,) * g.dim()] = float("inf")


@pytest.fixture
def overflow_once(monkeypatch):
    """Put an inf into the gradient the last rank holds (a ZeRO shard, a tp slice, a pipeline
    stage's) right before unscaling, at the optimizer's 0-based step ``at``; set ``at`` to arm it."""
    real = ParallelOptimizer.unscale_
    calls: dict[int, int] = {}
    armed = {"at": None}

    def unscale_(self, scaler):
        n = calls[id(self)] = calls.get(id(self), -1) + 1
        if n == armed["at"] and comm.get_rank() == comm.get_world_size() - 1:
            _poison(self._grad_pieces()[0][0])
        return real(self, scaler)

    monkeypatch.setattr(ParallelOptimizer, "unscale_", unscale_)
    return armed


def reference(cfg: LlamaConfig, overflow_at: int | None) -> tuple[list[tuple[float, float]], list[float]]:
    """One process, plain PyTorch: fp16 autocast, GradScaler, unscale then clip, AdamW and an LR
    scheduler stepped every iteration (a skipped step included). Returns (loss, norm) per step and
    the scale each step's backward used."""
    model = Llama(cfg)
    init_weights(model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_at(i + 1, SCHEDULE) / LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)
    out, scales = [], []
    for i, d in enumerate(batches(STEPS)):
        scales.append(scaler.get_scale())
        if cfg.n_experts:  # the injected auxiliary-loss gradient is scaled like the loss (Megatron)
            set_moe_step(model, MoEStepInfo(global_rows=d.shape[0], loss_scale=scaler.get_scale()))
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(d[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), d[:, 1:].flatten())
        scaler.scale(loss).backward()
        if cfg.n_experts:
            finish_moe_step(model)
        if i == overflow_at:
            _poison(next(model.parameters()).grad)
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
        out.append((loss.item(), norm.item()))
    return out, scales


def _rank(rank: int, cfg: LlamaConfig, layout: dict, config: dict) -> tuple[list, list, list, int]:
    """The trainer's step (``measure_step`` / ``apply_step``) under ``layout``, its LR rule."""
    from meshtrain.mesh import Mesh
    from meshtrain.parallel.parallel_model import ParallelModel
    from meshtrain.parallel.parallelize import ParallelConfig
    from meshtrain.parallel.precision import DynamicLossScaler
    from meshtrain.train.step import apply_step, measure_step

    model = ParallelModel(cfg, Mesh(**layout), ParallelConfig(precision="fp16", **config), seed=0)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR)
    scaler = DynamicLossScaler(INIT, INTERVAL)
    out, scales, skipped = [], [], []
    for step, d in enumerate(batches(STEPS), start=1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, SCHEDULE)
        res = measure_step(model, opt, d[:, :-1], d[:, 1:], CLIP, scaler)
        apply_step(opt, res, scaler)
        out.append((res.loss, res.grad_norm))
        scales.append(res.loss_scale)
        skipped.append(res.overflow)
    return out, scales, skipped, scaler.skipped


@pytest.fixture(scope="module")
def want() -> dict[str, tuple]:
    """The GradScaler references, dense and MoE, and the dense one without the overflow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # these small fp16 matmuls run 10x slower with 2 threads on a busy 2-core host
    try:
        return {"dense": reference(CFG, OVERFLOW_AT), "moe": reference(MOE, OVERFLOW_AT),
                "clean": reference(CFG, None)}
    finally:
        torch.set_num_threads(threads)


LAYOUTS = {  # name: (model, layout, ParallelConfig fields)
    "dp2": ("dense", dict(dp=2), {}),
    "dp2-zero1": ("dense", dict(dp=2), dict(zero_stage=1)),
    "dp2-zero2": ("dense", dict(dp=2), dict(zero_stage=2)),
    "dp2-zero3": ("dense", dict(dp=2), dict(zero_stage=3)),
    "tp2": ("dense", dict(tp=2), {}),
    "pp2-1f1b": ("dense", dict(pp=2), dict(microbatches=2)),
    "cp2": ("dense", dict(cp=2), {}),
    "dp2xpp2-interleaved-zero1": ("dense", dict(dp=2, pp=2), dict(microbatches=2, schedule="interleaved",
                                                                  virtual_stages=2, zero_stage=1)),
    "dp2-ep2": ("moe", dict(dp=2, ep=2), {}),
}
# fp16 rounds each layout's partial sums differently (tp slices, cp's ring, ZeRO's fp16 units, whose
# parameter gradients are fp16 where autocast's are fp32): measured at most 7e-5 on the losses and
# 1.5e-3 on the norms (ZeRO); about 3x that is allowed
TOL, NORM_TOL = 2e-4, 5e-3


@pytest.mark.parametrize("name", LAYOUTS)
def test_an_overflow_on_one_rank_skips_the_step_everywhere_as_gradscaler_does(name, want, overflow_once):
    model, layout, config = LAYOUTS[name]
    ref, ref_scales = want[model]
    assert ref_scales == [INIT, INIT, 2 * INIT, INIT, INIT]  # grew after 2 clean steps, halved at the overflow
    clean, _ = want["clean"]
    # the skip is visible: a step taken instead moves every later loss by more than twice the tolerance
    assert min(abs(a[0] - b[0]) / b[0] for a, b in zip(clean[OVERFLOW_AT + 1:], ref[OVERFLOW_AT + 1:])) > 2 * TOL
    overflow_once["at"] = OVERFLOW_AT
    world = math.prod(v for k, v in layout.items() if k != "ep")
    for out, scales, skipped, n_skipped in comm.run_local(world, _rank, MOE if model == "moe" else CFG, layout,
                                                          config, timeout=100):
        assert skipped == [i == OVERFLOW_AT for i in range(STEPS)] and n_skipped == 1  # on every rank
        assert scales == ref_scales
        for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(out, ref, strict=True)):
            assert abs(loss - ref_loss) <= TOL * ref_loss, (name, i, out, ref)
            if i == OVERFLOW_AT:
                assert not math.isfinite(norm) and not math.isfinite(ref_norm)
            else:  # the norm of the unscaled gradients: clipping ran after the unscale
                assert abs(norm - ref_norm) <= NORM_TOL * ref_norm, (name, i, out, ref)


# -- the trainer -----------------------------------------------------------------------------------

KEYS = [a for a in SMALL if a != "--no-progress"]  # the config keys of the trainer tests' small run
FP16 = [*KEYS, "--comm.transport=local", "--train.precision=fp16", "--parallel.tp=1",
        f"--train.loss_scale_growth_interval={INTERVAL}"]


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_logs_skips_and_resumes_the_scale(tmp_path, overflow_once):
    """dp2 through ``meshtrain train``: an overflow on rank 1 at step 1 is skipped (and logged) on
    every rank, the LR schedule still advances, the scale is saved at step 2 and a resumed run goes
    on with it (and its count of clean steps) to the same losses, bitwise."""
    overflow_once["at"] = 0
    full = tmp_path / "full"
    assert main(["train", f"--out={full}", "--train.steps=4", "--checkpoint.every=2", "--parallel.dp=2",
                 "--no-progress", *FP16]) == 0
    rows = _rows(full)
    assert [r["skipped"] for r in rows] == [True, False, False, False]
    assert [r["skipped_steps"] for r in rows] == [1, 1, 1, 1]
    assert [r["loss_scale"] for r in rows] == [INIT, INIT / 2, INIT / 2, INIT]  # halved, then grew after 2
    assert rows[0]["grad_norm"] is None and all(r["grad_norm"] > 0 for r in rows[1:])
    t = load_config(None, ["--train.steps=4", *KEYS]).train
    assert [r["lr"] for r in rows] == [lr_at(s, t) for s in (1, 2, 3, 4)]  # a skipped step consumes its LR
    summary = json.loads((full / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["loss_scale"] == INIT

    overflow_once["at"] = None
    resumed = tmp_path / "resumed"
    ckpt = full / "checkpoints" / "step-00000002"
    assert main(["train", f"--out={resumed}", "--train.steps=4", "--parallel.dp=2", f"--checkpoint.resume={ckpt}",
                 "--no-progress", *FP16]) == 0
    again = _rows(resumed)
    keys = ("step", "loss", "grad_norm", "loss_scale", "skipped", "skipped_steps")
    assert [{k: r[k] for k in keys} for r in again] == [{k: r[k] for k in keys} for r in rows[2:]]


def test_an_overflow_at_the_minimum_scale_stops_the_run(tmp_path, overflow_once):
    overflow_once["at"] = 0
    config = load_config(None, [*FP16, "--parallel.dp=1", "--train.steps=2", "--train.loss_scale_init=1",
                                f"--out={tmp_path / 'run'}"])
    with pytest.raises(TrainingDiverged, match=r"overflowed float16 at step 1 .* minimum 1\.0; use "
                                               r"train.precision = 'bf16'"):
        comm.run_local(1, lambda rank: train(config, progress=False), timeout=60)


@pytest.mark.parametrize("key, value, message", [
    ("loss_scale_init", "0", "train.loss_scale_init = 0.0 must be a finite number >= 1"),
    ("loss_scale_init", "0.5", "train.loss_scale_init = 0.5 must be a finite number >= 1"),
    ("loss_scale_init", "-4", "train.loss_scale_init = -4.0 must be"),
    ("loss_scale_init", "inf", "train.loss_scale_init = inf must be a finite number"),
    ("loss_scale_init", "nan", "train.loss_scale_init = nan must be a finite number"),
    ("loss_scale_growth_interval", "0", "train.loss_scale_growth_interval = 0 must be >= 1"),
    ("loss_scale_growth_interval", "-1", "train.loss_scale_growth_interval = -1 must be >= 1"),
    ("loss_scale_growth_interval", "1.5", "train.loss_scale_growth_interval must be an integer"),
    ("precision", "fp8", "train.precision = 'fp8' is not one of fp32, bf16, fp16"),
])
def test_bad_loss_scaling_values_are_named_with_the_fix(key, value, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("+", r"\+")) as e:
        validate(load_config(None, ["--train.precision=fp16", f"--train.{key}={value}"]))
    assert "use" in str(e.value) or "not one of" in str(e.value) or "e.g." in str(e.value)


def test_defaults_are_gradscalers():
    t = TrainSection()
    assert (t.loss_scale_init, t.loss_scale_growth_interval) == (2.0 ** 16, 2000)
    validate(load_config(None, ["--train.precision=fp16"]))  # fp16 is accepted now
