"""The sections of the training configuration: typed dataclasses with a docstring per field.

The defaults are the README's main job: the 10m model, dp2 x tp2 on 4 local processes, the built-in
corpus. Sections that configure another dataclass are derived from it rather than retyped, so the
two cannot drift apart: ``[model]`` has one optional override per ``LlamaConfig`` field (built from
``dataclasses.fields``), ``[parallel]`` inherits every ``ParallelConfig`` field. Loading, overrides
and TOML live in ``loading.py``, the checks in ``check.py``; nothing here imports torch.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Optional

from ..errors import ConfigError
from .dims import DEGREES, Degree, degrees_of, world_size_of
from .model import PRESETS, LlamaConfig
from .parallel import PRECISIONS, ParallelConfig

DOC = "doc"
"""The ``dataclasses.field`` metadata key of a field's docstring, for fields made by code (which
have no source line to read an attribute docstring from)."""


# ------------------------------------------------------------------------------------ introspection

@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings of a dataclass's fields by name, whitespace collapsed: the string literal
    under each field in the source (including the dataclasses it inherits from), or the field's
    ``metadata["doc"]`` for fields made by code; then any ``field_notes`` the class adds."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # defined by code: its docs are in the metadata, read below
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr) \
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                docs[a.target.id] = " ".join(b.value.value.split())
    for f in dataclasses.fields(cls):
        if DOC in f.metadata:
            docs[f.name] = " ".join(f.metadata[DOC].split())
    for name, note in getattr(cls, "field_notes", {}).items():  # what a subclass adds to an inherited doc
        docs[name] = f"{docs.get(name, '')} {note}".strip()
    return docs


def _override_doc(doc: str, note: str = "") -> str:
    """"Hidden size." -> "Override: hidden size." (with " (note)" before the full stop)."""
    text = doc.rstrip(".")
    if text[:1].isupper() and not text[1:2].isupper():  # "Hidden" -> "hidden", but "RMSNorm" stays
        text = text[0].lower() + text[1:]
    return f"Override: {text}{f' ({note})' if note else ''}."


def overrides_of(source: type, notes: dict[str, str]) -> Callable[[type], type]:
    """A class decorator (put it under ``@dataclass``) adding one field per field of the dataclass
    ``source``: same name, type ``T | None``, default None (keep the source's value), documented as
    "Override: <the source field's doc> (<notes[name]>)". The section then follows ``source``:
    a field added there is a config key at once, with its docstring."""
    hints, docs = typing.get_type_hints(source), field_docs(source)

    def add(cls: type) -> type:
        annotations = cls.__dict__["__annotations__"]  # the class's own dict: @dataclass reads fields from it
        for f in dataclasses.fields(source):
            annotations[f.name] = Optional[hints[f.name]]
            setattr(cls, f.name, field(default=None, metadata={DOC: _override_doc(docs[f.name], notes.get(f.name, ""))}))
        return cls
    return add


# ------------------------------------------------------------------------------------------ sections

_PRESET_NAMES = ", ".join(f'"{name}"' for name in PRESETS)  # listed in model.preset's doc, so it is never stale

@dataclass
@overrides_of(LlamaConfig, notes={  # what the [model] key means beyond the LlamaConfig field it overrides
    "vocab_size": "default: the tokenizer's vocabulary, padded to a multiple of 64 and tp",
    "max_seq_len": ">= train.seq_len",
    "tie_embeddings": "needs pp = 1",
})
class ModelSection:
    """The model: a preset of ``meshtrain.models.llama.PRESETS``, then any ``LlamaConfig`` field
    overridden (one optional key per field, added by ``overrides_of``)."""

    preset: str = field(default="10m", metadata={DOC: f"Name of a preset in ``meshtrain.models.llama.PRESETS`` "
                                                      f"({_PRESET_NAMES})."})


FROM_TRAIN = ("precision", "compile")
"""The ``ParallelConfig`` fields a run takes from ``[train]`` (``train.precision``, ``train.compile``),
not from the ``[parallel]`` keys of the same names that ``ParallelSection`` inherits."""


def degree_fields(degrees: tuple[Degree, ...]) -> Callable[[type], type]:
    """A class decorator (put it under ``@dataclass``) adding one ``int`` field per degree of the
    dimensions' table (``config.dims.DEGREES``), before the class's own fields, with the degree's
    default and doc: a new mesh dimension is a config key at once."""
    def add(cls: type) -> type:
        own = dict(cls.__dict__["__annotations__"])
        annotations = cls.__dict__["__annotations__"]
        annotations.clear()
        for d in degrees:
            annotations[d.name] = int
            setattr(cls, d.name, field(default=d.default, metadata={DOC: d.doc}))
        annotations.update(own)
        return cls
    return add


@dataclass
@degree_fields(DEGREES)
class ParallelSection(ParallelConfig):
    """The layout: one degree per mesh dimension (``config.dims.DEGREES``: dp, dp_replicate, tp, pp,
    cp, ep), plus every field of ``ParallelConfig`` (inherited with its docs, so the two cannot
    drift apart)."""

    # appended to the inherited docs in --print-config: these two keys exist only because every
    # ParallelConfig field is inherited; printed files set them, so they must keep loading
    field_notes: ClassVar[dict[str, str]] = {
        name: f"Not read by a run, which takes it from train.{name}; kept so that files setting it still load."
        for name in FROM_TRAIN}

    auto: bool = False
    """Let the planner choose the layout: the one ``meshtrain plan --search`` ranks first for this model,
    batch and machine (this-host on the CPU, the GPU's preset on CUDA), for as many ranks as
    dp x tp x pp x cp above. It sets dp, tp, pp, cp, zero_stage, microbatches, schedule,
    virtual_stages, activation_checkpointing, sequence_parallel and dp_replicate."""

    @property
    def world_size(self) -> int:
        """Number of processes the layout needs: dp * tp * pp * cp (``config.dims.world_size_of``)."""
        return world_size_of(degrees_of(self))


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
    """Steps of linear warmup from 0 to lr; one longer than the run is clamped to train.steps (with a note)."""
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
    """Compute dtype: "fp32", "bf16" or "fp16" (autocast; fp32 master weights, gradients and
    reductions). fp16 runs dynamic loss scaling: a step whose gradients overflow on any rank is
    skipped on every rank and the scale halved."""
    loss_scale_init: float = 65536.0
    """fp16: the initial loss scale (2^16, as GradScaler and DeepSpeed's initial_scale_power = 16); >= 1."""
    loss_scale_growth_interval: int = 2000
    """fp16: double the loss scale after this many clean steps in a row (>= 1)."""
    compile: bool = False
    """Compile each transformer block with ``torch.compile`` (needs a C++ compiler on the CPU)."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu" or "cuda"."""
    log_every: int = 1
    """Write a metrics line (and refresh the progress bar) every this many steps."""
    print_every: int = 0
    """Without the progress bar (``--no-progress``, as in a cluster's log): print a one-line
    ``# step S/N: loss ...`` every this many steps (rounded up to a multiple of log_every); 0: about
    20 lines a run."""
    plan_check: str = "auto"
    """The planner's prediction for the run's own layout, written beside what the run measured
    (summary.json, the last log line): "cached" prices it from the host's cached calibration,
    measuring nothing (on a CPU a roofline, often far off for small models); "profiled" has
    ``meshtrain train`` time the model's blocks at the run's shapes once its ranks have ended, as
    ``meshtrain bench plan`` does (about 10 s on a 2-core CPU host; a GPU preset is priced the same
    either way; under torchrun there is no such parent, and "cached" is used); "auto": "profiled" for a CPU
    run whose training took at least 100 s (the timing then adds about a tenth), else "cached";
    "off": no prediction."""


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
    text_field: str = "text"
    """The JSON field (.jsonl) or column (.parquet, a saved Hugging Face dataset) that holds each
    document's text."""
    tokenizer_sample_bytes: int = 4_000_000
    """Train the BPE on about this many bytes, sampled evenly over the corpus."""


@dataclass
class CheckpointSection:
    """Sharded checkpoints in the run directory."""

    enabled: bool = True
    """Save checkpoints at all."""
    every: int = 100
    """Save every this many steps, and at the end (0: only at the end). A SIGINT or SIGTERM saves the
    step the ranks stop at whatever this is; this bounds what a crash or SIGKILL loses."""
    keep: int = 3
    """Keep the last this many checkpoints; older ones are deleted once a newer one is committed."""
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
    (the torch.distributed group), "local" (ranks as threads of one process) or another transport
    registered with ``meshtrain.comm.transport.registry``."""
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
class ElasticSection:
    """Elastic training: keep training when the world changes size (``torchrun --nnodes MIN:MAX``
    restarts the workers with a new WORLD_SIZE), resuming from the last checkpoint resharded."""

    enabled: bool = False
    """When the ranks started differ from dp x tp x pp x cp, choose the layout for them (tp, pp, cp
    kept, dp = ranks / (tp x pp x cp)) and resume from the last checkpoint instead of failing (on
    SIGTERM every rank finishes its step, saves a checkpoint and exits with code 143, as every run
    does). Needs checkpoint.enabled; an empty checkpoint.resume becomes "auto"."""
    keep_global_batch: bool = True
    """Keep train.global_batch whatever the world (each dp rank takes more or fewer rows: the same
    losses). false: each dp rank keeps global_batch / dp rows of the configured layout, and train.lr
    and train.min_lr scale linearly with the new global batch (new / configured)."""
    reshape_model_parallel: bool = False
    """When dp alone cannot absorb the new world (tp x pp x cp larger than it or not dividing it),
    shrink cp, then pp, then tp to divisors of their configured values until a layout fits; false:
    stop with an error that lists the world sizes that work."""
    memory_every: int = 1
    """With elastic on: every this many steps each rank keeps its checkpoint shard in its host's
    memory (/dev/shm) and in a peer host's, and a restart after a crash resumes from the newest step
    whose every shard survived there instead of the last disk checkpoint; 0: off (disk only)."""


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
    elastic: ElasticSection = field(default_factory=ElasticSection)
    """Elastic training (world size changes)."""
    out: str = ""
    """Run directory; "" means runs/<YYYYmmdd-HHMMSS>, fixed once by ``resolve_out`` (the
    launcher's job, so that every process writes to the same directory)."""
    overwrite: bool = False
    """Train into an out that holds a previous run (its config.toml, metrics.jsonl, summary.json or
    checkpoints) without resuming it: its files are deleted first. false: such a folder is refused
    unless checkpoint.resume continues it."""


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)  # type: ignore[misc]
                             if f.default_factory is not dataclasses.MISSING}
"""The sections by name, in file order."""
TOP_LEVEL = ("out", "overwrite")
"""The keys outside any section."""
DEVICES = ("auto", "cpu", "cuda")
"""The values of ``train.device``."""
PLAN_CHECKS = ("auto", "cached", "profiled", "off")
"""The values of ``train.plan_check``."""


def transports() -> tuple[str, ...]:
    """The values of ``comm.transport``: "auto" and every registered transport (``meshtrain.comm``'s
    registry, so asking imports torch; the check of the default "auto" never asks)."""
    from ..comm.transport import registry

    return (registry.AUTO, *registry.names())



BACKENDS = ("auto", "gloo", "nccl")
"""The values of ``comm.backend``."""
# train.precision's values are ParallelConfig's (PRECISIONS, imported above): one list, one check


@functools.lru_cache(maxsize=None)
def hints(cls: type) -> dict[str, Any]:
    """The resolved type of each field of ``cls`` (cached: ``typing.get_type_hints`` is slow)."""
    return typing.get_type_hints(cls)


def all_keys() -> list[str]:
    """Every valid dotted key ("train.lr", ..., "out")."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)] + list(TOP_LEVEL)


def unknown(key: str, candidates: Iterable[str], what: str = "config key") -> ConfigError:
    """The error for a name that is not one of ``candidates``: the closest one, or all of them."""
    candidates = list(candidates)
    # a key that begins a candidate ("parallel.zero" of "parallel.zero_stage") is that one, before
    # any spelling neighbour ("parallel.ep")
    close = [c for c in candidates if c.startswith(key)][:1] or difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not close and "." not in key:  # a bare key: look for it in every section
        close = [c for c in candidates if c.endswith("." + key)][:1]
    hint = f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(candidates)}"
    return ConfigError(f"unknown {what} '{key}'; {hint}")


__all__ = [
    "Config", "ModelSection", "ParallelSection", "TrainSection", "DataSection", "CheckpointSection",
    "CommSection", "ElasticSection", "SECTIONS", "TOP_LEVEL", "FROM_TRAIN", "PRECISIONS", "DEVICES", "transports", "BACKENDS", "field_docs",
    "hints", "all_keys", "unknown", "overrides_of",
]
