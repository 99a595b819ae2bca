"""Mixed precision: the compute / reduction dtypes, and dynamic loss scaling for fp16."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

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
    """Loss scaling for fp16: multiply the loss by ``scale``; before a step, unscale the gradients
    and skip the step if any rank of the group saw inf/NaN (then halve the scale); after
    ``growth_interval`` good steps in a row, double it. All ranks agree through one all-reduce."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000,
                 backoff: float = 0.5, growth: float = 2.0, min_scale: float = 1.0) -> None:
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.backoff, self.growth, self.min_scale = backoff, growth, min_scale
        self._good = 0
        self.skipped = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on."""
        return loss * self.scale

    def unscale_and_check(self, params: Iterable[torch.Tensor], group: Group | None = None) -> bool:
        """Divide the gradients by the scale; return False (and back off) if any rank overflowed."""
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        bad = torch.zeros(1, device=device)
        for g in grads:  # flags accumulate on the device: one host read below, not one per gradient
            g.div_(self.scale)
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        if group is not None and group.size > 1:
            comm.all_reduce(bad, op="max", group=group)
        if bad.item() > 0:  # the one host read (every rank must agree on skipping the step)
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self._good = 0
            self.skipped += 1
            return False
        self._good += 1
        if self._good % self.growth_interval == 0:
            self.scale *= self.growth
        return True
