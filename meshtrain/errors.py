"""The one error hierarchy of meshtrain. Every message says what is wrong, with values, and the fix."""


class MeshtrainError(Exception):
    """Base class of every error meshtrain raises on purpose."""


class ConfigError(MeshtrainError, ValueError):
    """A configuration value is invalid; the message names the field and a valid value."""


class CollectiveError(MeshtrainError, RuntimeError):
    """A collective operation could not complete (a peer failed, the group was aborted, ...)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within the group's timeout; names the missing ranks."""


class CollectiveMismatch(CollectiveError):
    """Ranks called one collective with different operations, shapes or dtypes."""


class CheckpointError(MeshtrainError):
    """A checkpoint is missing, corrupt, or does not fit the model being loaded."""


class DataError(MeshtrainError):
    """Training data is missing, empty, or unreadable."""
