"""The planner's gradient buckets are the runtime's: ``bucket_cap_mb = "auto"``'s size (the rule in
``parallel.bucket_size``, fed what ``resolve_bucket_cap`` feeds it on each backend), DataParallel's and
ZeRO-1/2's cuts of the real parameters, Megatron's default for a Megatron run, and the last bucket
(the embedding's gradient, produced last) exposed after backward."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshtrain.comm.select import CostModel, default_model
from meshtrain.config.model import PRESETS
from meshtrain.models.llama import Llama
from meshtrain.parallel.bucket_size import MiB, auto_bucket_bytes, split_by_bytes
from meshtrain.parallel.buckets import build_buckets
from meshtrain.plan import step
from meshtrain.plan.architectures import from_llama_config, resolve_model
from meshtrain.plan.buckets import FIRST_BUCKET, bucket_plan, registered_tensors, runtime_link
from meshtrain.plan.clusters import Level, resolve_cluster
from meshtrain.plan.collectives import Group, group_of
from meshtrain.plan.compute import StageCompute
from meshtrain.plan.layout import parse_layout

# a host link whose rule lands inside the 1-256 MiB clamp for the test model's gradients
HOST = replace(resolve_cluster("h100"), backend="host", intra=Level(2e-6, 5e9), inter=Level(2e-6, 5e9),
               reduce_gamma=1 / 4e9)


@pytest.fixture(scope="module")
def model():
    cfg = replace(PRESETS["10m"], vocab_size=512)
    return cfg, Llama(cfg)


def _named(model) -> list:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def test_the_size_is_the_runtimes_rule_on_the_link_the_runtime_sees(model):
    cfg, m = model
    grads = sum(p.numel() for _, p in _named(m)) * 4
    layout = parse_layout("dp=4")
    for call_s in (0.0, 1e-3):
        plan = bucket_plan(HOST, layout, grads, Group(4, 4), "all_reduce", call_s=call_s)
        expect, _ = auto_bucket_bytes(CostModel(2e-6, 1 / 5e9, 1 / 4e9), grads, 4, "all_reduce", call_s=call_s)
        assert plan.cap == expect
    # NCCL groups are not measured: the rule sees the torch transport's registry model, no call
    gpu = resolve_cluster("h100")
    assert runtime_link(gpu, call_s=1.0) == (default_model("torch"), 0.0)
    plan = bucket_plan(gpu, layout, 32e9, Group(8, 8), "reduce_scatter")
    assert plan.cap == auto_bucket_bytes(default_model("torch"), int(32e9), 8, "reduce_scatter")[0]
    assert MiB <= plan.cap <= 256 * MiB


def test_the_counts_are_dataparallels_and_zeros_cuts_of_the_parameters(model):
    cfg, m = model
    named = _named(m)
    arch = from_llama_config("10m", cfg)
    # the planner's tensors are the model's gradients, in registration order
    assert registered_tensors(arch, parse_layout("dp=4")) == [p.numel() * 4 for _, p in named]
    grads = sum(p.numel() for _, p in named) * 4
    # DataParallel: reverse registration order, a 1 MiB first bucket, then buckets of the cap
    dp = step.gradient_buckets(arch, HOST, parse_layout("dp=4"))[0]
    made = build_buckets(list(reversed(named)), dp.cap, first_cap_bytes=min(FIRST_BUCKET, dp.cap))
    assert dp.count == len(made) > 1
    assert dp.tail == made[-1].buffer.numel() * 4  # the embedding's bucket, filled last
    # ZeRO-1/2: units cut by the cap from the end (split_by_bytes); the first run completes last
    z1 = step.gradient_buckets(arch, HOST, parse_layout("dp=4,zero=1"))[0]
    runs = split_by_bytes(named, z1.cap, 4)
    assert z1.count == len(runs) > 1
    assert z1.tail == sum(p.numel() for _, p in runs[0]) * 4
    assert z1.cap == auto_bucket_bytes(CostModel(2e-6, 1 / 5e9, 1 / 4e9), grads, 4, "reduce_scatter")[0]


def test_step_counts_a_collective_per_bucket_on_this_host(monkeypatch):
    monkeypatch.setattr(step, "collective_latency", lambda world, threads: 1e-3)
    host = replace(HOST, intra=Level(0.0, 5e9), inter=Level(0.0, 5e9), profile_compute=True)
    arch = from_llama_config("test", replace(PRESETS["test"], vocab_size=512))
    sc = StageCompute(0.0, 0.0, 0.0, layers=4)

    def calls(text: str) -> float:
        return step._step_collectives(arch, host, parse_layout(text), sc) / 1e-3

    dp0 = step.gradient_buckets(arch, host, parse_layout("dp=4"), 1e-3)[0]
    z1 = step.gradient_buckets(arch, host, parse_layout("dp=4,zero=1"), 1e-3)[0]
    assert calls("dp=4") == pytest.approx(1 + dp0.count)  # the loss, one all-reduce per bucket
    assert calls("dp=4,zero=1") == pytest.approx(1 + 1 + 2 * z1.count)  # loss, norm, RS + AG per unit (bucket)
    assert calls("dp=4,zero=3") == pytest.approx(1 + 1 + 3)  # ZeRO-3: units are blocks; the root unit
    assert calls("dp=4,rep=2,zero=3") == pytest.approx(1 + 1 + 3 + 5)  # and each unit's replica all-reduce
    # the measured call makes the buckets larger (its latency is the rule's floor), so fewer
    assert step.gradient_buckets(arch, host, parse_layout("dp=4"), 0.0)[0].count >= dp0.count


def test_megatron_runs_keep_megatrons_buckets():
    arch, cluster = resolve_model("llama3-8b"), resolve_cluster("h100")
    lay = parse_layout("dp=64,zero=1,opg=1")
    b = bucket_plan(cluster, lay, 32e9, group_of(lay, cluster, ("dp_shard", "cp")), "reduce_scatter")
    assert b.cap == 64_000_000 * 4  # max(40e6, 1e6 x 64) parameters of fp32 gradient
    small = bucket_plan(cluster, replace(lay, dp=8), 32e9, Group(8, 8), "reduce_scatter")
    assert small.cap == 40_000_000 * 4


def test_the_embeddings_gradient_is_the_exposed_last_bucket():
    arch, cluster = resolve_model("llama3-8b"), resolve_cluster("h100")
    one_stage = step.gradient_buckets(arch, cluster, parse_layout("dp=8"))[0]
    assert one_stage.tail == pytest.approx(arch.embedding_params() * 4)  # 2.1 GB, larger than any bucket
    assert one_stage.cap < one_stage.tail
    piped = step.gradient_buckets(arch, cluster, parse_layout("dp=4,pp=2,m=2"))[0]
    assert piped.tail <= piped.cap  # the last stage's first tensors: what remains of a bucket
