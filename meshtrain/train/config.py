"""The training configuration, re-exported from the torch-free ``meshtrain.config`` package.

The sections live in ``meshtrain/config/schema.py``, loading, overrides and TOML in ``loading.py``,
the checks in ``check.py``. This module keeps the names the trainer, the CLI and existing code
import from here (``from meshtrain.train.config import load_config``). Importing it runs
``meshtrain.train``'s package init, which imports torch; import ``meshtrain.config`` to avoid that.
"""

from __future__ import annotations

from ..config.check import model_config, parallel_config, validate
from ..config.loading import apply_overrides, from_dict, load_config, parse_value, resolve_out, to_dict, to_toml
from ..config.schema import (BACKENDS, DEVICES, PRECISIONS, SECTIONS, TOP_LEVEL, CheckpointSection, CommSection,
                             Config, DataSection, ElasticSection, ModelSection, ParallelSection, TrainSection,
                             all_keys, field_docs, transports)
from ..config.schema import unknown as _unknown  # noqa: F401 (the name config_check.py imported)



__all__ = [
    "Config", "ModelSection", "ParallelSection", "TrainSection", "DataSection", "CheckpointSection",
    "CommSection", "ElasticSection", "load_config", "apply_overrides", "from_dict", "to_dict", "to_toml", "validate",
    "model_config", "parallel_config", "resolve_out", "field_docs", "all_keys", "parse_value",
    "SECTIONS", "TOP_LEVEL", "PRECISIONS", "DEVICES", "transports", "BACKENDS",
]
