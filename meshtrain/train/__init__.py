"""Training: the configuration, the data (built-in corpus and user files), the tokenizer and its
cache, and the deterministic, resumable loader that feeds every layout the same global batches."""

from .config import (CheckpointSection, CommSection, Config, DataSection, ModelSection, ParallelSection,
                     TrainSection, load_config, model_config, parallel_config, resolve_out, to_dict, to_toml,
                     validate)
from .data import Corpus, builtin_corpus, open_corpus
from .loader import Batch, GlobalBatchLoader, dp_rows
from .tokenizer import Tokenizer, load_or_train_tokenizer, prepare_data, tokenize_corpus

__all__ = [
    "Config", "ModelSection", "ParallelSection", "TrainSection", "DataSection", "CheckpointSection",
    "CommSection", "load_config", "to_toml", "to_dict", "validate", "model_config", "parallel_config",
    "resolve_out", "Corpus", "builtin_corpus", "open_corpus", "Tokenizer", "load_or_train_tokenizer",
    "tokenize_corpus", "prepare_data", "Batch", "GlobalBatchLoader", "dp_rows",
]
