"""The model's shape, ``LlamaConfig``, and its named presets: plain data, no torch.

Split from ``meshtrain/models/llama.py`` (which re-exports both) so that loading a training config,
whose ``[model]`` section is derived from these fields, does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    "test": LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=344, max_seq_len=128),
    "5m": LlamaConfig(),
    "10m": LlamaConfig(vocab_size=8192, dim=320, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=864),
    "1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                      max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    "8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      max_seq_len=8192, rope_theta=500000.0),
}
"""The named model sizes ``[model] preset`` picks from."""

__all__ = ["LlamaConfig", "PRESETS"]
