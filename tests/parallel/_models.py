"""Small models, data and a single-process reference trainer for the parallelism tests."""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import nn


class Net(nn.Module):
    """An MLP with odd-sized layers (buckets split it in odd places), a buffer, and optionally a
    branch that never takes part in the loss."""

    def __init__(self, unused: bool = False, width: int = 37) -> None:
        super().__init__()
        self.inp = nn.Linear(11, width)
        self.mid = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 23))
        self.out = nn.Linear(23, 5)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 11))
        self.dead = nn.Linear(7, 3) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x + self.shift)))))


_INIT_LOCK = threading.Lock()


def make_model(seed: int = 0, **kw) -> Net:
    """A Net initialised from ``seed``. Ranks that are threads share torch's global generator,
    so seeding and initialising must not interleave with another rank's."""
    with _INIT_LOCK:
        torch.manual_seed(seed)
        return Net(**kw)


def batches(steps: int, global_batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, 11, generator=g), torch.randn(global_batch, 5, generator=g))
            for _ in range(steps)]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def make_opt(params, kind: str = "adamw") -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference(steps: int, global_batch: int, opt: str = "adamw", micro: int = 1, clip: float | None = None,
              **kw) -> dict[str, torch.Tensor]:
    """Parameters after ``steps`` of single-process training on the global batch."""
    model = make_model(**kw)
    o = make_opt(model.parameters(), opt)
    for x, y in batches(steps, global_batch):
        o.zero_grad()
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            (loss_fn(model, xm, ym) / micro).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        o.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous share of a global batch."""
    return t.chunk(world)[rank]


def assert_close_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-6,
                       prefix: Callable[[str], str] = lambda k: k) -> None:
    assert set(map(prefix, got)) == set(want), (sorted(got), sorted(want))
    for k, v in got.items():
        torch.testing.assert_close(v, want[prefix(k)], atol=atol, rtol=1e-5, msg=lambda m: f"{k}: {m}")
