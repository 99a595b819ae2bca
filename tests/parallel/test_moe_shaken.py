"""Expert parallelism with its timing shaken on purpose (``comm.shake``): each mixture-of-experts
layout class (ep with dp, with tp, with pp, with cp and activation checkpointing, with HSDP and
ZeRO-3), ranks as threads, under several seeds. Every collective and every send pauses at random
before it is issued, so an order that depends on thread scheduling (a data-parallel bucket's
all-reduce against backward's all-to-all on one group) fails every run rather than one run in
three on a loaded machine. Each run must train to the one-process losses and issue, on every
group, the same calls in the same order on every rank (``comm.call_order``). The seed is in the
test's name."""

from __future__ import annotations

import pytest
import torch

from meshtrain import comm
from meshtrain.comm import call_order, shake

from .test_moe_parity import reference, train_rank

pytestmark = pytest.mark.timeout(180)
SEEDS = (1, 2, 3)
SMALL = 4 / 1024  # MB: a bucket (ZeRO-1/2: a unit) every few parameters, so reductions run all through backward
LAYOUTS = [
    ("dp2-ep2", dict(dp=2, ep=2), dict(bucket_cap_mb=SMALL)),
    ("dp2xtp2-ep2", dict(dp=2, tp=2, ep=2), dict(bucket_cap_mb=SMALL)),
    ("dp2xpp2-ep2-1f1b", dict(dp=2, pp=2, ep=2), dict(microbatches=2, bucket_cap_mb=SMALL)),
    ("dp2xcp2-ep2-ac", dict(dp=2, cp=2, ep=2), dict(activation_checkpointing="full", bucket_cap_mb=SMALL)),
    ("hsdp2x2-ep2-zero3", dict(dp=4, dp_replicate=2, ep=2), dict(zero_stage=3)),
    ("dp4-ep2-zero2", dict(dp=4, ep=2), dict(zero_stage=2, bucket_cap_mb=SMALL)),
]


def recorded(rank: int, layout: dict, config: dict, clip: float) -> tuple[list, list]:
    """``train_rank`` with this rank's collectives noted: (losses, notes)."""
    call_order.start()
    try:
        losses, _, _ = train_rank(rank, "seq-aux", layout, config, clip)
    finally:
        notes = call_order.stop()
    return losses, notes


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
@pytest.mark.parametrize("name, layout, config", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_shaken_moe_layout_keeps_one_order_and_the_one_process_losses(name, layout, config, seed):
    clip = 1.0 if config.get("zero_stage") else 0.0
    want, _, _ = reference("seq-aux", clip)
    world = layout["dp"] * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    with shake.shaking(seed):
        out = comm.run_local(world, recorded, layout, config, clip, timeout=60)
    assert call_order.check([notes for _, notes in out]) > 0
    for losses, _ in out:
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)


def test_the_runner_notes_each_call_and_the_check_names_a_swapped_pair():
    """The notes are the calls each rank issued, per group in order; two ranks whose notes hold
    the same two calls of a group in opposite orders are named at the first call that differs."""
    def calls(rank: int) -> list:
        g = comm.current().new_group([0, 1])
        call_order.start()
        comm.all_reduce(torch.zeros(2), group=g)
        comm.broadcast(torch.zeros(3), src=0, group=g)
        return call_order.stop()

    notes = comm.run_local(2, calls, timeout=30)
    assert call_order.check(notes) == 2
    assert [(n[3], n[4]) for n in notes[1]] == [("all_reduce", "((2,),)"), ("broadcast", "((3,),)")]
    swapped = [notes[0], [(*b[:3], *a[3:]) for a, b in zip(notes[1], reversed(notes[1]))]]
    with pytest.raises(comm.CollectiveMismatch, match=r"group \d+ \(ranks \[0, 1\]\): call #1 is all_reduce "
                                                      r"shapes=\(\(2,\),\) dtype=float32 on rank 0 but "
                                                      r"broadcast shapes=\(\(3,\),\) .* on rank 1"):
        call_order.check(swapped)
    with pytest.raises(comm.CollectiveMismatch, match=r"call #2 is broadcast .* on rank 0 but missing on rank 1"):
        call_order.check([notes[0], notes[1][:1]])


def test_shaking_reads_its_seed_and_names_a_bad_value(monkeypatch):
    monkeypatch.setenv(shake.ENV, "7:0.5")
    try:
        s = shake.from_env()
        assert (s.seed, s.max_s) == (7, 0.0005) and shake.ACTIVE is s
        monkeypatch.setenv(shake.ENV, "seven")
        with pytest.raises(ValueError, match=r"MESHTRAIN_SHAKE='seven': use SEED or SEED:MAX_MS"):
            shake.from_env()
    finally:
        shake.disable()
