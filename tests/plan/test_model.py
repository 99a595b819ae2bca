"""The planner's formulas against hand-derivable values: parameter counts, FLOPs, ZeRO memory,
activation bytes, the 1F1B bubble, ring all-reduce time (nccl-tests bus bandwidth)."""

import math

import pytest

from meshtrain.plan.architectures import ARCHS, resolve_model
from meshtrain.plan.clusters import PRESETS
from meshtrain.plan.collectives import Group, collective, group_of
from meshtrain.plan.compute import layer_forward_parts, model_flops_per_token, stage_compute
from meshtrain.plan.layout import Layout
from meshtrain.plan.memory import (activation_bytes_per_token, memory_per_rank, microbatches_in_flight,
                                   stage_params)
from meshtrain.plan.step import pipeline_time, predict

H100 = PRESETS["h100"]


def test_llama3_8b_parameter_count_is_the_model_cards():
    a = ARCHS["llama3-8b"]
    block = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert a.params() == 32 * block + 2 * 128256 * 4096 + 4096
    assert a.params() == pytest.approx(8.03e9, rel=0.01)  # "8B": 8.03 B in the model card


def test_meshtrain_preset_shape_is_read_from_llama_config():
    a = resolve_model("8b")
    assert (a.n_layers, a.dim, a.n_kv_heads, a.ffn_dim) == (32, 4096, 8, 14336)


def test_flops_per_token_is_6n_plus_attention():
    a = ARCHS["llama3-8b"]
    assert model_flops_per_token(a, 8192) == 6 * a.flop_params() + 12 * 32 * 4096 * 8192


def test_matmul_time_is_two_flops_per_weight_per_token_and_halves_with_tp():
    from meshtrain.plan.compute import dense_gemm_factors

    a, tokens = ARCHS["llama3-8b"], 4096
    mm1, _, _ = layer_forward_parts(a, Layout(dp=8), H100, tokens, 4096)
    mm2, _, _ = layer_forward_parts(a, Layout(dp=4, tp=2), H100, tokens, 4096)
    # every forward matmul of the 8B reduces over >= 4096 without tp: no narrow-GEMM slowdown (the
    # backward's input gradients of wk and wv reduce over their 1024-wide outputs: a little)
    fwd, bwd = dense_gemm_factors(a, Layout(dp=8), H100, tokens)
    assert fwd == 1.0 and 1.0 < bwd < 1.05
    assert mm1 == pytest.approx(2 * a.matmul_params_per_layer() * tokens / (989e12 * H100.matmul_efficiency))
    # tp halves the FLOPs; the row-parallel matmuls then reduce over half the width (2048), a bit slower
    slow = dense_gemm_factors(a, Layout(dp=4, tp=2), H100, tokens)[0]
    assert 1.0 < slow < 1.1 and mm2 == pytest.approx(mm1 / 2 * slow)


def test_full_checkpointing_recomputes_exactly_the_blocks_forward():
    a = ARCHS["llama3-8b"]
    none = stage_compute(a, Layout(dp=8, ac="none"), H100, 2, 4096)
    full = stage_compute(a, Layout(dp=8, ac="full"), H100, 2, 4096)
    assert full.forward == none.forward and none.recompute == 0
    blocks_fwd = sum(layer_forward_parts(a, Layout(dp=8), H100, 2 * 4096, 4096)) * a.n_layers
    assert full.backward - none.backward == pytest.approx(blocks_fwd)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_states_are_16_bytes_per_parameter_sharded_by_zero_stage(zero):
    a, layout = ARCHS["llama3-8b"], Layout(dp=8, zero_stage=zero)
    m = memory_per_rank(a, layout, 1, 1024)
    n = a.params()
    assert stage_params(a, layout) == n
    shard = {0: (1, 1, 1), 1: (1, 1, 8), 2: (1, 8, 8), 3: (8, 8, 8)}[zero]
    assert (m.params, m.grads, m.optimizer) == pytest.approx((4 * n / shard[0], 4 * n / shard[1], 8 * n / shard[2]))
    if zero == 3:
        assert m.params + m.grads + m.optimizer == pytest.approx(16 * n / 8)


def test_gpt3_activations_are_korthikanti_34sbh_without_dropout_masks():
    # Korthikanti et al.: sbh(34 + 5as/h) bytes per layer; a fused attention drops the 5as/h
    # scores and the dropout masks (2 bytes/element of h), leaving 32 bytes per token per h.
    a = ARCHS["gpt-175b"]
    assert activation_bytes_per_token(a, Layout()) == 32 * a.dim
    # with sequence parallelism Korthikanti's 34sbh/t is Megatron's, which keeps its shard of the
    # attention's and the MLP's inputs and gathers again in backward; meshtrain's and torchtitan's
    # column-parallel linears save the gathered inputs whole: 2h more elements of 2 bytes
    assert activation_bytes_per_token(a, Layout(tp=8)) == 32 * a.dim / 8 + 2 * 2 * a.dim


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 8)])
def test_in_flight_and_bubble_of_1f1b(pp, m):
    assert microbatches_in_flight("1f1b", pp, m, 1) == pp
    assert microbatches_in_flight("afab", pp, m, 1) == m
    f, b = 1.0, 2.5
    # 1F1B: bubble (p-1)/(m+p-1) of the total, so the pipeline takes (m+p-1)(f+b)
    assert pipeline_time(Layout(pp=pp, microbatches=m), f, b) == pytest.approx((m + pp - 1) * (f + b))


def test_interleaving_shrinks_the_bubble():
    f, b = 1.0, 2.0
    plain = pipeline_time(Layout(pp=4, microbatches=8), f, b)
    inter = pipeline_time(Layout(pp=4, microbatches=8, virtual=2, schedule="interleaved"), f, b)
    assert 8 * (f + b) < inter < plain


def test_ring_all_reduce_inside_a_node_is_nccl_tests_bus_bandwidth():
    n, p = 1 << 30, 8
    t, algo = collective("all_reduce", n, Group(p, p), H100)
    assert algo in ("ring", "halving_doubling")  # both bandwidth-optimal; the latter has fewer steps
    # busbw = algbw * 2(p-1)/p, so t = 2(p-1)/p * n / busbw plus at most a ring's 2(p-1) latencies
    bandwidth_term = 2 * (p - 1) / p * n / H100.intra.bandwidth
    assert bandwidth_term < t <= bandwidth_term + 2 * (p - 1) * H100.intra.latency


def test_hierarchical_beats_a_flat_ring_across_nodes_for_large_buffers_on_meshtrains_backend():
    import dataclasses

    host_backend = dataclasses.replace(H100, backend="host")
    t, algo = collective("all_reduce", 1 << 30, Group(64, 8), host_backend)
    flat = 2 * 63 / 64 * (1 << 30) / H100.inter.bandwidth
    assert algo == "hierarchical" and t < flat


@pytest.mark.parametrize("op,factor", [("all_reduce", 2), ("reduce_scatter", 1), ("all_gather", 1)])
def test_nccl_rings_across_nodes_use_every_nic_the_group_owns(op, factor):
    # NCCL opens a channel per NIC: 8 members a node drive 8 NICs (capped by NVLink), 1 a node drives one
    n, lat = 1 << 30, H100.inter.latency
    eight, _ = collective(op, n, Group(64, 8), H100)
    one, _ = collective(op, n, Group(64, 1), H100)
    bw8 = factor * 63 / 64 * n / min(H100.intra.bandwidth, 8 * H100.inter.bandwidth)
    bw1 = factor * 63 / 64 * n / H100.inter.bandwidth
    assert bw8 <= eight <= bw8 + 2 * 63 * lat and bw1 <= one <= bw1 + 2 * 63 * lat
    assert one > 4 * eight  # 8 NICs against one (each ring step also pays the inter-node latency)


def test_groups_follow_the_mesh_order_tp_innermost():
    layout = Layout(dp=4, tp=8)
    assert group_of(layout, H100, ("tp",)) == Group(8, 8)
    assert group_of(layout, H100, ("dp",)) == Group(4, 1)
    assert group_of(Layout(dp=16, tp=2), H100, ("dp",)).nodes == 4


def test_more_gpus_at_the_same_per_gpu_batch_keep_compute_and_shrink_zero3_state():
    a = ARCHS["llama3-8b"]
    small = predict(a, H100, Layout(dp=8, zero_stage=3, ac="full"), 16, 4096)
    big = predict(a, H100, Layout(dp=64, zero_stage=3, ac="full"), 128, 4096)
    assert big.parts["compute"] == pytest.approx(small.parts["compute"])  # same work per GPU
    assert big.parts["optimizer"] == pytest.approx(small.parts["optimizer"] * 8 / 64)  # 1/dp of the update
    assert big.memory.total < small.memory.total
    assert 0 < small.mfu < 1 and math.isclose(sum(small.parts.values()), small.step_time, rel_tol=1e-9)


def test_pipeline_sends_one_hidden_state_per_chunk_boundary_each_way():
    a, m, v = ARCHS["llama3-8b"], 8, 2
    layout = Layout(dp=1, tp=2, pp=4, microbatches=m, virtual=v, schedule="interleaved")
    pred = predict(a, H100, layout, m, 4096)
    # tp*pp = 8 ranks on one node: each send is NVLink latency + bytes / bandwidth, bytes = S*d/tp*2 (SP, bf16)
    send = H100.intra.latency + 4096 * 4096 / 2 * 2 / H100.intra.bandwidth
    assert pred.parts["pp"] == pytest.approx(m * 2 * v * send)


def test_ring_attention_hides_behind_long_sequences_not_short_ones():
    from meshtrain.plan.collectives import p2p

    a = ARCHS["llama3-8b"]
    long = predict(a, H100, Layout(dp=4, cp=2), 4, 32768)
    short = predict(a, H100, Layout(dp=4, cp=2), 4 * 64, 512)
    # a step's K/V transfer is shorter than its attention: only the dK/dV's last hop home is exposed,
    # once a block in backward (fp32, K and V of this rank's 16384 tokens)
    home = p2p(16384 * 2 * a.kv_dim * 4, True, H100)
    assert long.parts["cp"] == pytest.approx(a.n_layers * home)
    short_home = p2p(64 * 256 * 2 * a.kv_dim * 4, True, H100)
    assert short.parts["cp"] > a.n_layers * short_home  # the steps' transfers show too


def test_afab_holds_m_microbatches_where_1f1b_holds_pp():
    from meshtrain.plan.memory import activation_memory

    a, pp, m = ARCHS["llama3-8b"], 4, 16
    one = activation_memory(a, Layout(pp=pp, microbatches=m, schedule="1f1b"), 1, 1024)
    all_ = activation_memory(a, Layout(pp=pp, microbatches=m, schedule="afab"), 1, 1024)
    from meshtrain.plan.memory import loss_bytes_per_vocab

    logits = 1024 * loss_bytes_per_vocab("bf16") * a.vocab_size  # held once, for the micro-batch in the loss
    assert (all_ - logits) / (one - logits) == pytest.approx(m / pp)


def test_hsdp_shards_over_dp_shard_and_all_reduces_shards_over_replicas():
    from meshtrain.errors import ConfigError
    from meshtrain.plan.layout import parse_layout

    a = ARCHS["llama3-8b"]
    flat = parse_layout("dp=64,zero=3")
    hsdp = parse_layout("dp=64,rep=8,zero=3")
    assert hsdp.label() == "dp=64,tp=1,pp=1,cp=1,rep=8,zero=3,ac=none" and hsdp.zero_shards == 8
    # ZeRO-3 state is 16 bytes per parameter over the shard group: 8 ranks instead of 64
    p = stage_params(a, flat)
    assert memory_per_rank(a, flat, 1, 8192).params == pytest.approx(p * 4 / 64)
    assert memory_per_rank(a, hsdp, 1, 8192).params == pytest.approx(p * 4 / 8)
    # mesh order (dp_replicate, dp_shard, pp, cp, tp): the 8 shards are one node, the 8 replicas 8 nodes
    assert group_of(hsdp, H100, ("dp_shard", "cp")) == Group(8, 8)
    assert group_of(hsdp, H100, ("dp_replicate",)) == Group(8, 1)
    assert group_of(hsdp, H100, ("dp", "cp")) == group_of(flat, H100, ("dp", "cp")) == Group(64, 8)
    pred = predict(a, H100, hsdp, 64, 8192)
    rep_t, _ = collective("all_reduce", p * 4 / 8, Group(8, 1), H100)
    assert "dp_replicate all_reduce" in pred.algorithms and pred.parts["dp"] >= rep_t > 0
    with pytest.raises(ConfigError, match="rep=3 does not divide dp=64"):
        predict(a, H100, parse_layout("dp=64,rep=3,zero=3"), 64, 8192)


def test_overlapped_param_gather_moves_zero1s_gather_behind_the_forward_in_bf16():
    from meshtrain.plan import step
    from meshtrain.plan.buckets import bucketed, tail_seconds
    from meshtrain.plan.layout import parse_layout

    a = ARCHS["llama3-8b"]
    after = parse_layout("dp=64,zero=1")
    behind = parse_layout("dp=64,zero=1,opg=1")
    assert behind.overlap_param_gather and behind.label().endswith("opg=1,zero=1,ac=none")
    assert parse_layout(behind.label()) == behind
    p = stage_params(a, after)
    g = group_of(after, H100, ("dp_shard", "cp"))
    mine, megatron = step.gradient_buckets(a, H100, after)[0], step.gradient_buckets(a, H100, behind)[0]
    assert megatron.cap == 64_000_000 * 4 != mine.cap  # each runtime's own buckets
    sc = stage_compute(a, after, H100, 2, 8192)  # two sequences per rank
    for b in (mine, megatron):  # the reduce-scatters hide behind the backward but for the last bucket
        assert bucketed("reduce_scatter", b, p * 4, g, H100)[0] < sc.backward
    fp32 = bucketed("all_gather", mine, p * 4, g, H100)[0]  # meshtrain: fp32, after the step, exposed
    bf16 = bucketed("all_gather", megatron, p * 2, g, H100)[0]
    assert bf16 < sc.forward  # so all of it but the first bucket hides behind the forward
    first = collective("all_gather", megatron.tail / 2, g, H100)[0]
    assert predict(a, H100, after, 128, 8192).parts["dp"] == pytest.approx(
        tail_seconds("reduce_scatter", mine, g, H100) + fp32)
    assert predict(a, H100, behind, 128, 8192).parts["dp"] == pytest.approx(
        tail_seconds("reduce_scatter", megatron, g, H100) + first)
    # ZeRO-3 gathers behind the forward anyway: the setting changes nothing there
    z3 = predict(a, H100, parse_layout("dp=64,zero=3"), 64, 8192)
    assert predict(a, H100, parse_layout("dp=64,zero=3,opg=1"), 64, 8192).step_time == z3.step_time
