"""Loss parity: every (dp, pp, cp, tp) layout (dp as replicas x shards too) trains the test Llama to the one-process losses and
gradients (fp32, 4 steps, same seed and global batches), with ZeRO off and with ZeRO-1."""

from __future__ import annotations

import math

import pytest
import torch

from meshtrain import comm
from meshtrain.comm.launch import spawn

from ._parity import assemble, reference, train_rank

# Four steps: every per-step loss within 1e-5 of one process and the first step's gradients by name
# (AdamW's state diverges by its second step if a shard or a reduction is wrong: three updates are
# checked). Ten steps took this file 100 s of the suite; six 79 s and four 64 s on session 26's VM.
STEPS = 4
LAYOUTS = {
    "tp2": (dict(tp=2), {}),
    "sp": (dict(tp=2), dict(sequence_parallel=True)),
    "cp2": (dict(cp=2), {}),
    "pp2-afab": (dict(pp=2), dict(microbatches=2, schedule="afab")),
    "pp2-1f1b": (dict(pp=2), dict(microbatches=4, schedule="1f1b")),
    "pp2-interleaved": (dict(pp=2), dict(microbatches=2, schedule="interleaved", virtual_stages=2)),
    "dp2": (dict(dp=2), {}),
    "tp2xpp2": (dict(tp=2, pp=2), dict(microbatches=2)),
    "tp2xcp2": (dict(tp=2, cp=2), dict(sequence_parallel=True)),
    "pp2xdp2": (dict(pp=2, dp=2), dict(microbatches=2)),
    "dp2xpp2xcp2": (dict(dp=2, pp=2, cp=2), dict(microbatches=2)),
    "tp2xpp2xdp2": (dict(tp=2, pp=2, dp=2), dict(microbatches=2, sequence_parallel=True)),
    "tp2xcp2xpp2": (dict(tp=2, cp=2, pp=2), dict(microbatches=2)),
    # dp4 as 2 replicas x 2 shards: plain data parallel over all 4 without ZeRO, HSDP with it
    "dp4-replicate2": (dict(dp=4, dp_replicate=2), {}),
}


@pytest.fixture(scope="module")
def want():
    return reference(STEPS)


def _world(layout: dict) -> int:
    return math.prod(v for k, v in layout.items() if k != "dp_replicate")  # dp counts the replicas


def _check(results, want, zero: bool) -> None:
    losses, grads = want
    for rank_losses, _ in results:
        for got, ref in zip(rank_losses, losses, strict=True):
            assert abs(got - ref) <= 1e-5 * abs(ref), (rank_losses, losses)
    if not zero:
        full = assemble([g for _, g in results])
        assert full.keys() == grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(full[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _sharded(layout: dict) -> bool:
    """Whether ZeRO has more than one rank to shard over here (dp x cp > 1)."""
    return layout.get("dp", 1) * layout.get("cp", 1) > 1


# ZeRO-1 where it shards: with dp x cp = 1 it is the run without it (its one-rank path is
# test_clipped_training_and_global_grad_norm_match[sp-1])
@pytest.mark.parametrize("name, zero", [(n, z) for n in LAYOUTS for z in (0, 1) if not z or _sharded(LAYOUTS[n][0])])
def test_layout_matches_one_process(name, zero, want):
    layout, config = LAYOUTS[name]
    results = comm.run_local(_world(layout), train_rank, layout, {**config, "zero_stage": zero}, STEPS,
                             timeout=100)
    _check(results, want, zero)


@pytest.mark.parametrize("name, layout, config", [
    ("pp2xdp2-zero3", dict(pp=2, dp=2), dict(microbatches=2, zero_stage=3)),
    ("pp2-afab-zero3", dict(pp=2), dict(microbatches=2, schedule="afab", zero_stage=3)),
    ("interleaved-dp2-zero2", dict(pp=2, dp=2), dict(microbatches=2, schedule="interleaved", virtual_stages=2,
                                                     zero_stage=2)),
    ("sp-dp2-zero3", dict(tp=2, dp=2), dict(sequence_parallel=True, zero_stage=3)),
    ("cp2xdp2-zero3", dict(cp=2, dp=2), dict(zero_stage=3)),
    ("hsdp-zero3", dict(dp=4, dp_replicate=2), dict(zero_stage=3)),
    ("hsdp-tp2-sp-zero2", dict(dp=2, dp_replicate=2, tp=2), dict(sequence_parallel=True, zero_stage=2)),
])
def test_zero_2_and_3_keep_parity_under_model_parallelism(name, layout, config, want):
    """ZeRO-3 under a pipeline keeps the units a later micro-batch's backward still needs."""
    _check(comm.run_local(_world(layout), train_rank, layout, config, STEPS, timeout=100), want, True)


@pytest.mark.parametrize("name, zero", [("tp2xpp2", 0), ("sp", 1), ("tp2xcp2xpp2", 1), ("pp2xdp2", 1),
                                        ("dp4-replicate2", 1)])
def test_clipped_training_and_global_grad_norm_match(name, zero):
    """The global gradient norm counts tp slices, stages and ZeRO shards once each: it equals
    torch's clip_grad_norm_ on one process, and clipped training keeps parity."""
    clip = 0.05  # small enough that every step clips
    want, _ = reference(4, clip=clip)
    layout, config = LAYOUTS[name]
    for got, _ in comm.run_local(_world(layout), train_rank, layout, {**config, "zero_stage": zero}, 4, clip,
                                 timeout=100):
        for (loss, norm), (ref_loss, ref_norm) in zip(got, want, strict=True):
            assert norm > clip
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm and abs(loss - ref_loss) <= 1e-5 * ref_loss


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_parity(mode, want):
    layout, config = LAYOUTS["tp2xpp2"]
    config = {**config, "activation_checkpointing": mode, "checkpoint_every": 2}
    _check(comm.run_local(_world(layout), train_rank, layout, config, STEPS, timeout=100), want, False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["pp2-1f1b", "cp2", "sp"])
def test_layout_over_gloo_processes(name, want):
    layout, config = LAYOUTS[name]
    _check(spawn(_world(layout), train_rank, layout, config, 4, timeout=240), (want[0][:4], want[1]), False)


def _build_error(layout: dict, config: dict, cfg_changes: dict | None = None, batch: tuple = (4, 16)):
    """The ConfigError one layout raises (on every rank), as a string."""
    from dataclasses import replace

    from meshtrain.errors import ConfigError
    from meshtrain.mesh import Mesh
    from meshtrain.parallel.parallel_model import ParallelModel
    from meshtrain.parallel.parallelize import ParallelConfig

    from ._parity import CFG

    def fn(rank):
        try:
            model = ParallelModel(replace(CFG, **(cfg_changes or {})), Mesh(**layout), ParallelConfig(**config))
            tokens = torch.zeros(batch, dtype=torch.long)
            model.forward_backward(tokens, tokens)
        except ConfigError as exc:
            return str(exc)
        return None

    errors = comm.run_local(_world(layout), fn, timeout=30)
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    return errors[0]


@pytest.mark.parametrize("layout, config, cfg_changes, batch, match", [
    (dict(tp=4), {}, None, (4, 16), "n_kv_heads = 2 is not divisible by tp = 4"),
    (dict(tp=2), {}, dict(n_heads=8, n_kv_heads=8, ffn_dim=171), (4, 16), "ffn_dim = 171 is not divisible by tp = 2"),
    (dict(pp=2), dict(microbatches=2, schedule="interleaved", virtual_stages=4), None, (4, 16),
     "4 layers cannot fill 8 pipeline stages"),
    (dict(pp=2), dict(microbatches=1), None, (4, 16), "fewer micro-batches"),
    (dict(dp=2), dict(microbatches=3), None, (4, 16), "global batch 4 is not divisible by dp x microbatches"),
    (dict(cp=2), {}, None, (4, 6), "not divisible by 2"),
    (dict(pp=2), dict(microbatches=2), dict(tie_embeddings=True), (4, 16), "tie_embeddings"),
    (dict(dp=2), dict(sequence_parallel=True), None, (4, 16), "sequence_parallel=true needs tp > 1"),
])
def test_bad_layouts_are_config_errors_naming_the_fix(layout, config, cfg_changes, batch, match):
    assert match in _build_error(layout, config, cfg_changes, batch)


def test_bad_parallel_config_values():
    from meshtrain.errors import ConfigError
    from meshtrain.parallel.parallelize import ParallelConfig

    with pytest.raises(ConfigError, match="activation_checkpointing = 'some'"):
        ParallelConfig(activation_checkpointing="some")
    with pytest.raises(ConfigError, match="zero_stage = 4"):
        ParallelConfig(zero_stage=4)
    with pytest.raises(ConfigError, match="microbatches = 0"):
        ParallelConfig(microbatches=0)
