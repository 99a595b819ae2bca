"""``attn=unfused``: Megatron-LM's attention before FlashAttention, its s x s scores materialised, and
the Megatron-LM 2021 weak-scaling rows priced with it (``meshtrain.plan.attention_unfused``)."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain.errors import ConfigError
from meshtrain.plan.architectures import ARCHS
from meshtrain.plan.attention_unfused import unfused_attention_seconds
from meshtrain.plan.clusters import PRESETS
from meshtrain.plan.compute import layer_forward_parts
from meshtrain.plan.layout import Layout, parse_layout, validate
from meshtrain.plan.memory import activation_memory
from meshtrain.plan.published_megatron_2021 import RUNS
from meshtrain.plan.published_run import check, megatron_flops_per_token
from meshtrain.plan.step import predict

A100 = PRESETS["a100"]
GPT17 = ARCHS["megatron-2021-gpt-1.7b"]  # 24 layers, d 2304, 24 heads of 96


def test_unfused_attention_is_the_scores_memory_traffic_where_heads_are_narrow():
    # At s = 2048 and head dim 96 a score element costs 2 x 96 FLOPs a GEMM but 2-5 bytes a pass: the
    # passes over memory, not the GEMMs, set the time, so it is far slower than FlashAttention-2
    seq, tokens = 2048, 2048
    flash, unfused = Layout(dp=32, ac="full"), Layout(dp=32, ac="full", attn_kernel="unfused")
    assert layer_forward_parts(GPT17, unfused, A100, tokens, seq)[1] > 2 * layer_forward_parts(GPT17, flash, A100,
                                                                                                tokens, seq)[1]
    # memory-bound: twice the heads at the same width, twice the scores, twice the time
    wide = dataclasses.replace(GPT17, n_heads=48, n_kv_heads=48)
    f1, b1 = unfused_attention_seconds(GPT17, unfused, A100, tokens, seq, 2)
    f2, b2 = unfused_attention_seconds(wide, unfused, A100, tokens, seq, 2)
    assert f2 == pytest.approx(2 * f1) and b2 == pytest.approx(2 * b1)
    # at the bytes' roofline: the forward's passes move a + 1.5 a + (2 a + 1) + a bytes a score element
    elements = 24 * seq * tokens
    assert f1 == pytest.approx(elements * (5.5 * 2 + 1) / A100.per_rank_bandwidth(32))
    # tp splits the heads
    assert unfused_attention_seconds(GPT17, dataclasses.replace(unfused, tp=2, dp=16), A100, tokens, seq, 2)[0] == \
        pytest.approx(f1 / 2)
    assert predict(GPT17, A100, unfused, 512, seq).step_time > predict(GPT17, A100, flash, 512, seq).step_time


def test_unfused_attention_keeps_korthikantis_five_bytes_a_score_for_backward():
    # Korthikanti et al. (arXiv 2205.05198): 5·a·s/h bytes a token and hidden unit at fp16 = 5 x heads x s
    # bytes a token: the softmax output, the dropout mask and the dropped probabilities
    seq = 2048
    flash, unfused = Layout(dp=32), Layout(dp=32, attn_kernel="unfused")
    extra = activation_memory(GPT17, unfused, 1, seq) - activation_memory(GPT17, flash, 1, seq)
    assert extra == pytest.approx(GPT17.n_layers * seq * 5 * GPT17.n_heads * seq)
    # full recomputation keeps one block's, while it is recomputed
    full = dataclasses.replace(flash, ac="full")
    extra_full = activation_memory(GPT17, dataclasses.replace(full, attn_kernel="unfused"), 1, seq) - \
        activation_memory(GPT17, full, 1, seq)
    assert extra_full == pytest.approx(seq * 5 * GPT17.n_heads * seq)


def test_unfused_attention_has_no_ring_and_its_label_round_trips():
    layout = parse_layout("dp=4,tp=2,sp=0,attn=unfused,ac=full")
    assert layout.label() == "dp=4,tp=2,pp=1,cp=1,sp=0,attn=unfused,zero=0,ac=full"
    assert parse_layout(layout.label()) == layout
    with pytest.raises(ConfigError, match=r"attn=unfused .* needs cp=1, got cp=2"):
        validate(parse_layout("dp=4,cp=2,attn=unfused"), GPT17, 8, 32, 2048)


def test_megatrons_flop_count_is_four_forwards_of_every_score_and_three_of_the_logits():
    # counted here from the shapes: a block's forward is 24 h^2 matmul FLOPs and 4 s h for Q K^T and P V
    # over all s keys; recomputation, backward (twice) make four; the logits 2 V h, thrice
    for name in ("megatron-2021-gpt-1.7b", "megatron-2021-gpt-1t"):
        a, s = ARCHS[name], 2048
        per_token = a.n_layers * 4 * (24 * a.dim**2 + 4 * s * a.dim) + 3 * 2 * a.vocab_size * a.dim
        assert megatron_flops_per_token(a, s) == pytest.approx(per_token)


def test_the_2021_table_is_priced_by_megatrons_own_count():
    row = RUNS[0]
    got = check(row)
    pred = predict(ARCHS[row.model], A100, parse_layout(row.layout, compile=True), row.global_batch, row.seq)
    assert got["predicted"] == pytest.approx(pred.tokens_per_s_per_gpu
                                             * megatron_flops_per_token(ARCHS[row.model], row.seq) / 1e12)
    assert [r.gpus for r in RUNS] == [32, 64, 128, 256, 512, 1024, 1536, 1920, 2520, 3072]

