"""The model's shape, ``LlamaConfig``, and its named presets: plain data, no torch.

Split from ``meshtrain/models/llama.py`` (which re-exports both) so that loading a training config,
whose ``[model]`` section is derived from these fields, does not import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

ROUTER_SCORES = ("softmax", "sigmoid")
"""The values of ``LlamaConfig.router_score``."""
AUX_LOSS_LEVELS = ("sequence", "batch")
"""The values of ``LlamaConfig.aux_loss_level``."""


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
    n_experts: int = 0
    """Routed experts per MoE layer (0: a dense model, every MoE field below ignored)."""
    moe_top_k: int = 2
    """Routed experts each token uses."""
    moe_ffn_dim: int = 0
    """Hidden size of one expert's SwiGLU (0: ffn_dim)."""
    n_shared_experts: int = 0
    """Shared experts every token uses, computed as one SwiGLU of width n_shared_experts *
    moe_ffn_dim (DeepSeek's form)."""
    first_dense_layers: int = 0
    """The first this many layers keep the dense MLP (DeepSeek-V3's first_k_dense_replace)."""
    router_score: str = "softmax"
    """Router scoring function: "softmax" or "sigmoid" (DeepSeek-V3)."""
    route_norm: bool = True
    """Divide each token's top-k routing weights by their sum."""
    route_scale: float = 1.0
    """Multiply the routing weights by this (DeepSeek-V3's routed_scaling_factor)."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing auxiliary loss (0: off)."""
    aux_loss_level: str = "sequence"
    """Where the auxiliary loss balances: "sequence" (per sequence, DeepSeek-V3's complementary
    sequence-wise loss) or "batch" (over the global micro-batch, Switch/GShard)."""
    bias_update_rate: float = 0.0
    """Step of DeepSeek-V3's auxiliary-loss-free balancing bias, applied once per optimizer step
    (0: off; e.g. 0.001)."""
    capacity_factor: float = math.inf
    """Expert capacity: inf (the default) is dropless; a finite value > 0 lets each expert take at
    most ceil(capacity_factor * T * moe_top_k / n_experts) of the T tokens a layer call routes, the
    later positions dropped."""

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads or self.dim % self.n_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} and divide "
                f"dim={self.dim}"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        """The MoE fields' checks; only ``n_experts >= 0`` applies to a dense model."""
        e = self.n_experts
        if e < 0:
            raise ConfigError(f"n_experts = {e} is negative; use 0 for a dense model or the number of routed experts")
        if e == 0:
            return
        if self.moe_top_k > e:
            raise ConfigError(f"moe_top_k = {self.moe_top_k} is larger than n_experts = {e}; use moe_top_k <= {e}")
        if self.moe_top_k < 1:
            raise ConfigError(f"moe_top_k = {self.moe_top_k} routes a token to no expert; use 1 <= moe_top_k <= {e}")
        if self.moe_ffn_dim < 0:
            raise ConfigError(f"moe_ffn_dim = {self.moe_ffn_dim} is negative; use 0 (ffn_dim) or an expert's "
                              f"hidden size")
        if self.n_shared_experts < 0:
            raise ConfigError(f"n_shared_experts = {self.n_shared_experts} is negative; use 0 (none) or more")
        if not 0 <= self.first_dense_layers <= self.n_layers:
            raise ConfigError(f"first_dense_layers = {self.first_dense_layers} is outside 0..n_layers = "
                              f"{self.n_layers}; use 0 <= first_dense_layers <= {self.n_layers}")
        for name, allowed in (("router_score", ROUTER_SCORES), ("aux_loss_level", AUX_LOSS_LEVELS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} = {getattr(self, name)!r} is unknown; use one of "
                                  f"{', '.join(repr(v) for v in allowed)}")
        # written as "not x >= 0" so that NaN fails too
        if not self.aux_loss_coef >= 0:
            raise ConfigError(f"aux_loss_coef = {self.aux_loss_coef} is negative; use 0 (off) or a positive weight, "
                              f"e.g. 0.001")
        if not self.bias_update_rate >= 0:
            raise ConfigError(f"bias_update_rate = {self.bias_update_rate} is negative; use 0 (off) or a positive "
                              f"step, e.g. 0.001")
        if not self.route_scale > 0:
            raise ConfigError(f"route_scale = {self.route_scale} is not positive; use a value > 0, e.g. 1.0")
        if not self.capacity_factor > 0:
            raise ConfigError(f"capacity_factor = {self.capacity_factor} must be > 0: each expert takes at most "
                              f"capacity_factor x its even share of the tokens; use e.g. 1.25, or inf for dropless")

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.dim // self.n_heads

    @property
    def expert_ffn_dim(self) -> int:
        """Hidden size of one routed expert (and the unit of the shared experts' width)."""
        return self.moe_ffn_dim or self.ffn_dim

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder block ``i`` uses the MoE layer instead of the dense MLP."""
        return self.n_experts > 0 and i >= self.first_dense_layers


PRESETS: dict[str, LlamaConfig] = {
    "test": LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=344, max_seq_len=128),
    "5m": LlamaConfig(),
    "10m": LlamaConfig(vocab_size=8192, dim=320, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=864),
    "1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                      max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    "8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      max_seq_len=8192, rope_theta=500000.0),
    # MoE: 8 routed experts (top 2) of width 32 plus one shared, layer 0 dense: 274,496 parameters, 163,904 active
    "moe-test": LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128,
                            n_experts=8, moe_top_k=2, moe_ffn_dim=32, n_shared_experts=1, first_dense_layers=1),
    # MoE: 16 routed experts (top 2) plus one shared, layer 0 dense: 204,276,224 parameters, 50,135,552 active
    # per token (llama.num_params / llama.active_params)
    "moe-200m": LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536,
                            max_seq_len=1024, n_experts=16, moe_top_k=2, moe_ffn_dim=1024, n_shared_experts=1,
                            first_dense_layers=1),
}
"""The named model sizes ``[model] preset`` picks from."""

__all__ = ["LlamaConfig", "PRESETS"]
