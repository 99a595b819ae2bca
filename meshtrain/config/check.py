"""Turning a ``Config`` into the model and parallel configs, and the cross-field checks that need
no processes (``validate``). ``schema.py`` holds the sections, ``loading.py`` reads and writes them.

Each rule has one home: the values of ``ParallelConfig``'s own fields are checked by
``check_parallel_values`` (``parallel.py``, which ``ParallelConfig`` runs too), the model's shape
by ``LlamaConfig``, tensor-parallel divisibility by ``check_tensor_parallel``, pipeline schedules
by ``build_schedule``, algorithm names by ``meshtrain.comm``'s dispatch table and transport names
by its transport registry; ``validate`` runs them all and adds the rules that span sections. The
schedules (a torch-free module of ``meshtrain.parallel.pipeline``) are imported when ``validate``
runs, and ``meshtrain.comm`` only to check a pinned ``comm.algorithm`` or a ``comm.transport``
other than "auto": loading the default config imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
import typing

from ..errors import ConfigError
from .model import PRESETS, LlamaConfig
from .dims import check_degrees, degrees_of
from .parallel import ParallelConfig, check_expert_parallel, check_parallel_values, check_tensor_parallel
from .schema import BACKENDS, DEVICES, FROM_TRAIN, PLAN_CHECKS, Config, transports, unknown


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def model_config(config: Config, tokenizer_vocab: int | None = None) -> LlamaConfig:
    """The ``LlamaConfig``: the preset, then the overrides set in ``[model]``. Without a
    vocab_size override the vocabulary is the tokenizer's (``tokenizer_vocab``, else
    ``data.vocab_size``) padded to a multiple of lcm(64, tp), so the head splits over tp."""
    m = config.model
    if m.preset not in PRESETS:
        raise unknown(m.preset, PRESETS, "model.preset")
    changes = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)
               if f.name != "preset" and getattr(m, f.name) is not None}
    vocab = tokenizer_vocab if tokenizer_vocab is not None else config.data.vocab_size
    if m.vocab_size is None:
        changes["vocab_size"] = _pad(vocab, math.lcm(64, max(config.parallel.tp, 1)))
    elif m.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size = {m.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({vocab}); raise it to at least {vocab} or leave it unset")
    try:
        return dataclasses.replace(PRESETS[m.preset], **changes)
    except ValueError as e:
        raise ConfigError(f"model: {e}; change the [model] overrides") from None


def _key(name: str) -> str:
    """The config key of a ``ParallelConfig`` field, for its error messages."""
    return f"{'train' if name in FROM_TRAIN else 'parallel'}.{name}"


def parallel_config(config: Config) -> ParallelConfig:
    """The ``ParallelConfig`` of ``[parallel]`` (every field that both have), with ``FROM_TRAIN``
    taken from ``[train]``. Its values are checked by ``ParallelConfig``'s own rules, with messages
    that name the config keys."""
    names = {f.name for f in dataclasses.fields(ParallelConfig)}
    kwargs = {k: v for k, v in dataclasses.asdict(config.parallel).items() if k in names}
    kwargs.update({name: getattr(config.train, name) for name in FROM_TRAIN})
    check_parallel_values(kwargs, key=_key)
    return ParallelConfig(**kwargs)


# The collectives a training run issues with algorithm="auto" (meshtrain/parallel, the trainer,
# checkpoints): the ops comm.algorithm can pin. Pipeline and context parallelism move activations
# with point-to-point send/recv, which have no algorithm; barrier is the metadata exchange itself.
TRAINING_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def transport_kinds(transport: str, backend: str) -> tuple[str, ...]:
    """The transport kinds ``comm.transport`` can give a run: ``auto`` is the torch group with
    NCCL, else shm (between hosts too); with ``backend = auto`` that depends on the machine
    (the registry's ``auto_names``, which imports meshtrain.comm)."""
    if transport != "auto":
        return (transport,)
    from ..comm.transport.registry import auto_names

    return auto_names(backend)


def training_algorithms(kinds: typing.Iterable[str]) -> list[str]:
    """The algorithm names that run at least one of ``TRAINING_OPS`` on one of the transport
    ``kinds`` (sorted); ``comm.algorithm`` must be one of them or "auto"."""
    from ..comm.algorithms import algorithms_for

    return sorted({a for k in kinds for op in TRAINING_OPS for a in algorithms_for(op, k)})


def check_algorithm(algorithm: str, kinds: typing.Iterable[str], where: str) -> None:
    """Raise ``ConfigError`` unless ``comm.algorithm`` is "auto" or pins at least one training
    collective on one of the transport ``kinds``; ``where`` says which transport setting that is."""
    if algorithm == "auto":  # always valid; returning first keeps meshtrain.comm (and torch) unimported
        return
    valid = ["auto"] + training_algorithms(kinds)
    if algorithm in valid:
        return
    from ..comm.algorithms import TABLE  # every (operation, algorithm) the library runs

    if algorithm not in {name for _, name in TABLE}:
        raise unknown(algorithm, valid, "comm.algorithm")
    from ..comm.transport.registry import specs

    owner = next((s for s in specs() if algorithm in s.algorithms), None)  # the transport it runs on only
    needs = f" ({algorithm!r} needs the {owner.name} transport: {owner.hint})" if owner is not None else ""
    raise ConfigError(f"comm.algorithm = {algorithm!r} runs none of the collectives training uses "
                      f"({', '.join(TRAINING_OPS)}) on {where}{needs}; use one of {', '.join(valid)}")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: str, choices: typing.Sequence[str]) -> None:
    _need(value in choices, f"{key} = {value!r} is not one of {', '.join(choices)}")


def validate(config: Config) -> None:
    """Cross-field checks that need no processes: degrees, batch and sequence divisibility, the
    schedule, the model's shape under tp / pp, the optimiser and the names of choices. Raises
    ``ConfigError`` naming the field and the fix."""
    from ..parallel.pipeline.schedule import build_schedule  # torch-free; the schedules' own rules

    p, t, d, c = config.parallel, config.train, config.data, config.comm
    check_degrees(degrees_of(p), key=lambda n: f"parallel.{n}")
    pcfg = parallel_config(config)
    try:
        build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    except ConfigError as e:
        raise ConfigError(f"parallel.schedule = {p.schedule!r}: {e}") from None
    _need(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel = true needs parallel.tp > 1; "
          "set tp > 1 or sequence_parallel = false")
    for k in ("steps", "global_batch", "seq_len", "log_every"):
        _need(getattr(t, k) >= 1, f"train.{k} = {getattr(t, k)} must be >= 1")
    rows = p.dp * pcfg.microbatches
    _need(t.global_batch % rows == 0,
          f"train.global_batch = {t.global_batch} is not divisible by dp x microbatches = {p.dp} x "
          f"{pcfg.microbatches} = {rows}; use train.global_batch = {max(rows, t.global_batch // rows * rows)} "
          f"or {_pad(t.global_batch, rows)}")
    if p.cp > 1:
        _need(t.seq_len % (2 * p.cp) == 0, f"train.seq_len = {t.seq_len} is not divisible by 2 x cp = {2 * p.cp} "
              f"(context parallelism gives each rank two chunks); use train.seq_len = {_pad(t.seq_len, 2 * p.cp)}")
    if p.sequence_parallel:
        _need(t.seq_len % (p.cp * p.tp) == 0, f"train.seq_len = {t.seq_len} is not divisible by cp x tp = "
              f"{p.cp * p.tp} (sequence parallelism splits each rank's sequence over tp); use train.seq_len = "
              f"{_pad(t.seq_len, p.cp * p.tp)}")
    # a warmup longer than the run is clamped to it (trainer.lr_at), with a note (train/preflight.py)
    _need(t.warmup_steps >= 0, f"train.warmup_steps = {t.warmup_steps} must be >= 0 (0: no warmup); set e.g. "
          f"--train.warmup_steps={t.steps // 10}")
    _need(t.lr > 0 and 0 <= t.min_lr <= t.lr, f"need 0 < train.lr and 0 <= train.min_lr <= train.lr, got "
          f"lr = {t.lr}, min_lr = {t.min_lr}; set them so")
    _need(t.weight_decay >= 0 and t.grad_clip >= 0, "train.weight_decay and train.grad_clip must be >= 0 "
          "(grad_clip = 0 turns clipping off)")
    _need(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, f"train.beta1 = {t.beta1} and train.beta2 = {t.beta2} must "
          f"be in [0, 1)")
    # (train.precision is ParallelConfig's, checked by parallel_config above)
    _need(math.isfinite(t.loss_scale_init) and t.loss_scale_init >= 1, f"train.loss_scale_init = "
          f"{t.loss_scale_init} must be a finite number >= 1 (the fp16 loss scale never backs off below 1); use "
          f"e.g. train.loss_scale_init = 65536 (2^16)")
    _need(t.loss_scale_growth_interval >= 1, f"train.loss_scale_growth_interval = {t.loss_scale_growth_interval} "
          f"must be >= 1 (clean steps before the fp16 loss scale doubles); use e.g. "
          f"train.loss_scale_growth_interval = 2000")
    _one_of("train.device", t.device, DEVICES)
    _one_of("train.plan_check", t.plan_check, PLAN_CHECKS)
    if c.transport != "auto":  # the registry's names import torch: the default "auto" never asks
        _one_of("comm.transport", c.transport, transports())
    _one_of("comm.backend", c.backend, BACKENDS)
    _need(not (c.backend == "nccl" and t.device == "cpu"), "comm.backend = 'nccl' needs train.device = 'cuda' "
          "(or 'auto' on a GPU machine); on CPU use comm.backend = 'gloo'")
    _need(c.timeout_s > 0 and c.init_timeout_s > 0, "comm.timeout_s and comm.init_timeout_s must be > 0")
    if c.algorithm != "auto":  # always valid; transport_kinds of "auto" would import meshtrain.comm
        check_algorithm(c.algorithm, transport_kinds(c.transport, c.backend), f"comm.transport = {c.transport!r}"
                        + (f" with comm.backend = {c.backend!r}" if c.transport == "auto" else ""))
    _need(d.vocab_size >= 257, f"data.vocab_size = {d.vocab_size} must be >= 257 (a byte-level BPE starts "
          f"from 256 byte tokens plus end-of-text)")
    _need(bool(d.text_field), "data.text_field = '' names no field; set it to the JSON field / column holding the "
          "text (default \"text\")")
    _need(t.print_every >= 0, f"train.print_every = {t.print_every} must be >= 0 (0: about 20 lines a run)")
    _need(d.max_bytes >= 0 and d.tokenizer_sample_bytes > 0, "data.max_bytes must be >= 0 (0: no limit) and "
          "data.tokenizer_sample_bytes > 0")
    ck = config.checkpoint
    _need(ck.every >= 0 and ck.keep >= 1 and bool(ck.dir), f"need checkpoint.every >= 0 (0: at the end only), "
          f"checkpoint.keep >= 1 and a checkpoint.dir, got every = {ck.every}, keep = {ck.keep}, dir = {ck.dir!r}")
    _need(not config.elastic.enabled or ck.enabled, "elastic.enabled = true needs checkpoint.enabled = true "
          "(a run on a new world resumes from the last checkpoint); enable checkpoints or elastic.enabled = false")
    _need(config.elastic.memory_every >= 0, f"elastic.memory_every = {config.elastic.memory_every} must be >= 0 "
          f"(steps between in-memory replicas; 0 turns them off); use e.g. elastic.memory_every = 1")
    mc = model_config(config)
    _need(t.seq_len <= mc.max_seq_len, f"train.seq_len = {t.seq_len} is longer than model.max_seq_len = "
          f"{mc.max_seq_len}; set model.max_seq_len = {t.seq_len} or a shorter train.seq_len")
    stages = p.pp * pcfg.virtual_stages
    _need(stages <= mc.n_layers, f"pp x virtual_stages = {stages} pipeline stages but the model has "
          f"{mc.n_layers} layers; use fewer stages or more model.n_layers")
    _need(not (mc.tie_embeddings and stages > 1), "model.tie_embeddings = true needs the embedding and head on "
          "one stage; set model.tie_embeddings = false or parallel.pp = 1")
    if p.tp > 1:
        check_tensor_parallel(mc, p.tp)
    check_expert_parallel(mc, p.ep, p.tp, t.seq_len // p.cp, "parallel.ep")

