"""meshtrain's mixture-of-experts Llama <-> transformers MoE classes, without ``transformers``.

``hf.export_hf`` and ``hf.read_hf`` come here when the model has experts. Each meshtrain MoE config
maps to the one class that computes exactly its function (fp32; only the summation order of
the experts' outputs may differ), or is refused with ``ConfigError`` naming the fields that block it:

==========================================================  ============================
meshtrain config (the first row that fits)                  transformers class
==========================================================  ============================
sigmoid (any norm, scale, bias, shared, dense)              ``Glm4MoeForCausalLM``
softmax with a nonzero selection bias (``expert_bias``)     ``Ernie4_5_MoeForCausalLM``
softmax, route_norm, no shared experts, no dense layers     ``MixtralForCausalLM``
softmax otherwise (shared, dense layers, no route_norm)     ``Qwen2MoeForCausalLM``
==========================================================  ============================

Why each is exact (the tests check every claim):

- Attention, norms, embeddings and the dense MLP are Llama's in all four (no biases, no q/k norm,
  plain RoPE with meshtrain's theta; Glm4Moe with ``partial_rotary_factor`` 1). Mixtral, Qwen2Moe
  and Glm4Moe rotate halves, so q/k rows are permuted as for Llama (``hf.to_hf_permute``); Ernie
  4.5 rotates interleaved pairs, as meshtrain does, so its q/k are written unchanged.
- Routers: Mixtral and Qwen2Moe take the top-k of softmax(logits), Mixtral always normalising
  (so route_norm), Qwen2Moe as ``norm_topk_prob`` says; neither has a selection bias or a scale,
  so the bias must be zero and route_scale 1. Ernie 4.5 picks by softmax + ``e_score_correction_bias``
  and always divides by the sum clamped at ``moe_norm_min`` (1e-12, below any sum of top-k softmax
  scores, >= k/E). Glm4Moe is DeepSeek-V3's router: sigmoid, bias for the choice only,
  ``norm_topk_prob`` (+1e-20, as meshtrain) and ``routed_scaling_factor``; with n_group =
  topk_group = 1 its group-limited step keeps every expert.
- Shared experts: Glm4Moe and Ernie add one ungated SwiGLU of width n_shared * I, as meshtrain.
  Qwen2Moe multiplies its shared expert by sigmoid(shared_expert_gate(x)): the gate is written as
  zeros, so the factor is sigmoid(0) = 1/2 exactly, and the down projection is doubled; both
  scalings are powers of two, so the product is meshtrain's bitwise and the import's halving
  restores the weight bitwise. Without shared experts Qwen2Moe and Glm4Moe get a zero-width one
  (an exact zero). Dense layers: Qwen2Moe ``mlp_only_layers``, Ernie ``moe_layer_start_index``,
  Glm4Moe ``first_k_dense_replace``.
- Capacity and balancing (capacity_factor, aux_loss_*, bias_update_rate's step) are training
  settings: the exported model is dropless, i.e. meshtrain's with capacity_factor = inf.

On disk the experts are written one by one (``experts.{e}.gate_proj.weight``; Mixtral
``block_sparse_moe.experts.{e}.w1.weight``), the format transformers' ``save_pretrained`` writes and
4.x, 5.x and other runtimes read; the import also reads 5.x's fused ``experts.gate_up_proj``
[E, 2I, H] (gate rows first) and ``experts.down_proj`` [E, H, I].
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..config.model import LlamaConfig
from ..errors import ConfigError
from .hf import _hf_name, _meshtrain_name, check_fits, from_hf_permute, hf_config, llama_fields_from_hf, to_hf_permute

__all__ = ["CLASSES", "choose_class", "moe_hf_config", "moe_to_hf_state", "moe_export", "hf_class",
           "moe_config_from_hf", "moe_from_hf_state"]

MIXTRAL, QWEN2_MOE, ERNIE, GLM4_MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Ernie4_5_MoeForCausalLM",
                                       "Glm4MoeForCausalLM")


@dataclass(frozen=True)
class MoEClass:
    """How one transformers class names and lays out the MoE block."""

    model_type: str
    block: str
    """The MoE block's module name on disk (Mixtral: ``block_sparse_moe``, renamed ``mlp`` in memory)."""
    proj: tuple[str, str, str]
    """One expert's names of meshtrain's w1 (gate), w3 (up), w2 (down)."""
    shared: str | None
    """The shared experts' module name (None: the class has none)."""
    bias: str | None
    """The selection bias's name in the block (None: the class has none)."""
    interleaved: bool
    """RoPE on interleaved pairs, as meshtrain: q/k rows are not permuted."""


_SWIGLU = ("gate_proj", "up_proj", "down_proj")
CLASSES: dict[str, MoEClass] = {
    MIXTRAL: MoEClass("mixtral", "block_sparse_moe", ("w1", "w3", "w2"), None, None, False),
    QWEN2_MOE: MoEClass("qwen2_moe", "mlp", _SWIGLU, "shared_expert", None, False),
    ERNIE: MoEClass("ernie4_5_moe", "mlp", _SWIGLU, "shared_experts", "moe_statics.e_score_correction_bias", True),
    GLM4_MOE: MoEClass("glm4_moe", "mlp", _SWIGLU, "shared_experts", "gate.e_score_correction_bias", False),
}
"""The supported classes by architecture name."""

_MOE_PART = re.compile(r"layers\.(\d+)\.mlp\.(router\.gate\.weight|router\.expert_bias|experts\.w[123]"
                       r"|shared\.w[123]\.weight)")
"""A meshtrain MoE block's tensor: its layer and its name in the block."""
_W = ("w1", "w3", "w2")


# -- export ----------------------------------------------------------------------------------------


def _biased(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether any layer's auxiliary-loss-free selection bias is nonzero (by the weights, not by
    bias_update_rate: a run's step-0 checkpoint, still unbiased, exports like an unbiased run)."""
    return any(bool(t.any()) for n, t in tensors.items() if n.endswith("router.expert_bias"))


def choose_class(cfg: LlamaConfig, tensors: dict[str, torch.Tensor]) -> str:
    """The architecture that represents ``cfg`` (with these weights) exactly; ``ConfigError``
    naming every field that rules out all of them, and what to change."""
    blockers = []
    has_moe = any(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    if cfg.router_score == "sigmoid":
        if has_moe and cfg.n_experts < 2:  # its group step takes each group's top 2 scores
            blockers.append(f"n_experts = {cfg.n_experts}: sigmoid routing exports as {GLM4_MOE}, whose router "
                            f"needs at least 2 experts; use n_experts >= 2")
    else:
        if cfg.route_scale != 1.0:
            blockers.append(f"route_scale = {cfg.route_scale}: no transformers class scales softmax routing "
                            f"weights; use route_scale = 1.0, or router_score = \"sigmoid\" (exported as "
                            f"{GLM4_MOE}, which has routed_scaling_factor)")
        if not cfg.route_norm and _biased(tensors):
            blockers.append(f"a nonzero router.expert_bias (trained by bias_update_rate = {cfg.bias_update_rate}) "
                            f"with route_norm = false: the one softmax class with a selection bias, {ERNIE}, always "
                            f"normalises the routing weights; train with route_norm = true, or with "
                            f"bias_update_rate = 0 (the bias stays zero)")
    if blockers:
        raise ConfigError(f"this mixture-of-experts model has no exact transformers class, nothing was written: "
                          f"{'; '.join(blockers)}")
    if cfg.router_score == "sigmoid":
        return GLM4_MOE
    if _biased(tensors):
        return ERNIE
    if cfg.route_norm and not cfg.n_shared_experts and not cfg.first_dense_layers:
        return MIXTRAL
    return QWEN2_MOE


def moe_hf_config(cfg: LlamaConfig, arch: str, eos_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of class ``arch`` for ``cfg`` (the Llama keys of ``hf.hf_config``
    plus the class's MoE keys, every default that matters written out)."""
    c = {k: v for k, v in hf_config(cfg, eos_id).items() if k not in ("mlp_bias", "attention_bias")}
    e, k, i, n = cfg.n_experts, cfg.moe_top_k, cfg.expert_ffn_dim, cfg.n_layers
    c.update(architectures=[arch], model_type=CLASSES[arch].model_type, output_router_logits=False)
    if arch == MIXTRAL:  # no dense MLP: intermediate_size is the experts'
        c.update(intermediate_size=i, num_local_experts=e, num_experts_per_tok=k, sliding_window=None,
                 router_jitter_noise=0.0)
    elif arch == QWEN2_MOE:
        c.update(moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k, norm_topk_prob=cfg.route_norm,
                 shared_expert_intermediate_size=cfg.n_shared_experts * i, decoder_sparse_step=1,
                 mlp_only_layers=list(range(cfg.first_dense_layers)), qkv_bias=False, use_sliding_window=False,
                 sliding_window=None, max_window_layers=n, layer_types=["full_attention"] * n)
    elif arch == ERNIE:
        c.update(moe_intermediate_size=i, moe_num_experts=e, moe_k=k, moe_num_shared_experts=cfg.n_shared_experts,
                 moe_layer_start_index=cfg.first_dense_layers, moe_layer_end_index=n - 1, moe_layer_interval=1,
                 moe_norm_min=1e-12, use_bias=False)
    else:
        c.update(moe_intermediate_size=i, n_routed_experts=e, num_experts_per_tok=k,
                 n_shared_experts=cfg.n_shared_experts, first_k_dense_replace=cfg.first_dense_layers,
                 norm_topk_prob=cfg.route_norm, routed_scaling_factor=cfg.route_scale, n_group=1, topk_group=1,
                 partial_rotary_factor=1.0, attention_bias=False, use_qk_norm=False, num_nextn_predict_layers=0)
        c["rope_parameters"] = {**c["rope_parameters"], "partial_rotary_factor": 1.0}
    return c


def moe_to_hf_state(tensors: dict[str, torch.Tensor], cfg: LlamaConfig, arch: str) -> dict[str, torch.Tensor]:
    """meshtrain full tensors -> the state of class ``arch`` (fp32, experts one by one)."""
    c = CLASSES[arch]
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.to(torch.float32)
        m = _MOE_PART.fullmatch(name)
        if m is None:
            if cfg.tie_embeddings and name == "head.weight":
                continue
            permute = name.endswith(("attn.wq.weight", "attn.wk.weight")) and not c.interleaved
            heads = cfg.n_heads if name.endswith("wq.weight") else cfg.n_kv_heads
            out[_hf_name(name)] = to_hf_permute(t, heads) if permute else t.contiguous()
            continue
        block, part = f"model.layers.{m.group(1)}.{c.block}", m.group(2)
        if part == "router.gate.weight":
            out[f"{block}.gate.weight"] = t.contiguous()
        elif part == "router.expert_bias":
            if c.bias is not None:  # else zero (choose_class)
                out[f"{block}.{c.bias}"] = t.reshape(1, -1) if arch == ERNIE else t.contiguous()
        elif part.startswith("experts."):
            proj = c.proj[_W.index(part[-2:])]
            out.update((f"{block}.experts.{e}.{proj}.weight", t[e].contiguous()) for e in range(t.shape[0]))
        else:
            w = part.split(".")[1]
            # Qwen2-MoE halves its shared expert (sigmoid of the zero gate): doubling is exact
            out[f"{block}.{c.shared}.{c.proj[_W.index(w)]}.weight"] = t * 2 if arch == QWEN2_MOE and w == "w2" else t
    for i in filter(cfg.is_moe_layer, range(cfg.n_layers)):
        block = f"model.layers.{i}.{c.block}"
        if c.shared is not None and not cfg.n_shared_experts and arch != ERNIE:  # a zero-width shared expert
            out[f"{block}.{c.shared}.gate_proj.weight"] = torch.zeros(0, cfg.dim)
            out[f"{block}.{c.shared}.up_proj.weight"] = torch.zeros(0, cfg.dim)
            out[f"{block}.{c.shared}.down_proj.weight"] = torch.zeros(cfg.dim, 0)
        if arch == QWEN2_MOE:
            out[f"{block}.shared_expert_gate.weight"] = torch.zeros(1, cfg.dim)
        if c.bias is not None and f"{block}.{c.bias}" not in out:
            out[f"{block}.{c.bias}"] = torch.zeros((1, cfg.n_experts) if arch == ERNIE else (cfg.n_experts,))
    return out


def moe_export(cfg: LlamaConfig, tensors: dict[str, torch.Tensor],
               eos_id: int | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``config.json`` and weights of the class that represents the MoE model exactly
    (``choose_class``'s ``ConfigError`` if none does)."""
    arch = choose_class(cfg, tensors)
    return moe_hf_config(cfg, arch, eos_id), moe_to_hf_state(tensors, cfg, arch)


# -- import ----------------------------------------------------------------------------------------


def hf_class(c: dict[str, Any]) -> str | None:
    """The supported MoE architecture ``config.json`` names (by ``architectures`` or ``model_type``), else None."""
    for arch in c.get("architectures") or []:
        if arch in CLASSES:
            return arch
    return next((a for a, k in CLASSES.items() if k.model_type == c.get("model_type")), None)


def _int(c: dict[str, Any], key: str, default: int | None = None) -> int:
    v = c.get(key, default)
    if v is None:
        raise KeyError(key)
    return int(v)


def moe_config_from_hf(c: dict[str, Any], where: str = "config.json") -> LlamaConfig:
    """The ``LlamaConfig`` of a supported MoE class's ``config.json``; ``ConfigError`` naming every
    setting meshtrain's MoE layer cannot compute exactly (absent keys take transformers' defaults)."""
    arch = hf_class(c)
    n = int(c.get("num_hidden_layers", 0))
    try:
        if arch == MIXTRAL:
            i = _int(c, "intermediate_size")
            moe = dict(n_experts=_int(c, "num_local_experts", 8), moe_top_k=_int(c, "num_experts_per_tok", 2),
                       moe_ffn_dim=i)
            bad = {"sliding_window": c.get("sliding_window") is not None}
            tie = False
        elif arch == QWEN2_MOE:
            i, s = _int(c, "moe_intermediate_size", 1408), _int(c, "shared_expert_intermediate_size", 5632)
            dense = sorted(c.get("mlp_only_layers") or [])
            moe = dict(n_experts=_int(c, "num_experts", 60), moe_top_k=_int(c, "num_experts_per_tok", 4),
                       moe_ffn_dim=i, n_shared_experts=s // i, first_dense_layers=len(dense),
                       route_norm=bool(c.get("norm_topk_prob", False)))
            bad = {"qkv_bias": bool(c.get("qkv_bias", True)), "use_sliding_window": bool(c.get("use_sliding_window")),
                   f"shared_expert_intermediate_size = {s}, not a multiple of moe_intermediate_size": s % i != 0,
                   "decoder_sparse_step != 1": _int(c, "decoder_sparse_step", 1) != 1,
                   f"mlp_only_layers = {dense}, not the first layers": dense != list(range(len(dense)))}
            tie = False
        elif arch == ERNIE:
            k = _int(c, "moe_k", c.get("num_experts_per_tok", 6))
            e = _int(c, "moe_num_experts", c.get("num_experts", 64))
            start, end = _int(c, "moe_layer_start_index", 1), _int(c, "moe_layer_end_index", -1)
            norm_min = float(c.get("moe_norm_min", 1e-12))
            moe = dict(n_experts=e, moe_top_k=k, moe_ffn_dim=_int(c, "moe_intermediate_size", 1536),
                       n_shared_experts=_int(c, "moe_num_shared_experts", 2), first_dense_layers=start)
            bad = {"use_bias": bool(c.get("use_bias")),
                   "moe_layer_interval != 1": _int(c, "moe_layer_interval", 1) != 1,
                   f"moe_layer_end_index = {end} before the last layer": end not in (-1, n - 1),
                   f"moe_norm_min = {norm_min} > moe_k / moe_num_experts": norm_min > k / e}
            tie = True
        elif arch == GLM4_MOE:
            ropes = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
            partial = float(ropes.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5)))
            groups, keep = _int(c, "n_group", 1), _int(c, "topk_group", 1)
            moe = dict(n_experts=_int(c, "n_routed_experts", 128), moe_top_k=_int(c, "num_experts_per_tok", 8),
                       moe_ffn_dim=_int(c, "moe_intermediate_size", 1408), router_score="sigmoid",
                       n_shared_experts=_int(c, "n_shared_experts", 1),
                       first_dense_layers=_int(c, "first_k_dense_replace", 1),
                       route_norm=bool(c.get("norm_topk_prob", True)),
                       route_scale=float(c.get("routed_scaling_factor", 1.0)))
            bad = {f"partial_rotary_factor = {partial}": partial != 1.0,
                   "attention_bias": bool(c.get("attention_bias")), "use_qk_norm": bool(c.get("use_qk_norm")),
                   f"group-limited routing (topk_group = {keep} < n_group = {groups})": keep < groups}
            tie = False
        else:
            raise ConfigError(f"{where}: not one of the MoE classes {', '.join(CLASSES)}")
    except KeyError as e:
        raise ConfigError(f"{where} has no {e.args[0]!r}; it is not a complete {arch} config") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: bad {arch} MoE settings: {e}") from None
    if arch == MIXTRAL:
        moe["ffn_dim"] = moe["moe_ffn_dim"]  # no dense MLP: the experts' width stands for it
    return llama_fields_from_hf(c, where, bad, tie, **moe)


def _canonical(part: str, c: MoEClass) -> str:
    """An MoE block tensor's name with Mixtral's w1/w3/w2 as gate/up/down_proj and Ernie 5.x's
    ``gate.moe_statics`` as ``moe_statics``."""
    m = re.fullmatch(r"experts\.(\d+)\.(\w+)\.weight", part)
    if m and m.group(2) in c.proj:
        return f"experts.{m.group(1)}.{_SWIGLU[c.proj.index(m.group(2))]}.weight"
    return part.replace("gate.moe_statics.", "moe_statics.")


def moe_from_hf_state(state: dict[str, torch.Tensor], cfg: LlamaConfig, arch: str) -> dict[str, torch.Tensor]:
    """The state of class ``arch`` (experts one by one or fused) -> meshtrain full fp32 tensors,
    checked against ``cfg``'s parameters and routing bias; ``ConfigError`` for a tensor meshtrain
    cannot represent (e.g. a nonzero Qwen2-MoE shared-expert gate)."""
    c = CLASSES[arch]
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for hf, t in state.items():
        t = t.to(torch.float32)
        m = re.fullmatch(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.(.+)", hf)
        if m is None or not cfg.is_moe_layer(int(m.group(1))):  # attention, norms, dense MLPs: Llama's
            name = _meshtrain_name(hf)
            if name is not None:
                permute = name.endswith(("attn.wq.weight", "attn.wk.weight")) and not c.interleaved
                heads = cfg.n_heads if name.endswith("wq.weight") else cfg.n_kv_heads
                out[name] = from_hf_permute(t, heads) if permute else t.contiguous()
            continue
        base, part = f"layers.{m.group(1)}.mlp", _canonical(m.group(2), c)
        em = re.fullmatch(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", part)
        sm = re.fullmatch(rf"{c.shared}\.(gate_proj|up_proj|down_proj)\.weight", part) if c.shared else None
        if part == "gate.weight":
            out[f"{base}.router.gate.weight"] = t.contiguous()
        elif c.bias is not None and part == c.bias:
            out[f"{base}.router.expert_bias"] = t.reshape(-1).contiguous()
        elif em:
            experts.setdefault((base, _W[_SWIGLU.index(em.group(2))]), {})[int(em.group(1))] = t
        elif part == "experts.gate_up_proj":  # transformers 5.x fused: gate rows, then up rows
            out[f"{base}.experts.w1"], out[f"{base}.experts.w3"] = (h.contiguous() for h in t.chunk(2, dim=1))
        elif part == "experts.down_proj":
            out[f"{base}.experts.w2"] = t.contiguous()
        elif sm:
            w = _W[_SWIGLU.index(sm.group(1))]
            if t.numel():  # a zero-width shared expert is none
                out[f"{base}.shared.{w}.weight"] = t / 2 if arch == QWEN2_MOE and w == "w2" else t.contiguous()
        elif arch == QWEN2_MOE and part == "shared_expert_gate.weight":
            if cfg.n_shared_experts and bool(t.any()):
                raise ConfigError(f"Hugging Face tensor {hf} is not zero: meshtrain's shared experts are not gated, so "
                                  f"only a Qwen2-MoE whose shared_expert_gate is zero (as meshtrain exports) can be "
                                  f"imported")
        else:
            raise ConfigError(f"Hugging Face tensor {hf!r} is not part of a {arch} that meshtrain can represent")
    for (base, w), by_expert in experts.items():
        if sorted(by_expert) != list(range(cfg.n_experts)):
            raise ConfigError(f"the Hugging Face weights of {base.replace('layers.', 'model.layers.')} hold experts "
                              f"{sorted(by_expert)[:8]} for {w}, not 0..{cfg.n_experts - 1}")
        out[f"{base}.experts.{w}"] = torch.stack([by_expert[e] for e in range(cfg.n_experts)])
    if c.bias is None:  # no selection bias in the class: meshtrain's is zero
        for i in range(cfg.n_layers):
            if cfg.is_moe_layer(i):
                out[f"layers.{i}.mlp.router.expert_bias"] = torch.zeros(cfg.n_experts)
    check_fits(out, cfg, lambda n: n)
    return out
