"""The planner's physics from issue 34, each checked by a property computed here: ring attention's
exposed exchange and merge passes, the attention kernel's measured length curve, cross-node rings on
every NIC, compile's gain on element-wise ops only, what memory is live at the peak, async TP, float8
casts and torchtitan's selective op checkpointing."""

import dataclasses

import pytest

from meshtrain.errors import ConfigError
from meshtrain.plan.architectures import ARCHS
from meshtrain.plan.clusters import PRESETS
from meshtrain.plan.collectives import Group, collective, group_of
from meshtrain.plan.compute import (ACT_BYTES, attention_rate, elementwise_bytes, elementwise_per_token,
                                    fp8_cast_bytes_per_token, head_seconds_analytic, layer_forward_parts,
                                    loss_bytes_per_logit, matmul_chain,
                                    op_recomputed_matmul_share, ring_merge_bytes)
from meshtrain.plan.layout import Layout, parse_layout, validate
from meshtrain.plan.memory import activation_memory, loss_bytes_per_vocab, memory_per_rank, stage_params
from meshtrain.plan.search import search
from meshtrain.plan.step import TE_COMM_SMS, _context_parallel, _tensor_parallel, predict

H100 = PRESETS["h100"]
L8B, L70B = ARCHS["llama3-8b"], ARCHS["llama3-70b"]


def test_ring_attention_exposure_shrinks_with_sequence_and_grows_without_overlap():
    # cp across nodes (tp fills the node): each step's K/V transfer grows with S, its attention with S^2
    layout = Layout(dp=1, tp=8, cp=4)
    share = []
    for seq in (4096, 16384, 65536):
        f, b = _context_parallel(L70B, H100, layout, seq // 4, seq, {})
        _, attn, _ = layer_forward_parts(L70B, layout, H100, seq // 4, seq)
        share.append(f / attn)
        # all K/V in one all-gather hides behind the first step only: never less exposed than the ring
        f_ag, b_ag = _context_parallel(L70B, H100, dataclasses.replace(layout, cp_allgather=True), seq // 4, seq, {})
        assert f_ag >= f and b_ag >= b
    assert share[0] > share[1] >= share[2] >= 0.0 and share[0] > 0.0


def test_ring_bookkeeping_is_counted_from_pytorchs_ring_per_step():
    one, two, eight = (ring_merge_bytes(L8B, Layout(cp=c)) for c in (1, 2, 8))
    assert one == (0.0, 0.0)
    q, kv = L8B.o_dim, 2 * L8B.kv_dim  # kv heads as they are (no kvrep): K and V 1024 wide each
    # forward, bf16: per step the merge (up-cast 6, three fp32 passes 32; half the steps on half the
    # queries plus a whole r4 w4 copy: 0.75 x 6 + 28) and the K/V concatenation (r2 w2); the first
    # block's up-cast and the final down-cast (6 each) once
    step_f = q * (0.75 * 6 + 28) + kv * 4
    assert two[0] == pytest.approx(step_f + 12 * q) and eight[0] - two[0] == pytest.approx(6 * step_f)
    # backward: every step adds dq, dk, dv into fp32 (r4 r2 w4, half the steps via a partial update:
    # +1.5 on average) and concatenates dK, dV (r4 w4); every step but the last concatenates K, V (r2 w2)
    step_b = (q + kv) * 11.5 + kv * 8 + kv * 4
    assert eight[1] - two[1] == pytest.approx(6 * step_b)
    # kvrep=1: the peer's repeated K/V are as wide as the queries, and move that much more
    rep = ring_merge_bytes(L8B, Layout(cp=8, kv_repeat=True))
    assert rep[0] - eight[0] == pytest.approx(7 * 2 * (q - L8B.kv_dim) * 4)


def test_attention_rate_follows_the_kernels_length_curve_and_cudnn_is_faster():
    layout = Layout(dp=8)
    rates = [attention_rate(H100, layout, n) for n in (512, 2048, 16384, 131072)]
    assert rates[0] < rates[1] < rates[2] == rates[3] == pytest.approx(989e12 * H100.attention_efficiency)
    cudnn = attention_rate(H100, dataclasses.replace(layout, attn_kernel="cudnn"), 16384)
    assert cudnn / rates[2] == pytest.approx(H100.fused_attention_speedup)
    assert attention_rate(H100, layout, 16384, backward=True) < rates[2]


def test_triton_attention_runs_at_flashattention1s_rate():
    # llm-foundry's Triton FlashAttention (MosaicML's runs): FlashAttention-1's 25-40 % of an A100's peak,
    # its top at long sequences, on FlashAttention-2's length curve; no Hopper measurement: half FA2's
    a100, tri = PRESETS["a100"], Layout(dp=8, attn_kernel="triton")
    assert attention_rate(a100, tri, 65536) == pytest.approx(312e12 * 0.40)
    assert attention_rate(a100, tri, 65536, backward=True) == pytest.approx(312e12 * 0.40)
    assert attention_rate(a100, tri, 512) == pytest.approx(312e12 * 0.40 * 191 / 335)
    assert attention_rate(H100, tri, 16384) == pytest.approx(attention_rate(H100, Layout(dp=8), 16384) / 2)
    assert parse_layout("dp=8,attn=triton").label() == "dp=8,tp=1,pp=1,cp=1,attn=triton,zero=0,ac=none"


def test_repeated_kv_heads_widen_the_ring_and_its_last_hop_is_exposed():
    from meshtrain.plan.collectives import p2p
    from meshtrain.plan.compute import attention_kv_width

    l405 = ARCHS["llama3-405b"]  # 128 heads, 8 kv heads: tp=8 leaves one kv head, or 16 repeated ones
    plain = parse_layout("dp=1,tp=8,pp=8,cp=8,m=8,cpag=1,zero=3,ac=full")
    rep = dataclasses.replace(plain, kv_repeat=True)
    assert attention_kv_width(l405, plain) == 128 and attention_kv_width(l405, rep) == 16 * 128
    assert rep.label().endswith("cpag=1,kvrep=1,zero=3,ac=full") and parse_layout(rep.label()) == rep
    tokens, seq = 32768, 262144
    f0, b0 = _context_parallel(l405, H100, plain, tokens, seq, {})
    f1, b1 = _context_parallel(l405, H100, rep, tokens, seq, {})
    # cp ranks sit tp = 8 apart, one a node: the 16x wider all-gather outgrows the first step on the NICs
    assert f0 == 0.0 < f1
    assert b0 == pytest.approx(p2p(tokens * 2 * 128 * 4, False, H100))  # only the dK/dV's last hop home
    assert b1 >= p2p(tokens * 2 * 2048 * 4, False, H100)
    # the repeat is an element-wise copy on every block, CP or not
    assert elementwise_per_token(L8B, Layout(dp=8, kv_repeat=True), H100) > elementwise_per_token(L8B, Layout(dp=8),
                                                                                                   H100)


def test_zero_across_nodes_costs_no_more_than_dp_all_reduce_for_the_same_bytes():
    # a ring all-reduce is a reduce-scatter then an all-gather; across nodes all three run on every NIC
    n, group = 4 * 1.7e9, Group(48, 8)
    rs, _ = collective("reduce_scatter", n, group, H100)
    ag, _ = collective("all_gather", n, group, H100)
    ar, _ = collective("all_reduce", n, group, H100)
    assert rs + ag <= 1.05 * ar


def test_compile_saves_only_element_wise_traffic_and_only_where_eager_runs_several_kernels():
    for arch in (L8B, ARCHS["mpt-7b"]):
        eager, fused = Layout(dp=8), Layout(dp=8, compile=True)
        mm_e, at_e, el_e = layer_forward_parts(arch, eager, H100, 8192, 8192)
        mm_c, at_c, el_c = layer_forward_parts(arch, fused, H100, 8192, 8192)
        assert (mm_e, at_e) == (mm_c, at_c)  # matmuls and attention untouched
        if arch.norm == "layernorm":  # one kernel each (LayerNorm, GELU) even eagerly: nothing to save
            assert el_e == el_c
        else:
            assert el_e > 2 * el_c
    a = ACT_BYTES["bf16"]
    assert elementwise_bytes("rmsnorm", a, True) == 36 and elementwise_bytes("rmsnorm", a, False) == 4
    assert elementwise_bytes("swiglu", a, True) / elementwise_bytes("swiglu", a, False) == pytest.approx(5 / 3)


def test_full_checkpointing_holds_one_blocks_compute_copy_at_the_peak():
    none = memory_per_rank(L8B, Layout(dp=8, ac="none"), 1, 4096)
    full = memory_per_rank(L8B, Layout(dp=8, ac="full"), 1, 4096)
    assert none.buffers - full.buffers == pytest.approx((L8B.n_layers - 1) * L8B.params_per_layer() * 2)
    z3 = memory_per_rank(L8B, Layout(dp=8, zero_stage=3, ac="full"), 1, 4096)
    # two gathered bf16 blocks + a block's fp32 grad, and the root unit (embedding, norm, head) gathered in bf16
    root = L8B.vocab_size * L8B.dim * 2 + L8B.dim
    assert z3.buffers == pytest.approx(L8B.params_per_layer() * (2 * 2 + 4) + root * 2)


def test_zero3_root_gradient_is_held_where_the_loss_temporaries_are_smaller():
    """ZeRO-3's root-unit gradient (fp32, from the head's backward to the embedding's) lives after the
    loss's temporaries are freed: the peak holds the larger of the two, not both."""
    lay = Layout(dp=8, zero_stage=3, ac="full")
    root = L8B.vocab_size * L8B.dim * 2 + L8B.dim
    logits = lambda tokens: tokens * loss_bytes_per_vocab("bf16") * L8B.vocab_size  # noqa: E731
    stored = lambda tokens: activation_memory(L8B, lay, 1, tokens) - logits(tokens)  # noqa: E731
    for tokens in (16, 4096):  # a short sequence: the root gradient is larger; a long one: the loss
        with_grad = activation_memory(L8B, lay, 1, tokens, held_grad=root * 4)
        assert with_grad == pytest.approx(stored(tokens) + max(logits(tokens), root * 4))
    assert memory_per_rank(L8B, lay, 1, 16).activations == pytest.approx(stored(16) + root * 4)
    assert memory_per_rank(L8B, Layout(dp=8, zero_stage=2, ac="full"), 1, 16).activations == \
        pytest.approx(stored(16) + logits(16))  # ZeRO-2's gradients are the buckets, already counted


def test_a_compiled_loss_holds_the_logits_and_their_gradient_only():
    """``closs=1`` (a peer whose cross-entropy is compiled): 2 + 2 bytes a logit at bf16 against
    eager's 2 + 3 x 4; fp32 is 8 either way. Its one pass each way is also faster."""
    assert loss_bytes_per_vocab("bf16", compiled=True) == 4.0 and loss_bytes_per_vocab("bf16") == 14.0
    assert loss_bytes_per_vocab("fp32", compiled=True) == loss_bytes_per_vocab("fp32") == 8.0
    eager, fused = parse_layout("dp=8,zero=3,ac=op"), parse_layout("dp=8,zero=3,ac=op,closs=1")
    assert fused.label().endswith("closs=1,zero=3,ac=op") and parse_layout(fused.label()) == fused
    drop = memory_per_rank(L8B, eager, 2, 8192).total - memory_per_rank(L8B, fused, 2, 8192).total
    assert drop == pytest.approx(2 * 8192 * L8B.vocab_size * (14 - 4))
    assert predict(L8B, H100, fused, 16, 8192).step_time < predict(L8B, H100, eager, 16, 8192).step_time


def test_fsdp_under_a_pipeline_keeps_the_stages_unsharded_fp32_gradients():
    base = parse_layout("dp=2,pp=4,m=4,zero=3,ac=full")
    plain = predict(L8B, H100, base, 8, 4096)
    fsdp = predict(L8B, H100, dataclasses.replace(base, fsdp_pp=True), 8, 4096)
    assert fsdp.memory.total - plain.memory.total == pytest.approx(stage_params(L8B, base) * 4)
    assert fsdp.step_time == plain.step_time


def test_async_tp_hides_part_of_the_forward_collectives_and_none_of_the_backward():
    layout = parse_layout("dp=4,tp=8,zero=3,ac=full")
    f0, b0 = _tensor_parallel(L70B, H100, layout, 8192, 8192, {})
    f1, b1 = _tensor_parallel(L70B, H100, dataclasses.replace(layout, async_tp=True), 8192, 8192, {})
    assert 0.0 <= f1 < f0 and b1 == b0
    assert predict(L70B, H100, dataclasses.replace(layout, async_tp=True), 4, 8192).step_time < \
        predict(L70B, H100, layout, 4, 8192).step_time
    with pytest.raises(ConfigError, match="atp=1"):
        validate(parse_layout("dp=8,atp=1"), L8B, 8, 8, 4096)


def test_transformer_engines_userbuffers_also_hide_the_backward_but_hold_sms():
    # Megatron's --tp-comm-overlap: the backward's four collectives a block overlapped too (atpb=1)
    fwd_only = parse_layout("dp=4,tp=8,atp=1,zero=1,ac=none")
    te = dataclasses.replace(fwd_only, async_tp_backward=True)
    tokens = 8192
    f1, b1 = _tensor_parallel(L70B, H100, fwd_only, tokens, 8192, {})
    f2, b2 = _tensor_parallel(L70B, H100, te, tokens, 8192, {})
    assert b2 < b1
    # the bulk gather and scatter beside the first matmuls cost at least their SMs' share of themselves,
    # and TE's forward scatter (4 pieces, SMs held) hides no more than PyTorch's (tp pieces, copy engines)
    group = group_of(te, H100, ("tp",))
    h_bytes = tokens * L70B.dim * ACT_BYTES["bf16"]
    ag, _ = collective("all_gather", h_bytes, group, H100)
    rs, _ = collective("reduce_scatter", h_bytes, group, H100)
    assert b2 >= L70B.n_layers * 2 * (TE_COMM_SMS / H100.sm_count) * (ag + rs) * (1 - 1e-9)
    assert f2 >= f1
    assert parse_layout("dp=4,tp=8,atp=1,atpb=1").label().count("atpb=1") == 1
    with pytest.raises(ConfigError, match="atpb=1.*atp=1"):
        validate(parse_layout("dp=1,tp=8,atpb=1"), L70B, 8, 8, 4096)


def test_the_losss_passes_are_the_kernels_pytorch_launches():
    # eager F.cross_entropy(logits.float()): forward the up-cast (r2 w4), log-softmax's max, sum and
    # output passes (r4, r4, r4 w4); backward nll's zeroed gradient (w4), log-softmax backward's sum and
    # output passes (r4; r4 r4 w4), the down-cast (r4 w2)
    fwd, bwd = [2 + 4, 4, 4, 4 + 4], [4, 4, 4 + 4 + 4, 4 + 2]
    assert loss_bytes_per_logit("bf16") == (sum(fwd), sum(bwd)) == (22, 26)
    assert loss_bytes_per_logit("fp32") == (sum(fwd) - 6, sum(bwd) - 6)  # no casts
    assert loss_bytes_per_logit("bf16", compiled=True) == (2, 4)  # read the logits; read again, write the gradient
    eager = Layout(dp=1, precision="bf16")
    f, b = head_seconds_analytic(L8B, eager, H100, 8192)
    fc, bc = head_seconds_analytic(L8B, dataclasses.replace(eager, loss_compiled=True), H100, 8192)
    per_byte = L8B.vocab_size * 8192 / H100.per_rank_bandwidth(1)
    assert f - fc == pytest.approx((22 - 2) * per_byte) and b - bc == pytest.approx((26 - 4) * per_byte)
    assert b > 2 * fc  # the logits' matmul backward is twice its forward, before any loss pass


def test_float8_adds_the_casts_of_every_linears_input_and_output_gradient():
    bf16, fp8 = Layout(dp=8, compile=True), Layout(dp=8, compile=True, precision="fp8")
    extra = elementwise_per_token(L8B, fp8, H100) - elementwise_per_token(L8B, bf16, H100)
    assert extra == pytest.approx(fp8_cast_bytes_per_token(L8B, fp8)) and extra > 0


def test_torchtitans_op_checkpointing_recomputes_every_second_matmul():
    chain = matmul_chain(L8B)  # wq, wk, wv, wo, w1, w3, w2
    assert len(chain) == 7
    assert op_recomputed_matmul_share(L8B) == pytest.approx((chain[1] + chain[3] + chain[5]) / sum(chain))


def test_search_prices_async_tp_only_where_the_runtime_has_it():
    arch = ARCHS["mpt-1b"]
    without = search(arch, H100, 8, 16, 2048, {"compile": True, "zero_stage": 1}, top=50)
    assert not any(p.layout.async_tp for p in without)
    with_atp = search(arch, H100, 8, 16, 2048, {"compile": True, "zero_stage": 1, "async_tp": True}, top=50)
    assert all(p.layout.async_tp == (p.layout.tp > 1) for p in with_atp)
    # TE's backward overlap too (a Megatron row's --search): on the tp > 1 candidates only, none refused
    te = search(arch, H100, 8, 16, 2048, {"compile": True, "zero_stage": 1, "async_tp": True,
                                          "async_tp_backward": True}, top=50)
    assert len(te) == len(with_atp) and any(p.layout.tp > 1 for p in te)
    assert all(p.layout.async_tp_backward == (p.layout.tp > 1) for p in te)


def test_megatrons_p2p_overlap_hides_each_pipeline_transfer_behind_the_next_chunks_compute():
    # 70B on 64 GPUs, pipeline hops across nodes (Megatron's order): each of the v chunks sends its
    # output and its input gradient; overlapped, only the part longer than a chunk's compute is left
    layout = parse_layout("dp=2,tp=4,pp=8,m=64,interleaved,v=5,zero=1,ac=none,order=megatron", compile=True)
    plain = predict(L70B, H100, layout, 128, 8192)
    over = predict(L70B, H100, dataclasses.replace(layout, p2p_overlap=True), 128, 8192)
    assert plain.parts["pp"] > 0.1 and over.parts["pp"] == 0.0  # 30 ms chunks hide a 1 ms hop
    assert over.step_time == pytest.approx(plain.step_time - plain.parts["pp"], rel=0.02)
    assert parse_layout(over.layout.label(), compile=True) == over.layout and "ppo=1" in over.layout.label()
    # Megatron overlaps only the interleaved schedule's transfers
    with pytest.raises(ConfigError, match="ppo=1.*needs pp > 1 and interleaved.*use ppo=0"):
        validate(parse_layout("dp=2,tp=4,pp=8,m=64,1f1b,ppo=1"), L70B, 64, 128, 8192)
    # --search keeps a peer's overlap on its interleaved candidates only
    fixed = {"compile": True, "zero_stage": 1, "p2p_overlap": True, "schedule": "1f1b"}
    assert not any(p.layout.p2p_overlap for p in search(L70B, H100, 64, 128, 8192, fixed, top=5))


def test_an_overlapped_ep_all_to_all_costs_the_compute_the_sms_it_holds():
    # DeepSeek-V3 as Megatron-Bridge ran it: the all-to-all (about as long as the compute beside it)
    # holds 20 of the H100's 132 SMs, so the compute beside it runs that much slower
    from meshtrain.plan.moe import EP_COMM_SMS, ep_exposed
    layout = parse_layout("dp=64,tp=2,pp=8,m=128,v=4,interleaved,ep=64,epo=1,zero=1,order=megatron")
    assert ep_exposed(layout, 0.07, 0.07, 0.04, 0.10) == pytest.approx((0.0, 0.0))  # no SMs given: hidden
    f, b = ep_exposed(layout, 0.07, 0.07, 0.04, 0.10, sm_count=132)
    assert f + b == pytest.approx(EP_COMM_SMS / 132 * 0.14)
    # a transfer longer than compute + its share is exposed by the difference, as before
    assert sum(ep_exposed(layout, 0.2, 0.2, 0.04, 0.10, sm_count=132)) == pytest.approx(0.26)
    # without Megatron's overlap everything is exposed, whatever the SMs
    assert ep_exposed(dataclasses.replace(layout, ep_overlap=False), 0.07, 0.07, 0.04, 0.10, 132) == (0.07, 0.07)


def test_search_offers_the_interleavings_megatron_can_run():
    # Megatron needs layers divisible by pp x v: the model table's 119B (92 layers on PP 4) can only
    # interleave with v = 23, its 462B (112 on PP 16) with v = 7; --search must be able to price them
    from meshtrain.plan.search import candidates

    for name, tp, pp, gpus, batch, v in (("megatron-2024-gpt-119b", 8, 4, 1536, 768, 23),
                                         ("megatron-2024-gpt-462b", 8, 16, 6144, 3072, 7)):
        arch = ARCHS[name]
        fixed = {"schedule": "interleaved", "zero_stage": 1}
        vs = {c.virtual for c in candidates(arch, H100, gpus, batch, 4096, fixed)
              if (c.tp, c.pp) == (tp, pp)}
        assert v in vs and all(v_ == 1 or pp * v_ <= arch.n_layers for v_ in vs), (name, vs)
        assert arch.n_layers % (pp * v) == 0 and all(arch.n_layers % (pp * u) for u in range(2, v))
