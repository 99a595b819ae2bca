"""Model shapes the planner knows: meshtrain's own presets plus published architectures
(Llama 3.1 8B / 70B / 405B, GPT-3 175B, and the mixtures of experts Qwen3-30B-A3B and DeepSeek-V3)
that meshtrain's presets lack, or a JSON file.

Only shapes live here; nothing is fitted per run. Parameter counts are computed from the shape, so
``Arch.params`` of ``llama3-8b`` is the 8.03 B of the model card, which the tests check by hand (and
``params`` / ``active_params`` of the MoE models their model cards' total and active counts).
"""

from __future__ import annotations

import difflib
import math
import json
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import ConfigError
from ..models.llama import PRESETS, LlamaConfig


@dataclass(frozen=True)
class Mla:
    """DeepSeek's multi-head latent attention (arXiv 2405.04434): queries and keys/values go through
    low-rank latents (``q_lora_rank``, ``kv_lora_rank``); each head's query/key is ``qk_nope_dim``
    wide plus a shared rotary part of ``qk_rope_dim``, its value ``v_head_dim``."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int


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
    head_size: int = 0
    """Width of one attention head; 0: dim / n_heads (Qwen3-30B-A3B has 32 heads of 128 at dim 2048)."""
    n_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    moe_top_k: int = 0
    """Routed experts each token uses."""
    moe_ffn_dim: int = 0
    """Hidden size of one routed expert's SwiGLU (0: ffn_dim)."""
    n_shared_experts: int = 0
    """Shared experts every token uses: one SwiGLU of width n_shared_experts x moe_ffn_dim."""
    first_dense_layers: int = 0
    """The first this many layers keep the dense MLP of width ffn_dim."""
    capacity_factor: float = math.inf
    """inf: dropless (meshtrain's default); else an expert takes at most capacity_factor x its even
    share of the tokens."""
    mla: Mla | None = None
    """Multi-head latent attention (DeepSeek-V3) instead of grouped-query attention."""
    norm: str = "rmsnorm"
    """"rmsnorm" (Llama: eager PyTorch runs it as a composite of fp32 kernels) or "layernorm" (GPT,
    MPT: ``F.layer_norm``, one fused kernel even eagerly): what ``torch.compile`` can save (compute.py)."""
    rotary: bool = True
    """Rotary position embeddings on q and k (Llama); False for learned or ALiBi positions (GPT, MPT)."""

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.n_experts > 0

    @property
    def head_dim(self) -> int:
        """Size of one attention head (query/key width per head under MLA)."""
        if self.mla is not None:
            return self.mla.qk_nope_dim + self.mla.qk_rope_dim
        return self.head_size or self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (or V) projection: n_kv_heads * head_dim (grouped-query attention); under
        MLA the mean of the per-head K and V widths over all heads (what ring attention passes on)."""
        if self.mla is not None:
            return self.n_heads * (self.head_dim + self.mla.v_head_dim) // 2
        return self.n_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        """Width of the queries (and, but for MLA, of the attention output): n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def o_dim(self) -> int:
        """Width of the attention output (the values of all heads) that the output projection reads."""
        return self.n_heads * (self.mla.v_head_dim if self.mla is not None else self.head_dim)

    @property
    def expert_ffn(self) -> int:
        """Hidden size of one routed expert (and the unit of the shared experts' width)."""
        return self.moe_ffn_dim or self.ffn_dim

    @property
    def shared_ffn(self) -> int:
        """Width of the shared experts' SwiGLU (0 without shared experts)."""
        return self.n_shared_experts * self.expert_ffn

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the MoE layer."""
        return self.n_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def dense_layers(self) -> int:
        """Layers with the dense MLP."""
        return self.n_layers - self.moe_layers

    def attention_params(self) -> int:
        """Weights of one block's attention projections."""
        if self.mla is not None:
            m = self.mla
            q = self.dim * m.q_lora_rank + m.q_lora_rank * self.q_dim
            kv = self.dim * (m.kv_lora_rank + m.qk_rope_dim) + m.kv_lora_rank * self.n_heads * (m.qk_nope_dim +
                                                                                               m.v_head_dim)
            return q + kv + self.o_dim * self.dim
        return self.dim * self.q_dim + 2 * self.dim * self.kv_dim + self.o_dim * self.dim

    def norm_params(self) -> int:
        """One block's norm scales: the two RMSNorms (and MLA's two latent norms)."""
        return 2 * self.dim + (self.mla.q_lora_rank + self.mla.kv_lora_rank if self.mla is not None else 0)

    def expert_params(self) -> int:
        """One routed expert: a SwiGLU of width ``expert_ffn``."""
        return 3 * self.dim * self.expert_ffn

    def routed_params_per_layer(self) -> int:
        """All routed experts of one MoE layer: the weights expert parallelism splits over ep."""
        return self.n_experts * self.expert_params()

    def matmul_params_per_layer(self, moe: bool = False) -> int:
        """Weights of one block's matrix multiplies: attention, and the dense MLP (two or three
        matrices) or, for a MoE layer, the router, the shared experts and every routed expert."""
        if moe:
            return self.attention_params() + self.dim * self.n_experts + 3 * self.dim * self.shared_ffn + \
                self.routed_params_per_layer()
        return self.attention_params() + (3 if self.gated_mlp else 2) * self.dim * self.ffn_dim

    def active_matmul_params_per_layer(self, moe: bool = False) -> float:
        """Weights one token multiplies by in a block: for a MoE layer, only ``moe_top_k`` routed
        experts (times the capacity factor when it drops tokens)."""
        if not moe:
            return self.matmul_params_per_layer()
        return (self.matmul_params_per_layer(True) - self.routed_params_per_layer()
                + self.moe_top_k * self.routed_share() * self.expert_params())

    def routed_share(self) -> float:
        """Fraction of the routed (token, expert) pairs an expert computes: 1 dropless (balanced
        routing); capacity_factor below 1 drops the rest."""
        return min(self.capacity_factor, 1.0)

    def params_per_layer(self, moe: bool = False) -> int:
        """All of one block's parameters (its matrices plus norm scales)."""
        return self.matmul_params_per_layer(moe) + self.norm_params()

    def embedding_params(self) -> int:
        """Input embedding table (a lookup: no FLOPs)."""
        return self.vocab_size * self.dim

    def head_params(self) -> int:
        """Output head (0 when tied to the embedding) plus the final norm."""
        return (0 if self.tie_embeddings else self.vocab_size * self.dim) + self.dim

    def params(self) -> int:
        """Total parameter count N."""
        blocks = self.dense_layers * self.params_per_layer() + self.moe_layers * self.params_per_layer(True)
        return blocks + self.embedding_params() + self.head_params()

    def active_params(self) -> float:
        """Parameters one token uses (a MoE layer's top-k routed experts only); N for a dense model."""
        routed = self.moe_layers * (self.routed_params_per_layer() - self.moe_top_k * self.expert_params())
        return self.params() - routed

    def flop_params(self) -> float:
        """Parameters that take part in a token's matrix multiplies: the active parameters without
        the input embedding (the convention of meshtrain's ``flops_per_token``, of torchtitan and of
        PaLM; MoE models count active parameters, as Megatron's and DeepSeek's MFU do)."""
        return self.active_params() - (0 if self.tie_embeddings else self.embedding_params())


# Published shapes (the models' configuration files / papers); vocabularies as released.
ARCHS: dict[str, Arch] = {
    "llama3-8b": Arch("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": Arch("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama3-405b": Arch("llama3-405b", 126, 16384, 128, 8, 53248, 128256),
    # GPT-3 175B (Brown et al. 2020): 96 layers, d=12288, 96 heads, 4d MLP; Megatron's strong-scaling
    # run uses a larger vocabulary ("slightly more than 175 billion parameters"), 131072 here.
    "gpt-175b": Arch("gpt-175b", 96, 12288, 96, 96, 4 * 12288, 131072, gated_mlp=False, norm="layernorm",
                     rotary=False),
    # Qwen3-30B-A3B (its config.json on the Hugging Face hub): 48 layers, hidden 2048, 32 query heads
    # of head_dim 128 (q is 4096 wide), 4 kv heads, 128 experts, top-8, moe_intermediate_size 768,
    # no shared experts, vocabulary 151936, untied head. (Its q/k RMSNorms, 256 scales a layer, are
    # left out.) 30.5 B total, 3.3 B active per the model card.
    "qwen3-30b-a3b": Arch("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, head_size=128, n_experts=128,
                          moe_top_k=8, moe_ffn_dim=768),
    # Qwen3-235B-A22B (its config.json; the same shape in Megatron arguments, THUDM/slime
    # scripts/models/qwen3-235B-A22B.sh): 94 layers, all MoE, hidden 4096, 64 query heads and 4 kv
    # heads of 128, 128 experts, top-8, moe_intermediate_size 1536, vocabulary 151936, untied head.
    "qwen3-235b-a22b": Arch("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 151936, head_size=128, n_experts=128,
                            moe_top_k=8, moe_ffn_dim=1536),
    # DeepSeek-V3 (arXiv 2412.19437 and its config.json): 61 layers, hidden 7168, the first 3 dense
    # (intermediate 18432), then 256 routed experts (top-8, moe_intermediate 2048) + 1 shared; MLA
    # with 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128;
    # vocabulary 129280. 671 B total, 37 B active (the multi-token-prediction module, 14 B, is not
    # part of either count nor of this shape).
    "deepseek-v3": Arch("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, n_experts=256, moe_top_k=8,
                        moe_ffn_dim=2048, n_shared_experts=1, first_dense_layers=3,
                        mla=Mla(q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128)),
}


# MosaicML's MPT models as llm-foundry benchmarked them (scripts/train/yamls/pretrain/mpt-*.yaml of
# github.com/mosaicml/llm-foundry: d_model, n_heads, n_layers, expansion_ratio 4, vocab_size 50368):
# GPT-style blocks (LayerNorm, a 4x GELU MLP, multi-head attention) with the embedding tied to the
# output head. The benchmark table's NumParams also counts biases and a learned position table (it
# grows by d_model per token of max_seq_len), left out here: under 0.4% of the parameters.
MPT_SHAPES = {"mpt-1b": (24, 2048, 16), "mpt-3b": (32, 2560, 20), "mpt-7b": (32, 4096, 32),
              "mpt-13b": (40, 5120, 40), "mpt-30b": (48, 7168, 56), "mpt-70b": (80, 8192, 64)}
ARCHS.update({name: Arch(name, layers, dim, heads, heads, 4 * dim, 50368, gated_mlp=False, tie_embeddings=True,
                         norm="layernorm", rotary=False) for name, (layers, dim, heads) in MPT_SHAPES.items()})

# Megatron-LM's weak-scaling GPT models (its README of April 2021, the table images/cases_april2021.png,
# commit b83477a3e8: hidden size and layers; heads from the paper's Table 1, arXiv 2104.04473):
# GPT-2-style blocks, vocabulary 51,200, the word embedding tied to the output head. Under a pipeline
# Megatron keeps the tied table's copy on the last stage (its gradient all-reduced with the first's):
# those models (39B on) are priced untied, which is what each stage holds and computes.
MEGATRON_2021_SHAPES = {"1.7b": (24, 2304, 24), "3.6b": (30, 3072, 32), "7.5b": (36, 4096, 32),
                        "18b": (40, 6144, 48), "39b": (48, 8192, 64), "76b": (60, 10240, 80),
                        "145b": (80, 12288, 96), "310b": (96, 16384, 128), "530b": (105, 20480, 128),
                        "1t": (128, 25600, 160)}
UNPIPELINED = ("1.7b", "3.6b", "7.5b", "18b")
"""The models the table runs without a pipeline: their head stays tied."""
ARCHS.update({f"megatron-2021-gpt-{size}": Arch(f"megatron-2021-gpt-{size}", layers, dim, heads, heads, 4 * dim, 51200,
                                           gated_mlp=False, tie_embeddings=size in UNPIPELINED, norm="layernorm",
                                           rotary=False)
              for size, (layers, dim, heads) in MEGATRON_2021_SHAPES.items()})

# Megatron-LM's H100 weak-scaling GPT models (its README of July 2024, the table images/model_table.png,
# commit 937571cfd4: heads, hidden size and layers; vocabulary 131,072): GPT blocks with the output
# head untied, as the table's sizes count it (1.7B = 24 x 12 x 2048^2 + 2 x 131072 x 2048). The 177B
# row is ``gpt-175b``.
MEGATRON_2024_SHAPES = {"1.7b": (24, 2048, 16), "7.1b": (30, 4096, 32), "16b": (32, 6144, 48),
                        "32b": (48, 7168, 56), "70b": (84, 8192, 64), "119b": (92, 10240, 80),
                        "314b": (96, 16384, 128), "462b": (112, 18432, 144)}
ARCHS.update({f"megatron-2024-gpt-{size}": Arch(f"megatron-2024-gpt-{size}", layers, dim, heads, heads, 4 * dim,
                                                131072, gated_mlp=False, norm="layernorm", rotary=False)
              for size, (layers, dim, heads) in MEGATRON_2024_SHAPES.items()})


def from_llama_config(name: str, cfg: LlamaConfig) -> Arch:
    """The shape of a meshtrain ``LlamaConfig``."""
    # the MoE fields are read with defaults, so a LlamaConfig without them is a dense model
    n_experts = int(getattr(cfg, "n_experts", 0) or 0)
    moe = {"n_experts": n_experts, "moe_top_k": int(getattr(cfg, "moe_top_k", 0) or 0),
           "moe_ffn_dim": int(getattr(cfg, "moe_ffn_dim", 0) or 0),
           "n_shared_experts": int(getattr(cfg, "n_shared_experts", 0) or 0),
           "first_dense_layers": int(getattr(cfg, "first_dense_layers", 0) or 0),
           "capacity_factor": float(getattr(cfg, "capacity_factor", math.inf))} if n_experts else {}
    return Arch(name, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size,
                True, cfg.tie_embeddings, **moe)


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
