"""``meshtrain plan``: predict step time, memory and MFU of a (dp, pp, cp, tp) layout (with expert
parallelism ep for mixture-of-experts models) on a cluster, and search for the fastest layout that fits.

Modules, in the order a prediction uses them: ``architectures`` (model shapes: meshtrain's presets
plus published Llama-3 / GPT-3 / MPT / Qwen3-MoE / DeepSeek-V3 shapes), ``clusters`` (GPU presets, a TOML
file, or this host calibrated), ``layout`` (a layout and its validation), ``compute`` (per-layer
roofline), ``collectives`` (alpha-beta times of the collectives the comm library's ``auto`` would
pick), ``moe`` (the experts' parameters, work and ep all-to-alls), ``memory`` (bytes per rank),
``step`` (one step's time split into compute, exposed communication per dimension and pipeline
bubble), ``search`` (enumerate and rank layouts), ``report`` (table,
JSON, PNG), ``published`` (the validation set: ``published_run`` the row and its check,
``published_torchtitan`` / ``published_mosaic`` / ``published_megatron`` the runs by source) and ``cli``.
"""

from .architectures import Arch, resolve_model
from .clusters import Cluster, resolve_cluster
from .layout import Layout, parse_layout
from .step import Prediction, predict
from .search import search

__all__ = ["Arch", "Cluster", "Layout", "Prediction", "parse_layout", "predict", "resolve_cluster",
           "resolve_model", "search"]
