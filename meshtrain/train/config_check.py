"""The config checks, re-exported from ``meshtrain/config/check.py`` (their one home) for the code
that imports them from here: the trainer's ``check_algorithm``, the tests' ``TRAINING_OPS``."""

from __future__ import annotations

from ..config.check import (TRAINING_OPS, check_algorithm, model_config, parallel_config, training_algorithms,
                            transport_kinds, validate)

__all__ = ["TRAINING_OPS", "check_algorithm", "model_config", "parallel_config", "training_algorithms",
           "transport_kinds", "validate"]
