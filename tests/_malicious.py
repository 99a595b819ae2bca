"""A pickle whose loading leaves a mark: the proof, for the tests that plant one, that a loader
unpickled something."""

from __future__ import annotations

import os
import pickle


class _Evil:
    """Unpickling this creates the directory ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def evil_pickle(marker: str) -> bytes:
    """Pickle bytes that create the directory ``marker`` when loaded."""
    return pickle.dumps(_Evil(marker))
