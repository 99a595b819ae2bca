"""A test double of an accelerator for CPU CI: CPU tensors take the branches of meshtrain that a
device (CUDA) tensor takes, in the threads a device run uses.

A GPU run differs from a CPU run in two ways that CPU tests otherwise never see:

* every ``on_host`` branch (``meshtrain.comm.device``) goes the device way;
* autograd runs the backward of a device graph on a thread of its own, which has no communicator
  bound, so collectives issued from backward hooks (ZeRO, tensor parallelism) and from
  DataParallel's bucket worker run in threads that ``comm.current()`` knows nothing about.

``as_accelerator(monkeypatch)`` makes both true on the CPU until the test ends.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest
import torch

from meshtrain.bench.loop import _in_a_thread
from meshtrain.comm import call, device

BACKWARD_THREAD = "autograd-device"
"""The name of the thread every backward runs on under ``as_accelerator``."""


def as_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the test ends, no tensor is on the host and every backward runs on a fresh thread
    without a communicator, as autograd's device thread does on a GPU (the caller waits)."""
    monkeypatch.setattr(device, "HOST_DEVICE_TYPES", frozenset())
    real = torch.autograd.backward  # Tensor.backward calls it too

    def backward(*args: Any, **kwargs: Any) -> None:
        _in_a_thread(functools.partial(real, *args, **kwargs), name=BACKWARD_THREAD)

    monkeypatch.setattr(torch.autograd, "backward", backward)


def device_check_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads in which comm's check of a device tensor ran, appended as it runs."""
    seen: list[str] = []
    real = call._check_device

    def spy(*args: Any, **kwargs: Any) -> None:
        seen.append(threading.current_thread().name)
        real(*args, **kwargs)

    monkeypatch.setattr(call, "_check_device", spy)
    return seen
