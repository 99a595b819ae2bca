"""``meshtrain train --parallel.auto=true``: the layout ``meshtrain plan --search`` ranks first for the
run's model, batch and ranks on the machine it runs on.

The number of ranks stays what the given degrees multiply to (dp x tp x pp x cp, 4 by default); the
planner reshapes it: dp, tp, pp, cp, ZeRO stage, HSDP replicas, micro-batches, schedule, virtual
stages, activation checkpointing and sequence parallelism. The machine is ``this-host`` on the CPU, or the
GPU preset of the device's name. Layouts ``meshtrain train`` would reject (its checks are stricter
than the planner's in places, e.g. cp needs seq_len divisible by 2 x cp) are skipped in rank order.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .architectures import from_llama_config
from .clusters import PRESETS, Cluster
from .corun import stop as stop_profiling
from .layout import Layout
from .search import search
from .step import Prediction, predict

DEVICE_PRESETS = {"H100": "h100", "H200": "h200", "A100": "a100"}
"""A CUDA device name's marker -> the cluster preset that prices it."""

LAYOUT_FIELDS = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "zero_stage": "zero_stage",
                 "microbatches": "microbatches", "schedule": "schedule", "virtual_stages": "virtual",
                 "activation_checkpointing": "ac", "sequence_parallel": "sp", "dp_replicate": "dp_replicate",
                 "ep": "ep"}
"""The ``[parallel]`` keys auto sets -> the planner ``Layout`` attribute each takes (``ep`` only where
the config has it)."""


NO_CALIBRATION = ("no host calibration cached; run `meshtrain plan --cluster this-host ...` or `meshtrain bench "
                  "plan` once on this host to cache it")
"""Why a CPU run's check of the planner made no prediction."""


def cluster_for(device: str, cached: bool = False) -> Cluster:
    """The cluster the run's device is priced on: ``this-host`` for the CPU (with ``cached``, from
    its cached calibration only: ConfigError if there is none), else the GPU's preset."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        from .host import cached_this_host, this_host

        if not cached:
            return this_host()
        host = cached_this_host()
        if host is None:
            raise ConfigError(NO_CALIBRATION)
        return host
    name = torch.cuda.get_device_name(0)
    for marker, preset in DEVICE_PRESETS.items():
        if marker in name:
            return PRESETS[preset]
    raise ConfigError(f"no cluster preset prices a {name!r} (known: {', '.join(DEVICE_PRESETS)}); describe it in a "
                      f"cluster TOML for meshtrain plan --cluster FILE.toml")


def _fields(parallel: Any) -> dict[str, str]:
    """The ``LAYOUT_FIELDS`` this config's ``[parallel]`` section has."""
    return {key: attr for key, attr in LAYOUT_FIELDS.items() if hasattr(parallel, key)}


def _settings(pred: Prediction, parallel: Any) -> dict[str, Any]:
    return {key: getattr(pred.layout, attr) for key, attr in _fields(parallel).items()}


def choose_layout(config: Any, vocab_size: int, cluster: Cluster | None = None, top: int = 50) -> Prediction:
    """Set ``config.parallel``'s layout to the fastest layout the plan ranks that ``meshtrain train``
    accepts (and ``auto`` to false, so the run's saved config is the layout it ran); returns its
    prediction. ConfigError if none fits or passes the run's checks."""
    from ..config.check import model_config, validate

    p, t = config.parallel, config.train
    world = p.dp * p.tp * p.pp * p.cp
    if cluster is None:
        try:
            cluster = cluster_for(t.device)
        except ConfigError as e:
            raise ConfigError(f"parallel.auto = true: {e}; set the layout yourself (meshtrain plan --cluster "
                              f"FILE.toml --search suggests one) and parallel.auto = false") from None
    arch = from_llama_config(config.model.preset, model_config(config, vocab_size))
    # fp16 is priced as bf16: the same 2-byte activations and tensor-core peak (the planner has no fp16)
    fixed = {"precision": "bf16" if t.precision == "fp16" else t.precision, "compile": t.compile,
             "offload": getattr(p, "offload", "none")}  # the run's choice: priced, and ZeRO stages it needs
    if not hasattr(p, "ep"):  # a trainer without expert parallelism: price ep = 1 only
        fixed["ep"] = 1
    try:
        ranked = search(arch, cluster, world, t.global_batch, t.seq_len, fixed, top=top)
    finally:
        stop_profiling()  # this-host's profiling processes: not beside the run's ranks
    saved = {k: getattr(p, k) for k in _fields(p)}
    reasons: list[str] = []
    for pred in ranked:
        for key, value in _settings(pred, p).items():
            setattr(p, key, value)
        try:
            validate(config)
        except ConfigError as e:
            reasons.append(f"{pred.layout.label()}: {e}")
            continue
        p.auto = False
        return pred
    for key, value in saved.items():
        setattr(p, key, value)
    raise ConfigError(f"parallel.auto = true: none of the {len(ranked)} layouts the plan ranks for {world} ranks "
                      f"passes meshtrain train's checks (first: {reasons[0] if reasons else '-'}); set the layout "
                      f"yourself and parallel.auto = false")


def layout_of(config: Any) -> Layout:
    """The planner's ``Layout`` of a training config: its ``[parallel]`` settings (``LAYOUT_FIELDS``),
    precision (fp16 priced as bf16), compile and offload; uneven pipeline splits allowed, since
    meshtrain train runs them."""
    p, t = config.parallel, config.train
    values = {("sequence_parallel" if attr == "sp" else attr): getattr(p, key) for key, attr in _fields(p).items()}
    return Layout(**values, precision="bf16" if t.precision == "fp16" else t.precision, compile=t.compile,
                  offload=getattr(p, "offload", "none"), uneven=True)


def predict_run(config: Any, model_cfg: Any, device: str, profiled: bool = False) -> tuple[Prediction, Cluster]:
    """The planner's prediction of a training run's step on its own layout, model (``model_cfg``, a
    ``LlamaConfig``) and device, and the cluster it priced it on. Nothing is measured (a CPU host's
    cached calibration, ConfigError without one) unless ``profiled``: then a CPU run's blocks are
    timed at its shapes, as ``meshtrain bench plan`` times them (seconds; a GPU preset is analytic
    either way). ConfigError too where the planner cannot price it."""
    t = config.train
    profiling = profiled and device == "cpu"
    try:
        cluster = cluster_for(device, cached=not profiling)
        arch = from_llama_config(config.model.preset, model_cfg)
        return predict(arch, cluster, layout_of(config), t.global_batch, t.seq_len), cluster
    finally:
        if profiling:
            stop_profiling()  # the profiling copies: not left running beside what follows


def describe(pred: Prediction) -> str:
    """One line for the run's log: the chosen layout and what the plan predicts for it."""
    return (f"parallel.auto: {pred.layout.label()} (predicted {pred.step_time * 1e3:.1f} ms/step, "
            f"{pred.memory.total / 2**20:.0f} MiB/rank)")

