"""How a model is parallelised, ``ParallelConfig``, with the checks on its values: plain data, no torch.

Split from ``meshtrain/parallel/parallelize.py`` (which re-exports everything here) so that the
training config, whose ``[parallel]`` section inherits these fields, loads without torch, and so
that each rule on these values is written once: ``ParallelConfig`` runs them when it is built, and
the config check runs the same ones naming the config keys (``check_tensor_parallel`` too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..errors import ConfigError

if TYPE_CHECKING:
    from .model import LlamaConfig

AC_MODES = ("none", "full", "selective")
"""The values of ``ParallelConfig.activation_checkpointing``."""
PRECISIONS = ("fp32", "bf16", "fp16")
"""The values of ``ParallelConfig.precision``."""
OFFLOAD_MODES = ("none", "optimizer", "params")
"""The values of ``ParallelConfig.offload``."""


@dataclass
class ParallelConfig:
    """How a model is parallelised; the degrees themselves come from the ``Mesh``."""

    sequence_parallel: bool = False
    """Split the residual stream along the sequence over tp around the norms (needs tp > 1)."""
    activation_checkpointing: str = "none"
    """"none", "full" (every block recomputes its forward in backward) or "selective"."""
    checkpoint_every: int = 2
    """With "selective", checkpoint the blocks whose layer index is a multiple of this."""
    zero_stage: int = 0
    """0: data parallel (all-reduce in buckets); 1, 2, 3: ZeRO over the dp x cp group."""
    schedule: str = "1f1b"
    """Pipeline schedule: "afab", "1f1b" or "interleaved"."""
    microbatches: int = 1
    """Micro-batches per step (per data-parallel rank); 1F1B needs at least pp."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule)."""
    bucket_cap_mb: float | str = "auto"
    """Gradient bucket size in MiB of data parallelism and ZeRO-1/2, or "auto": sized at start-up from
    the measured link (the smallest bucket whose latency is under 5% of its transfer time, at most a
    quarter of the gradients so that backward overlaps; ``meshtrain/parallel/bucket_size.py``), logged."""
    precision: str = "fp32"
    """"fp32", "bf16" or "fp16": forwards under ``torch.autocast`` to that dtype; parameters,
    gradients, their reductions and the optimizer stay fp32 (fp32 masters). fp16 needs loss
    scaling, which the trainer runs (``DynamicLossScaler``); a loop of one's own must too."""
    compile: bool = False
    """Compile each transformer block with ``torch.compile`` (after TP, CP and activation
    checkpointing are applied, before data parallel / ZeRO wrap the model)."""
    offload: str = "none"
    """ZeRO CPU offload: "none"; "optimizer" (the fp32 master shards and the optimizer state live in
    host memory and the optimizer steps on the CPU; needs zero_stage >= 1); "params" (also ZeRO-3's
    parameter shards, copied to the device for each all-gather; needs zero_stage = 3)."""

    def __post_init__(self) -> None:
        check_parallel_values(vars(self))


def _same(name: str) -> str:
    return name


def check_parallel_values(values: Mapping[str, Any], key: Callable[[str], str] = _same) -> None:
    """Raise ``ConfigError`` unless the values of ``ParallelConfig``'s fields (by name; other names
    are ignored) are valid. ``key`` turns a field name into the name the message uses: the field
    itself for ``ParallelConfig(...)``, the config key ("parallel.zero_stage", "train.precision")
    when the training config checks the same values, so each rule is written here only."""
    if values["activation_checkpointing"] not in AC_MODES:
        raise ConfigError(f"{key('activation_checkpointing')} = {values['activation_checkpointing']!r} is not one "
                          f"of {', '.join(AC_MODES)}")
    if values["zero_stage"] not in (0, 1, 2, 3):
        raise ConfigError(f"{key('zero_stage')} = {values['zero_stage']!r}: use 0 (plain data parallel), 1, 2 or 3")
    check_offload(values["offload"], values["zero_stage"], key)
    check_bucket_cap(values["bucket_cap_mb"], key)
    if values["precision"] not in PRECISIONS:
        raise ConfigError(f"{key('precision')} = {values['precision']!r} is not one of {', '.join(PRECISIONS)}")
    for name in ("checkpoint_every", "microbatches", "virtual_stages"):
        if not isinstance(values[name], int) or values[name] < 1:
            raise ConfigError(f"{key(name)} = {values[name]!r} must be a positive integer")


def check_bucket_cap(value: object, key: Callable[[str], str] = _same) -> None:
    """Raise ``ConfigError`` unless ``value`` is "auto" or a positive, finite number of MiB (the
    gradient bucket size); ``key`` names the field as in ``check_parallel_values``."""
    name = key("bucket_cap_mb")
    fix = f'use "auto" (sized from the measured link at start-up) or a number of MiB, e.g. {name} = 25'
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} = {value!r} is not a bucket size: {fix}")
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name} must be positive or \"auto\", got {value!r}: {fix}")


def check_offload(offload: object, zero_stage: int, key: Callable[[str], str] = _same) -> None:
    """Raise ``ConfigError`` unless ``offload`` is one of ``OFFLOAD_MODES`` and the ZeRO stage has
    what it moves: ZeRO's fp32 master shards (any offload: stage >= 1) and its parameter shards
    ("params": stage 3). ``key`` names the fields as in ``check_parallel_values``."""
    if offload not in OFFLOAD_MODES:
        raise ConfigError(f"{key('offload')} = {offload!r} is not one of {', '.join(OFFLOAD_MODES)}")
    if offload != "none" and zero_stage == 0:
        raise ConfigError(f"{key('offload')} = {offload!r} needs ZeRO: it moves ZeRO's fp32 master shards and "
                          f"optimizer state to the host; set {key('zero_stage')} = 1, 2 or 3, or "
                          f"{key('offload')} = 'none'")
    if offload == "params" and zero_stage != 3:
        raise ConfigError(f"{key('offload')} = 'params' needs {key('zero_stage')} = 3 (only ZeRO-3 shards the "
                          f"parameters, and those shards are what it keeps on the host); set "
                          f"{key('zero_stage')} = 3, or {key('offload')} = 'optimizer' with stage {zero_stage}")


def check_tensor_parallel(cfg: LlamaConfig, tp: int) -> None:
    """Raise ``ConfigError`` unless heads, KV heads, the MLP width and the vocabulary split over tp."""
    for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads), ("ffn_dim", cfg.ffn_dim),
                    ("vocab_size", cfg.vocab_size)):
        if n % tp:
            ok = [d for d in range(1, n + 1) if n % d == 0 and d <= 64]
            raise ConfigError(f"model.{what} = {n} is not divisible by tp = {tp}: tensor parallelism splits it "
                              f"evenly over the tp ranks; use tp in {ok} or change model.{what}")


def check_expert_parallel(cfg: LlamaConfig, ep: int, tp: int = 1, seq_len: int | None = None,
                          key: str = "ep") -> None:
    """Raise ``ConfigError`` unless expert parallelism fits the model: ep > 1 needs a
    mixture-of-experts model whose expert count ep divides; with tp > 1 each tp rank routes its
    slice of the sequence, so the (per-cp-rank) ``seq_len`` must divide by tp."""
    n = cfg.n_experts
    if ep > 1 and n == 0:
        raise ConfigError(f"{key} = {ep} needs a mixture-of-experts model (model.n_experts > 0, e.g. "
                          f"model.preset = 'moe-test'); use {key} = 1 for a dense model")
    if n and n % ep:
        ok = [d for d in range(1, n + 1) if n % d == 0]
        raise ConfigError(f"{key} = {ep} does not divide model.n_experts = {n}: each expert-parallel rank holds "
                          f"n_experts / ep experts; use {key} in {ok} or change model.n_experts")
    if n and tp > 1 and seq_len is not None and seq_len % tp:
        raise ConfigError(f"a mixture-of-experts layer with tp = {tp} routes a 1/tp slice of each sequence on every "
                          f"tp rank, but the sequence ({seq_len} tokens per cp rank) does not divide by {tp}; use a "
                          f"sequence length that is a multiple of cp x tp")


__all__ = ["AC_MODES", "OFFLOAD_MODES", "PRECISIONS", "ParallelConfig", "check_bucket_cap", "check_expert_parallel",
           "check_offload", "check_parallel_values", "check_tensor_parallel"]
