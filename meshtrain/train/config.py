"""The training configuration: typed dataclasses with a docstring per field, loaded from TOML and
overridden from the command line (``--section.key=value``), validated before any process starts.

Precedence: the defaults below < the TOML file < the overrides, in the order given. The defaults
are the README's main job: the 10m model, dp2 x tp2 on 4 local processes, the built-in corpus.
Every error is a ``ConfigError`` that names the field (``section.key``) and says what to do.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import textwrap
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError

from ..parallel.parallelize import ParallelConfig

if typing.TYPE_CHECKING:
    from ..models.llama import LlamaConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


@dataclass
class ModelSection:
    """The model: a preset of ``meshtrain.models.llama.PRESETS``, then any field overridden."""

    preset: str = "10m"
    """Name of a preset in ``meshtrain.models.llama.PRESETS`` ("test", "5m", "10m", "1b", "8b")."""
    vocab_size: int | None = None
    """Override: token ids (default: the tokenizer's vocabulary, padded to a multiple of 64 and tp)."""
    dim: int | None = None
    """Override: hidden size."""
    n_layers: int | None = None
    """Override: number of decoder blocks."""
    n_heads: int | None = None
    """Override: attention heads."""
    n_kv_heads: int | None = None
    """Override: key/value heads (grouped-query attention); must divide n_heads."""
    ffn_dim: int | None = None
    """Override: hidden size of the SwiGLU MLP."""
    max_seq_len: int | None = None
    """Override: longest sequence the rotary table covers (>= train.seq_len)."""
    rope_theta: float | None = None
    """Override: rotary base."""
    norm_eps: float | None = None
    """Override: RMSNorm epsilon."""
    tie_embeddings: bool | None = None
    """Override: share the embedding matrix with the output head (needs pp = 1)."""


@dataclass
class ParallelSection(ParallelConfig):
    """The layout: the degrees of the (dp, pp, cp, tp) mesh, plus every field of ``ParallelConfig``
    (inherited with its docs, so the two cannot drift apart)."""

    dp: int = 2
    """Data-parallel degree (replicas, or ZeRO shards)."""
    tp: int = 2
    """Tensor-parallel degree (heads, MLP width and vocabulary split over tp ranks)."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    cp: int = 1
    """Context-parallel degree (ring attention over sequence chunks)."""

    @property
    def world_size(self) -> int:
        """Number of processes the layout needs: dp * tp * pp * cp."""
        return self.dp * self.tp * self.pp * self.cp


@dataclass
class TrainSection:
    """The optimisation: steps, batch, AdamW with warmup + cosine decay, clipping, seed."""

    steps: int = 120
    """Optimizer steps to run."""
    global_batch: int = 8
    """Sequences per step over all data-parallel ranks (a multiple of dp * microbatches)."""
    seq_len: int = 128
    """Tokens per sequence (each sample is seq_len + 1 tokens: inputs and shifted targets)."""
    lr: float = 2e-3
    """Peak learning rate, reached after warmup."""
    min_lr: float = 2e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 15
    """Steps of linear warmup from 0 to lr (at most steps)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    seed: int = 0
    """Seed of the initial weights and of the data order; the same seed repeats a run."""
    precision: str = "fp32"
    """Compute dtype: "fp32" or "bf16" (autocast; fp32 master weights, gradients and reductions)."""
    compile: bool = False
    """Compile each transformer block with ``torch.compile`` (needs a C++ compiler on the CPU)."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu" or "cuda"."""
    log_every: int = 1
    """Write a metrics line (and refresh the progress bar) every this many steps."""


@dataclass
class DataSection:
    """The text and its tokenizer."""

    path: str = ""
    """"" for the built-in corpus (this Python's standard-library sources), or a .txt / .jsonl /
    .parquet file, a directory of them, or a saved Hugging Face dataset directory."""
    tokenizer: str = ""
    """"" to train (once, then cached) a byte-level BPE on the corpus, or a local Hugging Face
    tokenizer directory / tokenizer.json."""
    vocab_size: int = 8192
    """Vocabulary of the BPE trained when tokenizer is ""."""
    max_bytes: int = 20_000_000
    """Read at most this many bytes of text (0: all of it)."""
    tokenizer_sample_bytes: int = 4_000_000
    """Train the BPE on about this many bytes, sampled evenly over the corpus."""


@dataclass
class CheckpointSection:
    """Sharded checkpoints in the run directory."""

    enabled: bool = True
    """Save checkpoints at all."""
    every: int = 0
    """Save every this many steps (0: only at the end of the run)."""
    keep: int = 3
    """Keep the last this many checkpoints; older ones are deleted."""
    dir: str = "checkpoints"
    """Directory of the checkpoints, relative to the run directory (out)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    resume: str = ""
    """"" to start fresh, "auto" for the latest checkpoint of this run directory if any, or a
    checkpoint directory (any layout: it is resharded)."""


@dataclass
class CommSection:
    """The communication library under the parallelism."""

    transport: str = "auto"
    """"auto" (shm within a host, the torch group between hosts, NCCL's on GPUs), "shm", "torch"
    (the torch.distributed group) or "local" (ranks as threads of one process)."""
    backend: str = "auto"
    """torch.distributed backend: "gloo", "nccl" or "auto" (nccl on CUDA, else gloo)."""
    algorithm: str = "auto"
    """Collective algorithm: "auto" (the cost model) or a name ("ring", "tree", "recursive_doubling",
    "halving_doubling", "hierarchical", "direct", "native", "shm") that every training collective
    it can run uses; the others stay "auto". Point-to-point send/recv (pp, cp) have none."""
    timeout_s: float = 300.0
    """Seconds a collective may take before it fails naming the missing ranks."""
    init_timeout_s: float = 120.0
    """Seconds to wait for every process to join at start-up."""
    check: bool = True
    """Check across ranks that every collective has the same op, shapes and dtype."""


@dataclass
class Config:
    """The whole configuration of a training run."""

    model: ModelSection = field(default_factory=ModelSection)
    """The model preset and overrides."""
    parallel: ParallelSection = field(default_factory=ParallelSection)
    """Parallel degrees and how they are applied."""
    train: TrainSection = field(default_factory=TrainSection)
    """Optimisation."""
    data: DataSection = field(default_factory=DataSection)
    """Corpus and tokenizer."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Checkpoints."""
    comm: CommSection = field(default_factory=CommSection)
    """Communication."""
    out: str = ""
    """Run directory; "" means runs/<YYYYmmdd-HHMMSS>, fixed once by ``resolve_out`` (the
    launcher's job, so that every process writes to the same directory)."""


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)  # type: ignore[misc]
                             if f.default_factory is not dataclasses.MISSING}
TOP_LEVEL = ("out",)
PRECISIONS = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
TRANSPORTS = ("auto", "local", "shm", "torch")
BACKENDS = ("auto", "gloo", "nccl")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


# ------------------------------------------------------------------------------------ introspection

@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field), by name,
    including those of the dataclasses it inherits from."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr) \
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys() -> list[str]:
    """Every valid dotted key ("train.lr", ..., "out")."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)] + list(TOP_LEVEL)


def _base_and_optional(tp: Any) -> tuple[type, bool]:
    args = typing.get_args(tp)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


_TYPE_NAMES = {bool: ("a boolean", "true"), int: ("an integer", "1"), float: ("a number", "1.0"), str: ("a string", '"..."')}


def _type_error(key: str, tp: Any, got: str) -> ConfigError:
    base, opt = _base_and_optional(tp)
    name, example = _TYPE_NAMES[base]
    return ConfigError(f"{key} must be {name}{' (or none)' if opt else ''}, got {got}; e.g. {key} = {example}")


def _unknown(key: str, candidates: Iterable[str], what: str = "config key") -> ConfigError:
    candidates = list(candidates)
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not close and "." not in key:  # a bare key: look for it in every section
        close = [c for c in candidates if c.endswith("." + key)][:1]
    hint = f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(candidates)}"
    return ConfigError(f"unknown {what} '{key}'; {hint}")


def _target(config: Config, key: str) -> tuple[Any, str, Any]:
    """The object holding the dotted ``key``, the attribute's name and its type."""
    if key in SECTIONS:
        raise ConfigError(f"'{key}' is a section, not a key: set one of its keys, e.g. "
                          f"{key}.{dataclasses.fields(SECTIONS[key])[0].name}")
    if key in TOP_LEVEL:
        return config, key, _hints(Config)[key]
    section, _, name = key.partition(".")
    if section not in SECTIONS or name not in _hints(SECTIONS[section]):
        raise _unknown(key, all_keys())
    return getattr(config, section), name, _hints(SECTIONS[section])[name]


# ------------------------------------------------------------------------------------------ values

def _coerce(key: str, value: Any, tp: Any) -> Any:
    """A TOML value checked against the field type (ints are accepted for floats)."""
    base, opt = _base_and_optional(tp)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ((value is None and opt) or (base is float and number) or (base is int and number and isinstance(value, int))
            or (base in (bool, str) and isinstance(value, base))):
        raise _type_error(key, tp, f"{type(value).__name__} {value!r}")
    return float(value) if base is float and value is not None else value


def parse_value(key: str, raw: str, tp: Any) -> Any:
    """A command-line string parsed to the field type: booleans true/false/1/0/yes/no/on/off,
    ints (underscores allowed), floats, strings as given, "none" for optional fields."""
    base, opt = _base_and_optional(tp)
    text = raw.strip().lower()
    if opt and text in ("none", "null"):
        return None
    try:
        if base is bool and text in _TRUE + _FALSE:
            return text in _TRUE
        if base in (int, float):
            return base(text)
    except ValueError:
        pass
    if base is str:
        return raw
    raise _type_error(key, tp, repr(raw))


# ------------------------------------------------------------------------------------- from / to dict

def from_dict(data: dict[str, Any]) -> Config:
    """A ``Config`` from nested dicts (a parsed TOML file, or ``to_dict`` output); unknown
    sections or keys and wrongly typed values raise ``ConfigError``."""
    cfg = Config()
    for name, value in data.items():
        if isinstance(value, dict) and name not in SECTIONS:
            raise _unknown(name, SECTIONS, "config section")
        items = [(f"{name}.{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(name, value)]
        for key, v in items:
            obj, attr, tp = _target(cfg, key)
            setattr(obj, attr, _coerce(key, v, tp))
    return cfg


def to_dict(config: Config) -> dict[str, Any]:
    """Nested plain dicts of the config (fields set to None included)."""
    return dataclasses.asdict(config)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else "nan" if math.isnan(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    return repr(v)


def to_toml(config: Config, comments: bool = True) -> str:
    """The config as TOML that ``load_config`` reads back to an equal config; with ``comments``
    each key carries its docstring. Fields set to None (TOML has no null) appear commented out."""
    lines = []
    for name in TOP_LEVEL:
        if comments:
            lines.append(f"# {field_docs(Config)[name]}")
        lines.append(f"{name} = {_toml_value(getattr(config, name))}")
    for name, cls in SECTIONS.items():
        lines += ["", f"[{name}]"]
        # a section's own fields first (ParallelSection: the degrees, then ParallelConfig's)
        for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in vars(cls).get("__annotations__", {})):
            v = getattr(getattr(config, name), f.name)
            if comments:
                lines.append(f"# {field_docs(cls).get(f.name, '')}")
            if v is not None:
                lines.append(f"{f.name} = {_toml_value(v)}")
            elif comments:
                lines.append(f"# {f.name} = (unset)")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ loading

def _split_overrides(overrides: Iterable[str]) -> list[tuple[str, str]]:
    """(key, raw value) for ``--a.b=v``, ``a.b=v`` or the pair ``--a.b v``."""
    items, out, i = list(overrides), [], 0
    while i < len(items):
        item = items[i]
        body = item[2:] if item.startswith("--") else item
        if "=" in body:
            key, raw = body.split("=", 1)
        elif item.startswith("--") and i + 1 < len(items) and not items[i + 1].startswith("--"):
            key, raw, i = body, items[i + 1], i + 1
        else:
            raise ConfigError(f"override {item!r} has no value: write --section.key=value (e.g. --train.lr=3e-4)")
        parts = key.split(".")
        if len(parts) > 2 or not all(p.isidentifier() for p in parts):
            raise ConfigError(f"bad override {item!r}: write --section.key=value (e.g. --train.lr=3e-4)")
        out.append((key, raw))
        i += 1
    return out


def apply_overrides(config: Config, overrides: Iterable[str]) -> Config:
    """Set ``--section.key=value`` overrides on ``config`` (in place, later ones win); returns it."""
    for key, raw in _split_overrides(overrides):
        obj, attr, tp = _target(config, key)
        setattr(obj, attr, parse_value(key, raw, tp))
    return config


def load_config(path: str | None = None, overrides: Iterable[str] = (), *, check: bool = True) -> Config:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides`` (``--section.key=value``);
    with ``check``, ``validate`` the result. Every problem is a ``ConfigError``."""
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path!r} does not exist; pass the path of a TOML file "
                              f"(`meshtrain train --print-config > my.toml` writes one to start from)")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    config = apply_overrides(from_dict(data), overrides)
    if check:
        validate(config)
    return config


def resolve_out(config: Config, now: float | None = None) -> Config:
    """Fill an empty ``out`` with runs/<YYYYmmdd-HHMMSS> (local time); call once, before spawning."""
    if not config.out:
        config.out = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.localtime(now)))
    return config


# the model/parallel configs and validation live in config_check.py; re-exported here
from .config_check import model_config, parallel_config, validate  # noqa: E402


__all__ = [
    "Config", "ModelSection", "ParallelSection", "TrainSection", "DataSection", "CheckpointSection",
    "CommSection", "load_config", "apply_overrides", "from_dict", "to_dict", "to_toml", "validate",
    "model_config", "parallel_config", "resolve_out", "field_docs", "all_keys", "parse_value",
]
