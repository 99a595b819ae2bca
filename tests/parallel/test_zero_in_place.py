"""ZeRO-1/2 in fp32 hold no second copy of this rank's shard (``FlatUnit``): the fp32 master is the
full parameters' own slice, and ZeRO-1's shard gradient the full gradient buffer's. Training (with
gradient accumulation and clipping) still matches one process; the all-gather that refreshes the
full parameters from their own slice is right with every algorithm on every transport; half
precision, offload and ZeRO-3 keep their separate copies."""

from __future__ import annotations

import pytest
import torch

from meshtrain import comm
from meshtrain.comm.algorithms import algorithms_for
from meshtrain.comm.launch import spawn
from meshtrain.parallel.precision import MixedPrecision
from meshtrain.parallel.zero import ZeroModel, ZeroOptimizer

from ._models import assert_close_state, batches, loss_fn, make_model, reference, shard

pytestmark = pytest.mark.timeout(240)
STEPS, BATCH, MICRO, CLIP = 4, 24, 2, 0.5


def _own_slice(t: torch.Tensor | None, buf: torch.Tensor | None, lo: int) -> bool:
    """True if ``t`` is the slice of ``buf``'s storage that starts at element ``lo``."""
    return (t is not None and buf is not None
            and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            and t.data_ptr() == buf.data_ptr() + lo * buf.element_size())


def _train(rank: int, world: int, stage: int, **kw) -> tuple[dict, list[bool], list[bool], bool]:
    """AdamW with ``MICRO`` accumulated micro-batches and clipping, in units of about 2 KiB (several);
    returns the full state, for each micro-batch whether every master / shard gradient was its
    buffer's own slice, and whether every full gradient buffer was zero after ``zero_grad``."""
    import meshtrain.comm as mc

    world = world or mc.get_world_size()
    zm = ZeroModel(make_model(seed=100 + rank), stage=stage, bucket_cap_mb=2 / 1024, **kw)
    assert len(zm.units) > 2
    for u in zm.units:  # as a checkpoint writes the masters: their storage (ZeRO-1/2: full's) can't resize now
        u.master.detach().numpy()
    zo = ZeroOptimizer(zm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    masters, grads, zeroed = [], [], True
    for x, y in batches(STEPS, BATCH):
        zo.zero_grad()
        zeroed &= all(u.grad is None and (u.grad_full is None or not u.grad_full.any()) for u in zm.units)
        for xm, ym in zip(shard(x, rank, world).chunk(MICRO), shard(y, rank, world).chunk(MICRO)):
            (loss_fn(zm, xm, ym) / MICRO).backward()
            masters.append(all(_own_slice(u.master, u.full, u.lo) for u in zm.units))
            grads.append(all(_own_slice(u.grad, u.grad_full, u.lo) for u in zm.units))
        zo.clip_grad_norm_(CLIP)
        zo.step()
    return zm.full_state_dict(), masters, grads, zeroed


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 3])  # 3: the units' sizes are not multiples of it (padding)
def test_fp32_masters_and_zero1_grads_are_slices_and_training_matches(stage, world):
    want = reference(STEPS, BATCH, seed=100, micro=MICRO, clip=CLIP)
    for got, masters, grads, zeroed in comm.run_local(world, _train, world, stage, timeout=60):
        assert_close_state(got, want)
        assert all(masters)
        assert all(grads) == (stage == 1) and any(grads) == (stage == 1)  # ZeRO-2 drops grad_full
        assert zeroed


@pytest.mark.parametrize("stage, kw", [
    (3, {}),
    (2, {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}),
    (1, {"offload": "optimizer"}),
])
def test_zero3_half_precision_and_offload_keep_a_separate_master(stage, kw):
    def fn(rank):
        zm = ZeroModel(make_model(), stage=stage, **kw)
        return [u.master.untyped_storage().data_ptr() != u.full.untyped_storage().data_ptr() for u in zm.units]

    for separate in comm.run_local(2, fn, timeout=30):
        assert all(separate)


def test_zero1_reducing_in_bf16_keeps_a_separate_shard_gradient():
    def fn(rank):
        zm = ZeroModel(make_model(), stage=1, mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16))
        x, y = batches(1, 8)[0]
        loss_fn(zm, shard(x, rank, 2), shard(y, rank, 2)).backward()
        return [u.grad.dtype == torch.float32 and not _own_slice(u.grad, u.grad_full, u.lo) for u in zm.units]

    for separate in comm.run_local(2, fn, timeout=30):
        assert all(separate)


def _gather_in_place(rank: int, algos: list[str] | None = None) -> list[str]:
    """``all_gather_into_tensor(out, out[me])`` (the input is the output's own block) with every
    algorithm of the transport, over the world and over a reversed group; returns the failures."""
    import meshtrain.comm as mc

    world = mc.get_world_size()
    kind = mc.current().transport.kind
    groups = [mc.new_group(list(range(world))), mc.new_group(list(range(world))[::-1])]
    fails = []
    for g in groups:
        me = g.rank
        for algo in algos or algorithms_for("all_gather", kind):
            for n in (1, 7, 300_007):
                want = torch.cat([torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(g.size)])
                out = torch.full((g.size * n,), float("nan"))
                out[me * n : (me + 1) * n] = want[me * n : (me + 1) * n]
                mc.all_gather_into_tensor(out, out[me * n : (me + 1) * n], group=g, algorithm=algo)
                if not torch.equal(out, want):
                    fails.append(f"{kind} {algo} group {g.ranks} n={n}")
    return fails


@pytest.mark.parametrize("world, rpn", [(2, None), (3, None), (4, 2), (4, 1)])
def test_all_gather_from_the_outputs_own_block_threads(world, rpn):
    for fails in comm.run_local(world, _gather_in_place, timeout=60, ranks_per_node=rpn):
        assert not fails


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_all_gather_from_the_outputs_own_block_processes(transport):
    for fails in spawn(3, _gather_in_place, timeout=200, transport=transport):
        assert not fails


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_zero1_and_zero2_in_processes_match_one_process(transport):
    want = reference(STEPS, BATCH, seed=100, micro=MICRO, clip=CLIP)
    for stage in (1, 2):
        for got, masters, grads, _ in spawn(2, _train, 0, stage, timeout=200, transport=transport):
            assert_close_state(got, want)
            assert all(masters) and all(grads) == (stage == 1)
