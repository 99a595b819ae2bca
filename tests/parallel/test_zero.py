"""ZeRO stages 1-3: parity with one process on the global batch, memory per rank, clipping."""

from __future__ import annotations

import pytest
import torch

from meshtrain import comm
from meshtrain.parallel.zero import ZeroModel, ZeroOptimizer

from .._accelerator import BACKWARD_THREAD, as_accelerator, device_check_threads
from ._models import assert_close_state, batches, loss_fn, make_model, reference, shard

STEPS, BATCH = 5, 24


def _train(rank, world, stage, opt="adamw", micro=1, clip=None, units=None):
    model = make_model(seed=rank + 100)
    blocks = None if units is None else [model.get_submodule(u) for u in units]
    zm = ZeroModel(model, stage=stage, units=blocks)
    if opt == "sgd":
        zo = ZeroOptimizer(zm, torch.optim.SGD, lr=0.05, momentum=0.9)
    else:
        zo = ZeroOptimizer(zm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for x, y in batches(STEPS, BATCH):
        xs, ys = shard(x, rank, world), shard(y, rank, world)
        zo.zero_grad()
        for xm, ym in zip(xs.chunk(micro), ys.chunk(micro)):
            (loss_fn(zm, xm, ym) / micro).backward()
        if clip is not None:
            zo.clip_grad_norm_(clip)
        zo.step()
    return zm.full_state_dict()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero_matches_single_process(stage, world):
    want = reference(STEPS, BATCH, seed=100)
    for got in comm.run_local(world, _train, world, stage, timeout=60):
        assert_close_state(got, want)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sgd_momentum_accumulation_and_clipping(stage):
    want = reference(STEPS, BATCH, seed=100, opt="sgd", micro=4, clip=0.5)
    for got in comm.run_local(2, _train, 2, stage, "sgd", 4, 0.5, timeout=60):
        assert_close_state(got, want)


def test_zero3_with_a_root_unit_and_nested_blocks():
    want = reference(STEPS, BATCH, seed=100)
    for got in comm.run_local(3, _train, 3, 3, units=["mid.0", "mid.2"], timeout=60):
        assert_close_state(got, want)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_device_step_reduces_from_the_backward_thread(stage, monkeypatch):
    """Through the accelerator double (tests/_accelerator.py): the reduce-scatters (and stage 3's
    gathers) that backward hooks start take comm's device check on the backward's own thread, which
    has no communicator; on a GPU that check asked the thread's and failed (issue 32)."""
    as_accelerator(monkeypatch)
    threads = device_check_threads(monkeypatch)
    want = reference(STEPS, BATCH, seed=100)
    for got in comm.run_local(2, _train, 2, stage, timeout=60):
        assert_close_state(got, want)
    assert BACKWARD_THREAD in threads, sorted(set(threads))


def _bytes(ts) -> int:
    return sum(t.untyped_storage().nbytes() for t in ts if t is not None)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_per_rank_are_one_over_dp(stage):
    world = 4

    def fn(rank):
        model = make_model(width=101)
        zm = ZeroModel(model, stage=stage)
        zo = ZeroOptimizer(zm, torch.optim.AdamW, lr=1e-3)
        x, y = batches(1, 8)[0]
        loss_fn(zm, shard(x, rank, world), shard(y, rank, world)).backward()
        zo.step()
        state = _bytes(t for s in zo.optimizer.state.values() for t in s.values() if t.dim() > 0)
        grads = _bytes([u.master.grad for u in zm.units] + [u.grad_full for u in zm.units]
                       + [p.grad for p in model.parameters()])
        params = _bytes([u.master for u in zm.units] + [u.full for u in zm.units])
        return state, grads, params, len(zm.units)

    single = make_model(width=101)
    total = sum(p.numel() for p in single.parameters()) * 4
    for state, grads, params, units in comm.run_local(world, fn, timeout=60):
        rounding = units * 4 * 4  # at most one padding element per rank per unit, fp32
        assert abs(state - 2 * total / world) <= 2 * rounding  # AdamW: exp_avg + exp_avg_sq
        if stage >= 2:
            assert abs(grads - total / world) <= rounding
        else:
            assert grads >= total  # stage 1 keeps the full gradient buffer
        if stage == 3:
            assert abs(params - total / world) <= rounding
        else:
            assert params >= total


def test_unused_parameter_is_named():
    def fn(rank):
        model = make_model(unused=True)
        zm = ZeroModel(model, stage=2)
        x, y = batches(1, 4)[0]
        loss_fn(zm, x, y).backward()

    with pytest.raises(RuntimeError, match=r"dead\.(weight|bias)"):
        comm.run_local(2, fn, timeout=20)


def test_bad_stage():
    def fn(rank):
        ZeroModel(make_model(), stage=4)

    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        comm.run_local(1, fn, timeout=10)


def test_zero3_prefetches_the_next_unit_in_forward_and_backward():
    from meshtrain.parallel.flat_unit import FlatUnit

    def fn(rank):
        model = make_model()
        zm = ZeroModel(model, stage=3)
        log = []
        for u in zm.units:
            orig = u.gather

            def spy(async_op=False, u=u, orig=orig):
                if async_op and not u.gathered and u._pending is None:
                    log.append((torch.is_grad_enabled(), u.index))
                return orig(async_op)
            u.gather = spy
        x, y = batches(1, 4)[0]
        loss_fn(zm, x, y).backward()
        return log, [u.gathered for u in zm.units], len(zm.units)

    for log, gathered, n in comm.run_local(2, fn, timeout=30):
        fwd = [i for _, i in log[: n - 1]]
        assert fwd == list(range(1, n))  # forward: unit i prefetches i+1
        assert [i for _, i in log[n - 1:]] == list(range(n - 2, -1, -1))  # backward: i prefetches i-1
        assert not any(gathered)  # everything freed again after backward
    assert FlatUnit  # the class the spy wraps


def _resume(rank, world, stage, saved, first_steps):
    """Continue training from ``saved`` (model + optimizer, full) for the remaining steps."""
    model = make_model(seed=7)  # wrong on purpose: the load must overwrite it
    zm = ZeroModel(model, stage=stage)
    zo = ZeroOptimizer(zm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    if saved is not None:
        zm.load_full_state_dict(saved[0])
        zo.load_full_state_dict(saved[1])
    for i, (x, y) in enumerate(batches(STEPS, BATCH)):
        if (i < first_steps) == (saved is not None):
            continue
        zo.zero_grad()
        loss_fn(zm, shard(x, rank, world), shard(y, rank, world)).backward()
        zo.step()
    return zm.full_state_dict(), zo.full_state_dict()


def test_full_state_dicts_reshard_from_dp4_stage2_to_dp2_stage3():
    want = reference(STEPS, BATCH, seed=100)

    def first(rank):  # 2 steps on dp=4, ZeRO-2; the reload skips them
        model = make_model(seed=100)
        zm = ZeroModel(model, stage=2)
        zo = ZeroOptimizer(zm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        for x, y in batches(STEPS, BATCH)[:2]:
            zo.zero_grad()
            loss_fn(zm, shard(x, rank, 4), shard(y, rank, 4)).backward()
            zo.step()
        return zm.full_state_dict(), zo.full_state_dict()

    saved = comm.run_local(4, first, timeout=60)[0]
    assert saved[1]["state"]["inp.weight"]["exp_avg"].shape == (37, 11)
    for got, _ in comm.run_local(2, _resume, 2, 3, saved, 2, timeout=60):
        assert_close_state(got, want)


def test_loading_a_different_shape_is_an_error():
    def fn(rank):
        zm = ZeroModel(make_model(), stage=1)
        sd = zm.full_state_dict()
        sd["inp.weight"] = torch.zeros(3, 3)
        zm.load_full_state_dict(sd)

    with pytest.raises(ValueError, match=r"inp.weight: saved shape \(3, 3\)"):
        comm.run_local(1, fn, timeout=10)


def _first_two_steps_sharded(rank, world, stage):
    model = make_model(seed=100)
    zm = ZeroModel(model, stage=stage)
    zo = ZeroOptimizer(zm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for x, y in batches(STEPS, BATCH)[:2]:
        zo.zero_grad()
        loss_fn(zm, shard(x, rank, world), shard(y, rank, world)).backward()
        zo.step()
    return zm.shard_state_dict(), zo.state_dict()


def _resume_sharded(rank, world, stage, model_shards, opt_shards):
    zm = ZeroModel(make_model(seed=7), stage=stage)
    zo = ZeroOptimizer(zm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    zm.load_shard_state_dict(model_shards if len(model_shards) > 1 else model_shards[0])
    zo.load_state_dict(opt_shards if len(opt_shards) > 1 else opt_shards[0])
    for x, y in batches(STEPS, BATCH)[2:]:
        zo.zero_grad()
        loss_fn(zm, shard(x, rank, world), shard(y, rank, world)).backward()
        zo.step()
    return zm.full_state_dict()


@pytest.mark.parametrize("saved_world,saved_stage,world,stage", [(4, 2, 3, 3), (2, 3, 4, 1), (1, 1, 2, 2)])
def test_per_rank_shards_reload_into_another_dp_size(saved_world, saved_stage, world, stage):
    want = reference(STEPS, BATCH, seed=100)
    saved = comm.run_local(saved_world, _first_two_steps_sharded, saved_world, saved_stage, timeout=60)
    ms, os_ = [s[0] for s in saved], [s[1] for s in saved]
    for got in comm.run_local(world, _resume_sharded, world, stage, ms, os_, timeout=60):
        assert_close_state(got, want)


def test_same_dp_loads_its_own_shard_and_missing_shards_are_named():
    saved = comm.run_local(2, _first_two_steps_sharded, 2, 2, timeout=60)
    want = reference(STEPS, BATCH, seed=100)

    def own(rank):
        return _resume_sharded(rank, 2, 2, [saved[rank][0]], [saved[rank][1]])

    for got in comm.run_local(2, own, timeout=60):
        assert_close_state(got, want)
    with pytest.raises(ValueError, match="cover .* pass the shard states of every rank"):
        comm.run_local(1, _resume_sharded, 1, 2, [saved[0][0]], [saved[0][1]], timeout=20)
