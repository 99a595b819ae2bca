"""The trainer's optimizer step, with fp16 dynamic loss scaling when the run asks for it.

``measure_step`` runs forward and backward of one global batch and readies the gradients: under
fp16 the loss is multiplied by the scaler's scale, then every rank divides what it holds by it (a
ZeRO rank its shards) and the ranks agree on whether any of them saw inf/NaN (one all-reduce max
over the world); then the global norm is clipped. Loss, norm and the verdict reach the host in one
read. ``apply_step`` then steps the optimizer, or, after an overflow anywhere, skips the step on
every rank (GradScaler's rule: weights and optimizer state untouched, gradients dropped, the scale
backed off). A skipped step still consumes its step number: the trainer takes its batch and sets
its learning rate as for any step, so the schedule advances as it does under GradScaler in a loop
that steps its LR scheduler every iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..parallel.parallel_model import ParallelModel, ParallelOptimizer
from ..parallel.precision import DynamicLossScaler


@dataclass
class StepResult:
    """What one step measured (the same on every rank)."""

    loss: float
    """The global mean loss (unscaled)."""
    grad_norm: float
    """The global gradient norm before clipping (unscaled); NaN when ``overflow`` (a rank's own
    measure then depends on where the inf/NaN lies)."""
    overflow: bool = False
    """fp16: some rank's gradients held inf/NaN, so the step is skipped on every rank."""
    loss_scale: float | None = None
    """fp16: the scale this step's backward ran with; None without loss scaling."""
    stop: int = 0
    """The agreed stop flag that rode this step's read (``measure_step``'s ``stop_flag``; 0: none)."""


def measure_step(model: ParallelModel, opt: ParallelOptimizer, inputs: torch.Tensor, targets: torch.Tensor,
                 grad_clip: float, scaler: DynamicLossScaler | None = None,
                 stop_flag: torch.Tensor | None = None) -> StepResult:
    """Forward and backward of one global batch, unscaling and the agreed overflow verdict
    (``scaler``: fp16), then clipping to ``grad_clip`` (0: measure only); one host read, which
    also brings ``stop_flag`` (a one-element tensor the ranks already all-reduced: the stop
    ``interrupt.py`` asks for) to the host. Collective over the world."""
    scale = scaler.scale if scaler is not None else 1.0
    loss_t = model.forward_backward(inputs, targets, loss_scale=scale)
    found = opt.unscale_(scaler) if scaler is not None else None  # before the clip: it reads true norms
    norm_t = opt.clip_grad_norm_(grad_clip)
    values = [loss_t.double(), norm_t.double()] + ([found.double().reshape(())] if found is not None else [])
    if stop_flag is not None:
        values.append(stop_flag.to(loss_t.device, torch.float64).reshape(()))
    read = torch.stack(values).tolist()  # the step's one host read (a device sync on a GPU)
    stop = int(read.pop()) if stop_flag is not None else 0
    loss, norm, *flag = read
    overflow = bool(flag and flag[0] > 0)
    return StepResult(loss, math.nan if overflow else norm, overflow, scale if scaler is not None else None, stop)


def apply_step(opt: ParallelOptimizer, result: StepResult, scaler: DynamicLossScaler | None = None) -> None:
    """The optimizer step, skipped after an overflow (then the scaler backs off; every rank does
    the same, from the agreed verdict); the gradients are dropped either way."""
    if scaler is None or scaler.update(result.overflow):
        opt.step()
    opt.zero_grad()


__all__ = ["StepResult", "measure_step", "apply_step"]
