"""Model shapes the planner knows: meshtrain's own presets plus published architectures
(Llama 3.1 8B / 70B / 405B, GPT-3 175B) that meshtrain's presets lack, or a JSON file.

Only shapes live here; nothing is fitted per run. Parameter counts are computed from the shape, so
``Arch.params`` of ``llama3-8b`` is the 8.03 B of the model card, which the tests check by hand.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import ConfigError
from ..models.llama import PRESETS, LlamaConfig


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer's shape: what compute, memory and communication depend on."""

    name: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    gated_mlp: bool = True
    """SwiGLU (three ffn matrices, Llama) or a plain two-matrix MLP (GELU, GPT-3)."""
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (or V) projection: n_kv_heads * head_dim (grouped-query attention)."""
        return self.n_kv_heads * self.head_dim

    def matmul_params_per_layer(self) -> int:
        """Weights of one block's matrix multiplies: q, k, v, o and the MLP's two or three matrices."""
        attn = 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim
        mlp = (3 if self.gated_mlp else 2) * self.dim * self.ffn_dim
        return attn + mlp

    def params_per_layer(self) -> int:
        """All of one block's parameters (its matrices plus two norm scales)."""
        return self.matmul_params_per_layer() + 2 * self.dim

    def embedding_params(self) -> int:
        """Input embedding table (a lookup: no FLOPs)."""
        return self.vocab_size * self.dim

    def head_params(self) -> int:
        """Output head (0 when tied to the embedding) plus the final norm."""
        return (0 if self.tie_embeddings else self.vocab_size * self.dim) + self.dim

    def params(self) -> int:
        """Total parameter count N."""
        return self.n_layers * self.params_per_layer() + self.embedding_params() + self.head_params()

    def flop_params(self) -> int:
        """Parameters that take part in matrix multiplies: N without the input embedding (the
        convention of meshtrain's ``flops_per_token``, of torchtitan and of PaLM)."""
        return self.params() - (0 if self.tie_embeddings else self.embedding_params())


# Published shapes (the models' configuration files / papers); vocabularies as released.
ARCHS: dict[str, Arch] = {
    "llama3-8b": Arch("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": Arch("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama3-405b": Arch("llama3-405b", 126, 16384, 128, 8, 53248, 128256),
    # GPT-3 175B (Brown et al. 2020): 96 layers, d=12288, 96 heads, 4d MLP; Megatron's strong-scaling
    # run uses a larger vocabulary ("slightly more than 175 billion parameters"), 131072 here.
    "gpt-175b": Arch("gpt-175b", 96, 12288, 96, 96, 4 * 12288, 131072, gated_mlp=False),
}


def from_llama_config(name: str, cfg: LlamaConfig) -> Arch:
    """The shape of a meshtrain ``LlamaConfig``."""
    return Arch(name, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size,
                True, cfg.tie_embeddings)


def known_models() -> list[str]:
    """Every model name ``resolve_model`` accepts besides a JSON path."""
    return sorted(set(ARCHS) | set(PRESETS))


def resolve_model(spec: str) -> Arch:
    """A model by name (meshtrain preset or published architecture) or a JSON file of
    ``LlamaConfig`` fields; raises ConfigError naming the nearest known model."""
    if spec in ARCHS:
        return ARCHS[spec]
    if spec in PRESETS:
        return from_llama_config(spec, PRESETS[spec])
    path = Path(spec)
    if spec.endswith(".json") or path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--model {spec}: cannot read a JSON model config ({e})") from e
        allowed = {f.name for f in fields(LlamaConfig)}
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise ConfigError(f"--model {spec}: unknown keys {unknown}; use LlamaConfig fields "
                              f"{sorted(allowed)}")
        try:
            return from_llama_config(path.stem, LlamaConfig(**raw))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--model {spec}: {e}") from e
    near = difflib.get_close_matches(spec, known_models(), n=1, cutoff=0.0)
    raise ConfigError(f"--model {spec!r} is not a known model or a JSON file; nearest: {near[0]!r} "
                      f"(known: {', '.join(known_models())})")
