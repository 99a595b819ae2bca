"""``not_compiled``: ``torch.compiler.disable`` for the helpers that call the communicator, without
importing torch's compiler front end (``torch._dynamo``) at import time.

``torch.compiler.disable`` imports ``torch._dynamo``, about a second of CPU per process, which every
worker of every run paid at import although most runs never compile. Here a decorated function is
a forwarder whose target becomes the ``torch.compiler.disable``d function once something may
compile: ``prepare()`` (called by ``apply_compile`` before ``torch.compile``), or the first call
made after ``torch._dynamo`` was imported by anyone (a program compiling meshtrain's layers itself).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable

import torch

_PENDING: "weakref.WeakSet[_Forwarder]" = weakref.WeakSet()  # weak: helpers made per step die with their step


class _Forwarder:
    """Calls ``target``: the function itself until ``prepare()``, then its disabled twin."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = self.target = fn
        functools.update_wrapper(self, fn)  # name, docstring, __wrapped__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.target is self.fn and "torch._dynamo" in sys.modules:
            self.disable()  # someone may be compiling: from here on, dynamo must see the disabled twin
        return self.target(*args, **kwargs)

    def disable(self) -> None:
        """Forward to the ``torch.compiler.disable``d function from now on."""
        self.target = torch.compiler.disable(self.fn)
        _PENDING.discard(self)


def not_compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)``, deferred until something may compile (see the module)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(fn)
    forwarder = _Forwarder(fn)
    _PENDING.add(forwarder)
    return forwarder


def prepare() -> None:
    """Make every deferred function its ``torch.compiler.disable``d twin (imports torch._dynamo)."""
    for forwarder in list(_PENDING):
        forwarder.disable()
