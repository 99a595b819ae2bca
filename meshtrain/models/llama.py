"""A Llama-style decoder that knows nothing about parallelism.

Token embedding, RMSNorm, rotary position embeddings, grouped-query attention through
``scaled_dot_product_attention``, SwiGLU MLP, and an untied or tied output head. Sizes come from
``LlamaConfig``, with named presets in ``PRESETS``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    """Model shape."""

    vocab_size: int = 4096
    """Number of token ids."""
    dim: int = 256
    """Hidden size."""
    n_layers: int = 4
    """Number of decoder blocks."""
    n_heads: int = 4
    """Attention heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``n_heads``."""
    ffn_dim: int = 688
    """Hidden size of the SwiGLU MLP."""
    max_seq_len: int = 512
    """Longest sequence the rotary table covers."""
    rope_theta: float = 10000.0
    """Rotary base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output head."""

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads or self.dim % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} and divide "
                f"dim={self.dim}"
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.dim // self.n_heads


PRESETS: dict[str, LlamaConfig] = {
    "test": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, max_seq_len=128),
    "5m": LlamaConfig(),
    "10m": LlamaConfig(vocab_size=8192, dim=320, n_layers=6, n_heads=5, n_kv_heads=5, ffn_dim=864),
    "1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                      max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    "8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      max_seq_len=8192, rope_theta=500000.0),
}


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise in fp32, return in the input dtype."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


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


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary embeddings."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, dim)."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.hd).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq, dim)."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """The decoder: ``forward(tokens) -> logits`` for tokens of shape (batch, seq)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab); ``positions`` are the tokens' global positions (default 0..s-1)."""
        s = tokens.shape[1]
        if s > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len={self.cfg.max_seq_len}")
        if positions is None:
            positions = torch.arange(s, device=tokens.device)
        cos, sin = rotary_table(self.cfg.head_dim, positions, self.cfg.rope_theta)
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def init_weights(model: Llama, seed: int = 0) -> None:
    """Normal(0, 0.02) for matrices and embeddings (output projections scaled by 1/sqrt(2L)), ones
    for norms, from one generator: the same seed gives the same weights."""
    g = torch.Generator().manual_seed(seed)
    std_out = 0.02 / (2 * model.cfg.n_layers) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = std_out if name.endswith(("wo.weight", "w2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)


def num_params(model: nn.Module) -> int:
    """Number of distinct parameters' elements."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
