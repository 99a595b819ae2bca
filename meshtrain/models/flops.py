"""Model arithmetic behind MFU: the training FLOPs per token of a Llama-style model, shared by the
trainer's MFU and the planner's (``plan.compute.model_flops_per_token``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.model import LlamaConfig


def flops_per_token(cfg: LlamaConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls with parameters (N without the input
    embedding, which is a lookup) plus 12·L·H·S for attention (PaLM's formula, H = model width,
    S = sequence length)."""
    return 6.0 * n_params + 12.0 * cfg.n_layers * cfg.dim * seq_len
