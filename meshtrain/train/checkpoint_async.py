"""Checkpoints that overlap training: the collective parts of a save run on the training thread at
the save (and at the next save or the end of the run), the file writing on a background thread.

``begin_save`` snapshots this rank's tensors (a copy, so the optimizer may change the parameters
meanwhile) and makes the temporary directory; the shard file is written in the background; the
next ``save`` or ``wait`` joins it and commits (metadata.json, rename, ``latest``). Every rank
issues the same collectives at the same steps, so nothing can cross. Until the commit the save is
a ``.tmp`` directory that loading ignores, so a crash mid-write loses only that checkpoint.
"""

from __future__ import annotations

import threading
from typing import Any

from ..parallel.parallel_model import ParallelModel, ParallelOptimizer
from .checkpoint import PendingSave, begin_save, save_checkpoint


class CheckpointSaver:
    """Saves synchronously, or with ``async_save`` in the background (one save in flight)."""

    def __init__(self, async_save: bool = False) -> None:
        self.async_save = async_save
        self._pending: PendingSave | None = None
        self._thread: threading.Thread | None = None

    def save(self, root: str, step: int, model: ParallelModel, optimizer: ParallelOptimizer | None,
             extra: dict[str, Any], keep: int) -> None:
        """Start (async) or do (sync) a save; a previous async save is committed first. Collective."""
        self.wait()
        if not self.async_save:
            save_checkpoint(root, step, model, optimizer, extra, keep)
            return
        self._pending = begin_save(root, step, model, optimizer, extra, keep, snapshot=True)
        self._thread = threading.Thread(target=self._pending.write, name="meshtrain-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> str | None:
        """Finish the save in flight, if any (collective); returns its directory."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        assert self._thread is not None
        self._thread.join()
        return pending.finish()
