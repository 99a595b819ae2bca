"""A Llama-style decoder that knows nothing about parallelism.

Token embedding, RMSNorm, rotary position embeddings, grouped-query attention through
``scaled_dot_product_attention``, SwiGLU MLP (or, in the layers ``LlamaConfig.is_moe_layer`` names,
the mixture-of-experts layer of ``moe.py``), and an untied or tied output head. Sizes come from
``LlamaConfig``, with named presets in ``PRESETS``.

Parallelism is applied from outside (``meshtrain.parallel.parallelize``), which needs three things
from the model and nothing more: blocks live in a ``ModuleDict`` keyed by their layer index (a
pipeline stage deletes the others and every parameter keeps its full-model name); ``tok_emb``,
``norm`` and ``head`` may be ``None`` (the stage then takes or returns hidden states); and the
attention kernel is an attribute (``Attention.attention_fn``) that context parallelism replaces.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from ..config.model import PRESETS, LlamaConfig  # noqa: F401 (moved; re-exported)
from ..placement import placement_of
from .moe import MoE, moe_layers


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x), computed in fp32, returned in the input dtype (no scale)."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised input times the learned scale."""
        return self.normalize(x) * self.weight


def rotary_table(head_dim: int, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles for the given (global) token positions: (seq, head_dim/2)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    ang = positions.float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of ``x`` (batch, heads, seq, head_dim)."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal ``scaled_dot_product_attention``; k/v heads are repeated for grouped-query attention.
    q: (batch, heads, seq, head_dim); k, v: (batch, kv_heads, seq, head_dim)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary embeddings. The heads a rank holds follow
    from the projections' output sizes, so tensor parallelism only has to shard the linears."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.hd = cfg.head_dim
        self.attention_fn = causal_attention
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, dim)."""
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s = q.shape[:2]  # a projection may gather a sequence-parallel input: take its length
        q, k, v = (t.view(b, s, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = self.attention_fn(q, k, v)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x), of width ``hidden`` (default ``cfg.ffn_dim``;
    the MoE layer's shared experts are one of these)."""

    def __init__(self, cfg: LlamaConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = cfg.ffn_dim if hidden is None else hidden
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)); ``mlp`` is the MoE layer
    where ``cfg.is_moe_layer(layer)``."""

    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp: nn.Module = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, dim)."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """The decoder: ``forward(tokens) -> logits`` for tokens of shape (batch, seq).

    A pipeline stage is a ``Llama`` with some of these removed: without ``tok_emb`` it takes hidden
    states (batch, seq, dim) instead of tokens; without ``head`` it returns hidden states.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab); ``positions`` are the tokens' global positions (default
        0..s-1; context parallelism passes the positions of this rank's share)."""
        if positions is None:  # checked on the host; given positions are the caller's to check (reading
            # their maximum would be a device sync per forward)
            if tokens.shape[1] > self.cfg.max_seq_len:
                raise ValueError(f"position {tokens.shape[1] - 1} exceeds max_seq_len={self.cfg.max_seq_len}; "
                                 f"use shorter sequences or raise model.max_seq_len")
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rotary_table(self.cfg.head_dim, positions, self.cfg.rope_theta)
        x = self.tok_emb(tokens) if self.tok_emb is not None else tokens
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x


def param_std(name: str, cfg: LlamaConfig) -> float | None:
    """The init std of a parameter by its full-model name (None: a norm scale, set to one).
    Output projections (attention's wo; w2 of the dense MLP, the shared experts and the routed
    experts, whose stacked weight has no ".weight") are scaled by 1/sqrt(2L) as in GPT-2."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        return 0.02 / (2 * cfg.n_layers) ** 0.5
    return 0.02


def full_value(name: str, shape: torch.Size | tuple[int, ...], cfg: LlamaConfig, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``: it depends only on the seed and
    the name, so every layout (and every pipeline stage) starts from the same weights."""
    std = param_std(name, cfg)
    if std is None:
        return torch.ones(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    return torch.randn(shape, generator=g) * std


def init_weights(model: Llama, seed: int = 0) -> None:
    """Initialise every parameter from ``full_value(name)``. A parameter split over the mesh
    carries a ``placement`` (``meshtrain.placement``: its global shape and this rank's box) and
    receives its slice of the global value. Buffers are not initialised by name; the one that is
    state, each MoE layer's ``expert_bias``, is set to its starting zero (after ``to_empty`` it
    would hold whatever the memory held)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            placement = placement_of(p)
            p.copy_(placement.local(full_value(name, placement.global_shape, model.cfg, seed)))
        for _, layer in moe_layers(model):
            layer.router.expert_bias.zero_()


def num_params(model: nn.Module) -> int:
    """Number of distinct parameters' elements."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def active_params(cfg: LlamaConfig) -> int:
    """Parameters one token uses: every dense parameter (the input embedding included, as
    ``num_params`` counts it), and per MoE layer the router, the shared experts and ``moe_top_k``
    of the routed experts. Counted on a meta-device model, so any size is free."""
    with torch.device("meta"):
        total = num_params(Llama(cfg))
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    unused = cfg.n_experts - cfg.moe_top_k if cfg.n_experts else 0
    return total - moe * unused * 3 * cfg.dim * cfg.expert_ffn_dim
