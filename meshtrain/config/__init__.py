"""The training configuration, importable without torch.

- ``model.py``: ``LlamaConfig`` and its ``PRESETS`` (re-exported by ``meshtrain.models.llama``);
- ``parallel.py``: ``ParallelConfig`` and its checks (re-exported by ``meshtrain.parallel.parallelize``);
- ``schema.py``: the sections of a run's config, ``[model]`` and ``[parallel]`` derived from the two;
- ``loading.py``: TOML files, ``--section.key=value`` overrides, ``--print-config``'s TOML;
- ``check.py``: ``validate`` and the model / parallel configs of a run.

``meshtrain.train.config`` re-exports all of it for the trainer and the CLI. Dependencies run one
way, model / parallel <- schema <- check <- loading, so no module here imports another in a cycle.
"""

from .check import model_config, parallel_config, validate
from .loading import apply_overrides, from_dict, load_config, parse_value, resolve_out, to_dict, to_toml
from .model import PRESETS, LlamaConfig
from .parallel import ParallelConfig
from .schema import (CheckpointSection, CommSection, Config, DataSection, ElasticSection, ModelSection,
                     ParallelSection, TrainSection, all_keys, field_docs)

__all__ = [
    "Config", "ModelSection", "ParallelSection", "TrainSection", "DataSection", "CheckpointSection",
    "CommSection", "ElasticSection", "load_config", "apply_overrides", "from_dict", "to_dict", "to_toml", "validate",
    "model_config", "parallel_config", "resolve_out", "field_docs", "all_keys", "parse_value",
    "LlamaConfig", "PRESETS", "ParallelConfig",
]
