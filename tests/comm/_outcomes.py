"""Run named calls that should fail, recording each outcome and how long it took (in a rank)."""

from __future__ import annotations

import time
from typing import Callable


def outcomes(cases: dict[str, Callable[[], object]], errors: tuple[type[BaseException], ...]) -> dict:
    """``out[name]`` is ``"no error"`` or ``"<Class>: <message>"`` for one of ``errors`` (any other
    exception propagates); ``out[name + "_s"]`` is the seconds the call took."""
    out: dict = {}
    for name, call in cases.items():
        t0 = time.monotonic()
        try:
            call()
            out[name] = "no error"
        except errors as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        out[name + "_s"] = time.monotonic() - t0
    return out
