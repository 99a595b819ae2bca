"""meshtrain: distributed training for PyTorch on its own collective-communication library."""

__version__ = "0.1.0"
