"""Mixed precision: the compute / reduction dtypes, and dynamic loss scaling for fp16."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .. import comm
from ..comm import Group


@dataclass
class MixedPrecision:
    """Dtypes of a ZeRO model; the optimizer always keeps fp32 master weights."""

    param_dtype: torch.dtype = torch.float32
    """Dtype of the parameters during forward and backward (bf16 or fp16 for mixed precision)."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype in which gradients are reduced across ranks (fp32, or the compute dtype to halve bytes)."""
    output_dtype: torch.dtype | None = None
    """Cast floating-point outputs of the model to this dtype (e.g. fp32 logits for the loss)."""
    buffer_dtype: torch.dtype | None = None
    """Dtype of floating-point buffers during compute (None: ``param_dtype``)."""

    def __post_init__(self) -> None:
        ok = (torch.float32, torch.bfloat16, torch.float16)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in ok:
                raise ValueError(f"MixedPrecision.{name} must be one of {ok}, got {getattr(self, name)}")


class DynamicLossScaler:
    """Dynamic loss scaling for fp16, as ``torch.amp.GradScaler`` and DeepSpeed's ``loss_scale: 0``:
    backward runs on ``loss * scale``; before the step the gradients are divided by ``scale`` and
    checked for inf/NaN, and the ranks agree on the verdict (one all-reduce max); an overflow
    anywhere skips the step on every rank and multiplies the scale by ``backoff``, and
    ``growth_interval`` clean steps in a row multiply it by ``growth``. The scale is a host float:
    the verdict reaches the host in the trainer's one read per step, so updating it costs no sync."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000,
                 backoff: float = 0.5, growth: float = 2.0, min_scale: float = 1.0) -> None:
        self.scale = float(init_scale)
        """The factor the next backward's loss is multiplied by."""
        self.growth_interval = growth_interval
        self.backoff, self.growth, self.min_scale = backoff, growth, min_scale
        self.good_steps = 0
        """Clean steps since the last overflow or growth."""
        self.skipped = 0
        """Steps skipped for an overflow so far."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on."""
        return loss * self.scale

    def unscale_(self, grads: Iterable[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
        """Divide ``grads`` (what this rank holds) by the scale in place; return this rank's
        overflow flag, a float32 tensor of one element (1: some gradient is inf/NaN), on the
        gradients' device (``device`` if there are none). GradScaler's fused kernel, one launch
        per (device, dtype); no host read."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        device = next(iter(by_kind))[0] if by_kind else (device or torch.device("cpu"))
        found = torch.zeros(1, dtype=torch.float32, device=device)
        for (dev, _), gs in by_kind.items():
            flag = torch.zeros(1, dtype=torch.float32, device=dev)
            # the reciprocal in float64, then float32, as GradScaler computes it: the same bits
            inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(gs, flag, inv)
            found = torch.maximum(found, flag.to(device))
        return found

    @staticmethod
    def agree(found: torch.Tensor, group: Group | None) -> torch.Tensor:
        """The overflow flag of every rank of ``group`` (all-reduce max, in place): ranks that
        skip alone would leave the others waiting in the next collective, or diverge."""
        if group is not None and group.size > 1:
            comm.all_reduce(found, op="max", group=group)
        return found

    def update(self, overflow: bool) -> bool:
        """Record one step's agreed verdict; return whether the optimizer may step. An overflow
        backs the scale off (not below ``min_scale``) and restarts the count of clean steps."""
        if overflow:
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0
        return True

    def unscale_and_check(self, params: Iterable[Any], group: Group | None = None) -> bool:
        """Unscale the gradients of ``params`` (parameters, or anything with a ``.grad``: ZeRO's
        ``FlatUnit``s), agree over ``group`` and update (one host read); return False (skip the
        step) if any rank overflowed."""
        found = self.agree(self.unscale_([p.grad for p in params if p.grad is not None]), group)
        return self.update(bool(found.item()))

    def state_dict(self) -> dict[str, float | int]:
        """The scale and step counts (equal on every rank), for a checkpoint."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore what ``state_dict`` returned."""
        self.scale = float(state["scale"])
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])
