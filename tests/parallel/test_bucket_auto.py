"""``bucket_cap_mb = "auto"``: the size from the cost model, DataParallel and ZeRO-1/2 with it against
plain PyTorch, the config's checks, and the bench's --bucket-sweep input and report."""

from __future__ import annotations

import pytest
import torch

from meshtrain import comm
from meshtrain.cli import main
from meshtrain.comm.select import CostModel, default_model
from meshtrain.config import ParallelConfig, load_config
from meshtrain.errors import ConfigError
from meshtrain.parallel import bucket_size
from meshtrain.parallel.bucket_size import (MAX_BYTES, MIN_BYTES, MiB, auto_bucket_bytes, call_latency,
                                            size_text, split_by_bytes)
from meshtrain.parallel.data import DataParallel
from meshtrain.parallel.zero import ZeroModel, ZeroOptimizer
from meshtrain.train.config import to_toml

from ._models import assert_close_state, batches, loss_fn, make_model, reference, shard

WIDTH = 101  # ~56 KB of gradients: several buckets once the floor is lowered


# -- the size ---------------------------------------------------------------------------------------

def _ring(m: CostModel, p: int, op: str) -> tuple[float, float]:
    """The ring's latency and seconds per byte, written out from the alpha-beta-gamma formulas."""
    f = (p - 1) / p
    if op == "all_reduce":
        return 2 * (p - 1) * m.alpha, 2 * f * m.beta + f * m.gamma
    return (p - 1) * m.alpha, f * (m.beta + m.gamma)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_the_size_is_where_alpha_is_five_percent_of_the_transfer(op, p):
    m = CostModel(alpha=50e-6, beta=1 / 1e9, gamma=1 / 8e9)
    latency, per_byte = _ring(m, p, op)
    want = latency / (0.05 * per_byte)
    assert MIN_BYTES < want < MAX_BYTES  # neither clamp is in play
    n, why = auto_bucket_bytes(m, 1 << 40, p, op)
    assert n == pytest.approx(want, abs=1)
    assert latency <= 0.05 * n * per_byte * (1 + 1e-9) and latency > 0.05 * (n - 2) * per_byte
    assert "alpha 50us" in why and f"alpha = 5% of a bucket's transfer at {want / MiB:.1f} MiB" in why


def test_alpha_dominated_links_are_capped_so_that_backward_overlaps():
    m = CostModel(alpha=1e-3, beta=1 / 1e9, gamma=0.0)  # slow messages: alpha wants ~76 MiB buckets
    latency, per_byte = _ring(m, 4, "all_reduce")
    assert latency / (0.05 * per_byte) > 16 * MiB
    n, why = auto_bucket_bytes(m, 64 * MiB, 4)
    assert n == 16 * MiB and "capped at 64.0 MiB of gradients / 4" in why
    assert auto_bucket_bytes(m, 64 * MiB, 4, min_buckets=8)[0] == 8 * MiB


def test_bandwidth_dominated_links_and_tiny_models_take_the_floor_and_huge_alpha_the_ceiling():
    fast = CostModel(alpha=1e-6, beta=1 / 0.1e9, gamma=0.0)  # beta-dominated: alpha fits in 8 KB
    latency, per_byte = _ring(fast, 4, "all_reduce")
    assert latency / (0.05 * per_byte) < 16 << 10
    n, why = auto_bucket_bytes(fast, 1 << 30, 4)
    assert n == MIN_BYTES and "floor" in why
    assert auto_bucket_bytes(default_model("local"), 56_000, 2)[0] == MIN_BYTES  # a tiny model: one bucket
    slow = CostModel(alpha=0.1, beta=1 / 10e9, gamma=0.0)
    n, why = auto_bucket_bytes(slow, 1 << 40, 4)
    assert n == MAX_BYTES and "ceiling" in why
    assert auto_bucket_bytes(slow, 1 << 40, 1)[0] == MAX_BYTES  # one rank: one bucket, clamped
    assert auto_bucket_bytes(slow, 3 * MiB, 1)[0] == 3 * MiB


def test_a_measured_call_latency_above_the_ring_s_sets_the_size():
    m = CostModel(alpha=20e-6, beta=1 / 1e9, gamma=0.0)
    ring, per_byte = _ring(m, 2, "all_reduce")
    n, why = auto_bucket_bytes(m, 1 << 40, 2, call_s=1e-3)
    assert 1e-3 > ring and n == pytest.approx(1e-3 / (0.05 * per_byte), abs=1)
    assert "a call 1000us measured" in why and "latency = 5%" in why
    assert auto_bucket_bytes(m, 1 << 40, 2, call_s=ring / 2)[0] == auto_bucket_bytes(m, 1 << 40, 2)[0]


def test_call_latency_is_the_same_on_every_member():
    for op in ("all_reduce", "reduce_scatter"):
        got = comm.run_local(3, lambda rank: call_latency(comm.current().world, op, reps=2), timeout=20)
        assert got[0] > 0 and got == [got[0]] * 3


def test_split_by_bytes_fills_from_the_end():
    named = [(n, torch.empty(k)) for n, k in zip("abcde", [1, 2, 3, 4, 2])]
    runs = split_by_bytes(named, 6 * 4, 4)
    assert [[n for n, _ in r] for r in runs] == [["a", "b", "c"], ["d", "e"]]
    big = [(n, torch.empty(k)) for n, k in zip("xyz", [1, 10, 1])]
    assert [[n for n, _ in r] for r in split_by_bytes(big, 6 * 4, 4)] == [["x"], ["y"], ["z"]]


# -- the wrappers, with the floor lowered so that "auto" cuts the tiny model ----------------------

@pytest.fixture
def low_floor(monkeypatch):
    monkeypatch.setattr(bucket_size, "MIN_BYTES", 256)


def _grad_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_data_parallel_auto_gradients_equal_one_process(low_floor, capsys):
    (x, y), = batches(1, 12)
    single = make_model(seed=100, width=WIDTH)
    loss_fn(single, x, y).backward()
    want = {n: p.grad.clone() for n, p in single.named_parameters()}

    def fn(rank):
        model = make_model(seed=100 + rank, width=WIDTH)  # rank 1 differs: the wrap broadcasts
        dp = DataParallel(model)  # bucket_cap_mb="auto" by default
        loss_fn(dp, shard(x, rank, 2), shard(y, rank, 2)).backward()
        return dp.bucket_cap_bytes, len(dp.buckets), {n: p.grad.clone() for n, p in model.named_parameters()}

    size = auto_bucket_bytes(default_model("local"), _grad_bytes(single), 2)[0]
    assert 256 < size < _grad_bytes(single) // 3
    for cap, n_buckets, grads in comm.run_local(2, fn, timeout=30):
        assert cap == size and n_buckets >= 3
        assert_close_state(grads, want)
    log = capsys.readouterr().err
    assert log.count("DataParallel bucket_cap_mb auto:") == 1  # rank 0 only
    assert f"auto: {size_text(size)} (alpha 30us" in log and "buckets for" in log


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_auto_units_train_as_one_process(stage, low_floor):
    want = reference(3, 12, opt="sgd", seed=100, width=WIDTH)  # SGD: AdamW magnifies rounding in tiny grads

    def fn(rank):
        model = make_model(seed=100 + rank, width=WIDTH)
        zm = ZeroModel(model, stage=stage)
        zo = ZeroOptimizer(zm, torch.optim.SGD, lr=0.05, momentum=0.9)
        for x, y in batches(3, 12):
            zo.zero_grad()
            loss_fn(zm, shard(x, rank, 2), shard(y, rank, 2)).backward()
            zo.step()
        return zm.bucket_cap_bytes, len(zm.units), zm.full_state_dict()

    size = auto_bucket_bytes(default_model("local"), _grad_bytes(make_model(width=WIDTH)), 2, "reduce_scatter")[0]
    for cap, units, state in comm.run_local(2, fn, timeout=30):
        assert cap == size and units >= 3  # cut by size, not by the model's 3 children
        assert_close_state(state, want)


def test_zero3_units_stay_blocks():
    def fn(rank):
        zm = ZeroModel(make_model(width=WIDTH), stage=3, bucket_cap_mb="auto")
        return zm.bucket_cap_bytes, [u.names[0] for u in zm.units]

    for cap, firsts in comm.run_local(2, fn, timeout=30):
        assert cap is None and firsts == ["inp.weight", "mid.0.weight", "out.weight"]


@pytest.mark.parametrize("wrap", [DataParallel, lambda m, **kw: ZeroModel(m, stage=2, **kw)])
def test_wrappers_name_a_bad_size(wrap):
    def fn(rank, value):
        wrap(make_model(), bucket_cap_mb=value)

    for value, words in [("fast", "'fast' is not a bucket size"), (0, "must be positive"), (-1, "must be positive")]:
        with pytest.raises(ValueError, match=f"bucket_cap_mb.*{words}.*auto"):
            comm.run_local(1, fn, value, timeout=10)


# -- the training config ----------------------------------------------------------------------------

def test_config_default_is_auto_and_numbers_and_auto_load(tmp_path):
    assert ParallelConfig().bucket_cap_mb == "auto" and load_config().parallel.bucket_cap_mb == "auto"
    assert load_config(None, ["--parallel.bucket_cap_mb=12"]).parallel.bucket_cap_mb == 12.0
    for text, want in [("4", 4.0), ('"auto"', "auto"), ("2.5", 2.5)]:
        path = tmp_path / "c.toml"
        path.write_text(f"[parallel]\nbucket_cap_mb = {text}\n")
        c = load_config(str(path))
        assert c.parallel.bucket_cap_mb == want
        path.write_text(to_toml(c))
        assert load_config(str(path)) == c


@pytest.mark.parametrize("value, words", [
    ("fast", "parallel.bucket_cap_mb = 'fast' is not a bucket size"),
    ("0", "parallel.bucket_cap_mb must be positive or \"auto\", got 0.0"),
    ("-1", "parallel.bucket_cap_mb must be positive or \"auto\", got -1.0"),
])
def test_config_names_the_field_and_the_fix(value, words, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--parallel.bucket_cap_mb={value}"])
    assert words in str(e.value) and 'use "auto"' in str(e.value) and "parallel.bucket_cap_mb = 25" in str(e.value)
    assert main(["train", f"--parallel.bucket_cap_mb={value}", "--print-config"]) == 2
    assert words in capsys.readouterr().err


def test_config_rejects_a_boolean_in_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[parallel]\nbucket_cap_mb = true\n")
    with pytest.raises(ConfigError, match="parallel.bucket_cap_mb must be a number or a string, got bool True"):
        load_config(str(path))


# -- meshtrain bench train --bucket-sweep -----------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--bucket-sweep", "1,fast"], "'fast' is neither a size in MiB nor 'auto'"),
    (["--bucket-sweep", "auto"], "needs at least one fixed size"),
    (["--bucket-sweep", "0,auto"], "must be a positive size"),
    (["--bucket-sweep", "1,auto", "--impls", "meshtrain-zero3"], "runs one DataParallel implementation"),
])
def test_sweep_bad_input_exits_2(argv, words, capsys):
    assert main(["bench", "train", *argv]) == 2
    assert words in capsys.readouterr().err


def test_sweep_interleaves_sizes_and_reports_ratios_to_the_best_fixed(monkeypatch, capsys):
    from meshtrain.bench import bucket_sweep
    from meshtrain.comm import launch

    calls = []
    speed = {1.0: 100.0, 4.0: 200.0, "auto": 190.0}

    def fake_spawn(world, fn, impl, preset, batch, seq, steps, warmup, size, algorithm, **kw):
        calls.append(size)
        rec = {"impl": impl, "world_size": world, "step_s_median": world * 8 / (speed[size] + len(calls)), "params": 1,
               "bucket_cap_bytes": 3 * MiB if size == "auto" else int(size * MiB), "buckets": 2, "loss": 0.0}
        return [rec] * world

    monkeypatch.setattr(launch, "spawn", fake_spawn)
    recs = bucket_sweep.run_sweep([2], "meshtrain-dp", [1.0, 4.0, "auto"], 3, preset="test", batch=1, seq=8,
                                  steps=1, warmup=0)
    assert calls == [1.0, 4.0, "auto"] * 3  # interleaved
    by = {r["bucket"]: r for r in recs}
    assert by["4"]["tokens_per_s"] == pytest.approx(200 + 5) and by["4"]["ratio_to_best_fixed"] == 1.0  # trials 2, 5, 8
    assert by["auto"]["ratio_to_best_fixed"] == pytest.approx((190 + 6) / (200 + 5))
    bucket_sweep.print_sweep(recs, "test", "meshtrain-dp", 3)
    assert "auto=3.0" in capsys.readouterr().out
