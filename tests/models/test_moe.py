"""The mixture-of-experts layer: grouped experts, dispatch, routing, capacity, load balancing, the
step statistics, config checks and presets. Every expected value is computed here in plain PyTorch."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from meshtrain.errors import ConfigError
from meshtrain.models.llama import (MLP, PRESETS, Llama, LlamaConfig, active_params, full_value, init_weights,
                                    num_params, param_std)
from meshtrain.models.moe import (GroupedExperts, LocalDispatcher, MoE, MoEStepInfo, finish_moe_step, moe_layers,
                                  set_moe_step)

E, K, DIM, HIDDEN = 4, 2, 16, 8


def _cfg(**kw) -> LlamaConfig:
    base = dict(vocab_size=32, dim=DIM, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=64,
                n_experts=E, moe_top_k=K, moe_ffn_dim=HIDDEN, n_shared_experts=1)
    return LlamaConfig(**{**base, **kw})


def _layer(seed: int = 0, **kw) -> MoE:
    """A MoE layer with weights large enough that routing is decisive and outputs are O(1)."""
    torch.manual_seed(seed)
    layer = MoE(_cfg(**kw))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(std=1.0 if "gate" in name else 0.3)
    return layer


def _expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _scores(layer: MoE, tokens: torch.Tensor) -> torch.Tensor:
    logits = tokens @ layer.router.gate.weight.T
    return logits.softmax(-1) if layer.router_score == "softmax" else logits.sigmoid()


def _choices(layer: MoE, tokens: torch.Tensor) -> torch.Tensor:
    scores = _scores(layer, tokens).detach()
    return torch.topk(scores + layer.router.expert_bias, layer.top_k, dim=-1).indices


def _reference(layer: MoE, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """The layer as a loop over tokens and their choices; with ``capacity``, an expert's
    assignments past the first ``capacity`` (in order of token, then choice) contribute nothing."""
    b, s, d = x.shape
    tokens = x.reshape(-1, d)
    scores, chosen = _scores(layer, tokens), _choices(layer, tokens)
    ex = layer.experts
    used = [0] * layer.n_experts
    rows = []
    for t in range(tokens.shape[0]):
        w = scores[t, chosen[t]]
        if layer.router.norm:
            w = w / w.sum()
        w = w * layer.router.scale
        row = torch.zeros(d)
        for j, e in enumerate(chosen[t].tolist()):
            used[e] += 1
            if capacity is None or used[e] <= capacity:
                row = row + w[j] * _expert(tokens[t:t + 1], ex.w1[e], ex.w3[e], ex.w2[e])[0]
        rows.append(row)
    out = torch.stack(rows)
    if layer.shared is not None:
        out = out + layer.shared(tokens)
    return out.view(b, s, d)


def _grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors, allow_unused=True))


def _params(layer: MoE) -> list[torch.Tensor]:
    return [p for _, p in layer.named_parameters()]


# --------------------------------------------------------------------------------- grouped experts

def _loop(x: torch.Tensor, counts: list[int], ex: GroupedExperts) -> torch.Tensor:
    outs, start = [], 0
    for e, c in enumerate(counts):
        outs.append(_expert(x[start:start + c], ex.w1[e], ex.w3[e], ex.w2[e]))
        start += c
    return torch.cat(outs)


@pytest.mark.parametrize("path", ["forward", "padded", "grouped-fp32"])
def test_grouped_experts_match_a_loop_with_empty_experts(path):
    """Each path (what forward picks: on the CPU torch._grouped_mm in fp32 where the op exists; the
    padded-bmm fallback; the grouped kernel asked for directly) equals a loop over the experts."""
    torch.manual_seed(0)
    ex = GroupedExperts(E, DIM, HIDDEN)
    counts = [3, 0, 5, 0]
    x = torch.randn(sum(counts), DIM, requires_grad=True)
    g = torch.randn(sum(counts), DIM)
    if path == "grouped-fp32" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    run = {"forward": ex, "padded": ex.padded_forward,
           "grouped-fp32": lambda x, c: ex.grouped_forward(x, c, torch.float32)}[path]
    got, want = run(x, counts), _loop(x, counts, ex)
    torch.testing.assert_close(got, want)
    for a, b in zip(_grads((got * g).sum(), [x, *ex.parameters()]), _grads((want * g).sum(), [x, *ex.parameters()])):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("padded", [False, True])
def test_grouped_experts_with_no_tokens(padded):
    ex = GroupedExperts(E, DIM, HIDDEN)
    x = torch.zeros(0, DIM, requires_grad=True)
    y = ex.padded_forward(x, [0] * E) if padded else ex(x, [0] * E)
    assert y.shape == (0, DIM)
    y.sum().backward()
    for w in ex.parameters():
        assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w))
    assert x.grad.shape == (0, DIM)


@pytest.mark.parametrize("counts", [[4, 0, 7, 5], [8, 0, 16, 8]])  # groups padded to 8 rows / already aligned
def test_grouped_mm_path_matches_a_loop(counts):
    """The CUDA path's code (``torch._grouped_mm`` in bf16), run where this torch has the op on the
    CPU: values and gradients match the loop within bf16 rounding."""
    torch.manual_seed(1)
    ex = GroupedExperts(E, DIM, HIDDEN)
    x = torch.randn(sum(counts), DIM, requires_grad=True)
    try:
        got = ex.grouped_forward(x, counts)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run here: {e}")
    want = _loop(x, counts, ex)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(want)
    for a, b in zip(_grads((got.float() * g).sum(), [x, *ex.parameters()]),
                    _grads((want * g).sum(), [x, *ex.parameters()])):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


# -------------------------------------------------------------------------------------- dispatcher

def test_dispatch_then_combine_restores_tokens_and_gradients():
    torch.manual_seed(0)
    t, d = 6, 5
    x = torch.randn(t, d, requires_grad=True)
    idx = torch.tensor([[2, 0], [0, -1], [1, 2], [2, 0], [-1, -1], [0, 1]])
    routed, counts, state = LocalDispatcher(3).dispatch(x, idx)
    assert counts == [4, 2, 3]
    want_rows = [0, 1, 3, 5, 2, 5, 0, 2, 3]  # by expert, token order within one
    torch.testing.assert_close(routed, x[want_rows])
    back = LocalDispatcher(3).combine(routed, state)
    kept = (idx.reshape(-1) >= 0).float()[:, None]
    want = x.repeat_interleave(2, dim=0) * kept  # row t*k+j: token t, zero where dropped
    torch.testing.assert_close(back, want)
    g = torch.randn(t * 2, d)
    torch.testing.assert_close(_grads((back * g).sum(), [x])[0], _grads((want * g).sum(), [x])[0])


# ---------------------------------------------------------------------------------------- the layer

@pytest.mark.parametrize("score,norm,scale", [("softmax", True, 1.0), ("softmax", False, 1.0),
                                              ("sigmoid", True, 2.5), ("sigmoid", False, 1.0)])
def test_layer_matches_a_token_loop(score, norm, scale):
    layer = _layer(router_score=score, route_norm=norm, route_scale=scale)
    x = torch.randn(2, 5, DIM, requires_grad=True)
    g = torch.randn(2, 5, DIM)
    got, want = layer(x), _reference(layer, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    tensors = [x, *_params(layer)]
    for a, b in zip(_grads((got * g).sum(), tensors), _grads((want * g).sum(), tensors)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_without_shared_experts():
    layer = _layer(n_shared_experts=0)
    assert layer.shared is None
    x = torch.randn(1, 4, DIM)
    torch.testing.assert_close(layer(x), _reference(layer, x), atol=1e-5, rtol=1e-5)


def test_bias_chooses_but_does_not_weigh():
    layer = _layer(route_norm=False)
    with torch.no_grad():
        layer.router.expert_bias[3] = 100.0
    tokens = torch.randn(10, DIM)
    route = layer.router(tokens)
    assert (route.expert_idx[:, 0] == 3).all()
    scores = _scores(layer, tokens)
    torch.testing.assert_close(route.weights, scores.gather(1, route.expert_idx))
    x = tokens.view(2, 5, DIM)
    torch.testing.assert_close(layer(x), _reference(layer, x), atol=1e-5, rtol=1e-5)


def test_capacity_drops_the_later_positions():
    layer = _layer(capacity_factor=0.5)
    x = torch.randn(2, 8, DIM)
    t = 16
    capacity = math.ceil(0.5 * t * K / E)
    chosen = _choices(layer, x.reshape(-1, DIM)).reshape(-1).tolist()
    used, want_dropped = [0] * E, 0
    for e in chosen:
        used[e] += 1
        want_dropped += used[e] > capacity
    assert want_dropped > 0  # the case under test
    torch.testing.assert_close(layer(x), _reference(layer, x, capacity), atol=1e-5, rtol=1e-5)
    assert layer.step_dropped.item() == want_dropped
    assert layer.step_counts.tolist() == [float(used[e]) for e in range(E)]  # counted before dropping


# ------------------------------------------------------------------------------------- aux loss

def _aux_reference(layer: MoE, x: torch.Tensor, level: str, coef: float) -> torch.Tensor:
    b, s, d = x.shape
    tokens = x.reshape(-1, d)
    scores = _scores(layer, tokens)
    probs = scores / scores.sum(-1, keepdim=True)
    onehot = F.one_hot(_choices(layer, tokens), layer.n_experts).sum(1).float()  # (T, E)
    e, k = layer.n_experts, layer.top_k
    if level == "batch":
        return coef * ((e / (k * b * s)) * onehot.sum(0) * probs.mean(0)).sum()
    f = (e / (k * s)) * onehot.view(b, s, e).sum(1)
    return coef * (f * probs.view(b, s, e).mean(1)).sum(1).mean()


@pytest.mark.parametrize("level", ["sequence", "batch"])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_gradient_is_injected(level, score):
    coef = 0.3
    on = _layer(router_score=score, aux_loss_coef=coef, aux_loss_level=level)
    off = _layer(router_score=score)
    x = torch.randn(3, 6, DIM, requires_grad=True)
    g = torch.randn(3, 6, DIM)
    loss_ref = _aux_reference(off, x, level, coef)
    out_on = on(x)
    torch.testing.assert_close(out_on, off(x))  # the forward is unchanged
    assert on.step_aux.item() == pytest.approx(loss_ref.item(), rel=1e-5)
    want = _grads((off(x) * g).sum() + loss_ref, [x, *_params(off)])
    for a, b in zip(_grads((out_on * g).sum(), [x, *_params(on)]), want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # shares = 2 doubles only the auxiliary part
    on.step_info = MoEStepInfo(shares=2)
    want2 = _grads((off(x) * g).sum() + 2 * _aux_reference(off, x, level, coef), [off.router.gate.weight])[0]
    torch.testing.assert_close(_grads((on(x) * g).sum(), [on.router.gate.weight])[0], want2, atol=1e-5, rtol=1e-5)


def test_sequence_aux_loss_over_sharded_sequences_sums_to_the_whole():
    """Two "ranks" each hold half of every sequence; ``reduce_seq_stats`` adds the other half's
    statistics. Their injected gradients and local parts sum to the whole sequence's loss."""
    coef = 0.5
    layer = _layer(aux_loss_coef=coef)
    x = torch.randn(2, 8, DIM)
    halves = (x[:, :4], x[:, 4:])

    def stats(h: torch.Tensor) -> torch.Tensor:
        counts = F.one_hot(_choices(layer, h.reshape(-1, DIM)), E).sum(1).view(2, 4, E).sum(1).float()
        return torch.cat([counts, torch.full((2, 1), 4.0)], 1)

    other = [stats(halves[1]), stats(halves[0])]
    for h, o in zip(halves, other):
        layer.reduce_seq_stats = lambda t, o=o: t + o
        (layer(h) * 0).sum().backward()  # only the injected auxiliary gradient reaches the gate
    loss_ref = _aux_reference(layer, x, "sequence", coef)
    assert layer.step_aux.item() == pytest.approx(loss_ref.item(), rel=1e-5)  # the two local parts
    want = _grads(loss_ref, [layer.router.gate.weight])[0]
    torch.testing.assert_close(layer.router.gate.weight.grad, want, atol=1e-6, rtol=1e-5)


def test_global_rows_and_microbatches_scale_the_loss():
    x = torch.randn(2, 4, DIM)
    seq = _layer(aux_loss_coef=0.2)
    seq.step_info = MoEStepInfo(global_rows=8)
    seq(x)
    assert seq.step_aux.item() == pytest.approx(_aux_reference(seq, x, "sequence", 0.2).item() * 2 / 8, rel=1e-5)
    batch = _layer(aux_loss_coef=0.2, aux_loss_level="batch")
    set_moe_step(batch, MoEStepInfo(microbatches=4))
    batch(x)
    assert batch.step_aux.item() == pytest.approx(_aux_reference(batch, x, "batch", 0.2).item() / 4, rel=1e-5)


# ------------------------------------------------------------------------------ step statistics

def test_counts_add_over_microbatches_and_not_under_no_grad():
    layer = _layer()
    xs = [torch.randn(2, 4, DIM) for _ in range(2)]
    for x in xs:
        layer(x).sum().backward()
    want = sum(torch.bincount(_choices(layer, x.reshape(-1, DIM)).reshape(-1), minlength=E) for x in xs)
    assert layer.step_counts.tolist() == want.double().tolist()
    with torch.no_grad():  # evaluation and generation are not part of a step
        layer(xs[0])
    assert layer.step_counts.tolist() == want.double().tolist()


def test_activation_checkpointing_counts_once():
    def run(ckpt: bool) -> tuple[MoE, list[torch.Tensor]]:
        layer = _layer(aux_loss_coef=0.1, capacity_factor=0.5)
        x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(5), requires_grad=True)
        if ckpt:  # early stop off: the recompute runs the whole forward, the statistics' code included
            with set_checkpoint_early_stop(False):
                out = checkpoint(layer, x, use_reentrant=False)
        else:
            out = layer(x)
        out.pow(2).sum().backward()
        return layer, [x.grad, *(p.grad for p in layer.parameters())]

    (plain, g1), (ck, g2) = run(False), run(True)
    assert plain.step_dropped.item() > 0
    for name in ("step_counts", "step_dropped", "step_aux"):
        torch.testing.assert_close(getattr(ck, name), getattr(plain, name))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_finish_moe_step_reduces_once_updates_the_bias_and_zeroes():
    model = Llama(dataclasses.replace(PRESETS["moe-test"], bias_update_rate=0.01))
    layers = moe_layers(model)
    assert [n for n, _ in layers] == ["layers.1.mlp", "layers.2.mlp", "layers.3.mlp"]
    counts = torch.tensor([5.0, 1.0, 3.0, 3.0, 0.0, 4.0, 2.0, 6.0], dtype=torch.float64)  # mean 3
    for i, (_, layer) in enumerate(layers):
        layer.step_counts = counts + i
        layer.step_dropped = torch.tensor(float(i), dtype=torch.float64)
        layer.step_aux = torch.tensor(0.5 * i, dtype=torch.float64)
    calls = []

    def reduce(t: torch.Tensor) -> torch.Tensor:  # two identical ranks
        calls.append((t.dtype, tuple(t.shape)))
        return t * 2

    stats = finish_moe_step(model, reduce)
    assert calls == [(torch.float64, (3, 10))]
    assert stats.names == [n for n, _ in layers]
    torch.testing.assert_close(stats.counts[1], (counts + 1) * 2)
    torch.testing.assert_close(stats.dropped, torch.tensor([0.0, 2.0, 4.0], dtype=torch.float64))
    torch.testing.assert_close(stats.aux, torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64))
    want = 0.01 * torch.sign(counts.mean() - counts).float()  # under-loaded experts rise
    for _, layer in layers:
        torch.testing.assert_close(layer.router.expert_bias, want)
        assert layer.step_counts.abs().sum() == 0 and layer.step_dropped == 0 and layer.step_aux == 0
    assert finish_moe_step(Llama(PRESETS["test"])) is None


def test_finish_moe_step_leaves_the_bias_when_off():
    model = Llama(PRESETS["moe-test"])
    model(torch.randint(0, 256, (1, 8))).sum().backward()
    stats = finish_moe_step(model)
    assert stats.counts.sum(1).tolist() == [8.0 * 2] * 3
    assert all(layer.router.expert_bias.abs().sum() == 0 for _, layer in moe_layers(model))


def test_router_is_fp32_under_autocast():
    layer = _layer()
    x = torch.randn(2, 4, DIM)
    exact = _scores(layer, x.reshape(-1, DIM)).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        route = layer.router(x.reshape(-1, DIM))
        out = layer(x)
    assert route.scores.dtype == route.weights.dtype == torch.float32
    torch.testing.assert_close(route.scores.detach(), exact)  # bf16 logits would differ by ~1e-2
    assert out.dtype == x.dtype


# ---------------------------------------------------------------------------- config and model

@pytest.mark.parametrize("kw,field", [
    (dict(n_experts=-1), "n_experts"),
    (dict(n_experts=8, moe_top_k=9), "moe_top_k"),
    (dict(n_experts=8, moe_top_k=0), "moe_top_k"),
    (dict(n_experts=8, moe_ffn_dim=-2), "moe_ffn_dim"),
    (dict(n_experts=8, n_shared_experts=-1), "n_shared_experts"),
    (dict(n_experts=8, first_dense_layers=5), "first_dense_layers"),
    (dict(n_experts=8, router_score="relu"), "router_score"),
    (dict(n_experts=8, aux_loss_level="token"), "aux_loss_level"),
    (dict(n_experts=8, aux_loss_coef=-0.1), "aux_loss_coef"),
    (dict(n_experts=8, bias_update_rate=-1e-3), "bias_update_rate"),
    (dict(n_experts=8, route_scale=0.0), "route_scale"),
    (dict(n_experts=8, capacity_factor=-1.0), "capacity_factor"),
    (dict(n_experts=8, capacity_factor=0.0), "capacity_factor = 0.0 must be > 0"),
])
def test_config_checks_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        LlamaConfig(n_layers=4, **kw)


def test_config_checks():
    with pytest.raises(ConfigError, match=r"moe_top_k = 9 is larger than n_experts = 8; use moe_top_k <= 8"):
        LlamaConfig(n_experts=8, moe_top_k=9)
    with pytest.raises(ConfigError, match="use e.g. 1.25, or inf for dropless"):
        LlamaConfig(n_experts=8, capacity_factor=-0.5)
    LlamaConfig(n_experts=0, moe_top_k=9, router_score="x")  # a dense model ignores the MoE fields
    cfg = LlamaConfig(n_layers=4, ffn_dim=96, n_experts=4, first_dense_layers=1)
    assert cfg.expert_ffn_dim == 96 and [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


def test_blocks_and_init_by_name():
    cfg = PRESETS["moe-test"]
    model = Llama(cfg)
    assert type(model.layers["0"].mlp) is MLP and isinstance(model.layers["1"].mlp, MoE)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("layers.1.mlp.")}
    i, d = cfg.expert_ffn_dim, cfg.dim
    assert shapes == {"layers.1.mlp.router.gate.weight": (8, d), "layers.1.mlp.experts.w1": (8, i, d),
                      "layers.1.mlp.experts.w3": (8, i, d), "layers.1.mlp.experts.w2": (8, d, i),
                      "layers.1.mlp.shared.w1.weight": (i, d), "layers.1.mlp.shared.w3.weight": (i, d),
                      "layers.1.mlp.shared.w2.weight": (d, i)}
    out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    for name in ("layers.1.mlp.experts.w2", "layers.1.mlp.shared.w2.weight", "layers.0.mlp.w2.weight"):
        assert param_std(name, cfg) == out_std
    for name in ("layers.1.mlp.experts.w1", "layers.1.mlp.experts.w3", "layers.1.mlp.router.gate.weight"):
        assert param_std(name, cfg) == 0.02
    with torch.device("meta"):  # as parallelize builds it: to_empty leaves the buffers' memory as it was
        model = Llama(cfg)
    model.to_empty(device="cpu")
    for _, layer in moe_layers(model):
        layer.router.expert_bias.fill_(float("nan"))
    init_weights(model, seed=0)
    w2 = model.get_parameter("layers.1.mlp.experts.w2")
    torch.testing.assert_close(w2, full_value("layers.1.mlp.experts.w2", w2.shape, cfg, 0))
    assert abs(w2.std().item() - out_std) < 0.1 * out_std
    bias = model.layers["1"].mlp.router.expert_bias
    assert bias.dtype == torch.float32 and bias.abs().sum() == 0
    assert "layers.1.mlp.router.expert_bias" in model.state_dict()  # persistent, not a parameter
    assert "layers.1.mlp.router.expert_bias" not in dict(model.named_parameters())


def test_moe_test_preset_trains():
    model = Llama(PRESETS["moe-test"])
    init_weights(model, seed=0)
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["layers.1.mlp.router.gate.weight"].abs().sum() > 0


def test_preset_sizes_and_active_params():
    with torch.device("meta"):
        total = num_params(Llama(PRESETS["moe-200m"]))
    assert 150e6 < total < 300e6
    cfg = PRESETS["moe-200m"]
    assert active_params(cfg) < total / 2
    assert active_params(dataclasses.replace(cfg, moe_top_k=cfg.n_experts)) == total  # every expert active
    dense = PRESETS["10m"]
    assert active_params(dense) == num_params(Llama(dense))


@pytest.mark.cuda
def test_grouped_experts_on_the_gpu_take_the_grouped_kernel_and_match_a_loop():
    """On a GPU: bf16 under autocast takes torch._grouped_mm where the device has it (sm90+), else
    the padded bmm; either matches the loop within bf16 rounding, gradients included."""
    from meshtrain.models.moe import grouped_mm_dtype

    torch.manual_seed(3)
    ex = GroupedExperts(8, 64, 32).cuda()
    counts = [5, 0, 17, 3, 0, 9, 1, 12]
    x = torch.randn(sum(counts), 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = ex(x, counts)
        kernel = grouped_mm_dtype(x, 64, 32)
    want = _loop(x, counts, ex)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert kernel == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    g = torch.randn_like(want)
    tensors = [x, *ex.parameters()]
    for a, b in zip(_grads((got.float() * g).sum(), tensors), _grads((want * g).sum(), tensors)):
        torch.testing.assert_close(a, b, atol=6e-2, rtol=6e-2)
