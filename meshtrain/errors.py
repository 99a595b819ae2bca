"""The one error hierarchy of meshtrain. Every message says what is wrong, with values, and the fix."""


class MeshtrainError(Exception):
    """Base class of every error meshtrain raises on purpose."""


class ConfigError(MeshtrainError, ValueError):
    """A configuration value is invalid; the message names the field and a valid value."""


class CollectiveError(MeshtrainError, RuntimeError):
    """A collective operation could not complete (a peer failed, the group was aborted, ...)."""


class LaunchError(CollectiveError):
    """The launch settings cannot work (MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE, a rendezvous
    nobody serves, a port another program holds): bad input, found before any training."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within the group's timeout; names the missing ranks."""


class CollectiveMismatch(CollectiveError):
    """Ranks called one collective with different operations, shapes or dtypes."""


class CollectiveDeadlock(CollectiveError):
    """Every live rank is blocked in a collective waiting for a call another blocked rank has not
    reached (they called collectives in different orders); names each rank's call
    (``meshtrain/comm/deadlock.py``)."""


class CheckpointError(MeshtrainError):
    """A checkpoint is missing, corrupt, or does not fit the model being loaded."""


class DataError(MeshtrainError):
    """Training data is missing, empty, or unreadable."""


BAD_INPUT = frozenset({"ConfigError", "DataError", "CheckpointError", "ScheduleError", "TrainingDiverged",
                       "LaunchError"})
"""The errors (by class name, as a failed worker's message names them) that mean bad input: the
run exits 2 for them, and 1 for anything else (a lost peer, a crash), whichever launcher ran it."""


def exit_code(error: BaseException | str) -> int:
    """2 if ``error`` (an exception, or a class name) means bad input (``BAD_INPUT``), else 1."""
    if isinstance(error, str):
        return 2 if error in BAD_INPUT else 1
    return 2 if any(c.__name__ in BAD_INPUT for c in type(error).__mro__) else 1
