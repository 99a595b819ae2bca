"""One engine that executes any pipeline schedule (a list of actions per rank, see ``schedule.py``).

For F(mb, s) the stage's input is the micro-batch's tokens (first stage) or the activation received
from the rank of stage s-1; its output is sent on, or, on the last stage, turned into the loss. For
B(mb, s) the output's gradient comes from stage s+1 (or the loss itself), and the input's gradient
goes back to stage s-1. A message is a small header (dtype, shape) and then the tensor, so
stages need not agree on shapes in advance; given a step signature, later steps with the same one
skip the header (no host read of it: on a GPU, no sync). A micro-batch's activations are dropped as soon as its
backward has run; saved-tensor hooks count the bytes each in-flight micro-batch holds.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ... import comm
from ...comm import Group, Work
from ...errors import CollectiveError
from .schedule import Action

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER = 8  # dtype code, ndim, then up to 6 dims
_ACT, _GRAD = 0, 1
_KINDS = ("activation", "gradient")


@dataclass
class StepStats:
    """What one pipeline step measured on this rank."""

    events: list[dict[str, Any]] = field(default_factory=list)
    """(kind, microbatch, stage, start, end) of every action, ``time.perf_counter()`` seconds (one
    clock for all ranks of a host). An action starts once its input has arrived: waiting is idle."""
    peak_activation_bytes: int = 0
    """Most bytes held at once by autograd for micro-batches whose backward had not run."""


class _Meter:
    """Counts bytes saved for backward (not parameters) while a forward runs."""

    def __init__(self, params: set[int]) -> None:
        self.params, self.bytes = params, 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self.params and not isinstance(t, nn.Parameter):
            self.bytes += t.numel() * t.element_size()
        return t


def _pending(works: list[Work]) -> list[Work]:
    """Drop finished sends, raising a failed one's error (a peer that died, a timeout)."""
    for w in works:
        if w.is_completed() and w.exception() is not None:
            raise w.exception()
    return [w for w in works if not w.is_completed()]


class PipelineEngine:
    """Runs this rank's actions of a schedule over its stage modules.

    ``stages`` maps global (virtual) stage ids to modules; ``rank_of_stage(s)`` is the global rank
    that runs stage s; ``loss_fn(output, target)`` gives the loss of one micro-batch on the last
    stage, already scaled so that summing over micro-batches gives the step's loss.
    """

    def __init__(self, stages: dict[int, nn.Module], n_stages: int, rank_of_stage: Callable[[int], int],
                 pp_group: Group, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 autocast_dtype: torch.dtype | None = None) -> None:
        self.stages, self.n_stages = stages, n_stages
        self.rank_of_stage, self.group, self.loss_fn = rank_of_stage, pp_group, loss_fn
        self._params = {id(p) for m in stages.values() for p in m.parameters()}
        # messages, buffers and the loss live where the parameters do (a CUDA stage talks in CUDA tensors)
        self.device = next((p.device for m in stages.values() for p in m.parameters()), torch.device("cpu"))
        self.autocast_dtype = autocast_dtype
        # (signature, kind, micro-batch, sending stage) -> (dtype, shape) of messages already described
        self._signature: Any = None
        self._sent: dict[tuple, tuple[torch.dtype, torch.Size]] = {}
        self._received: dict[tuple, tuple[torch.dtype, torch.Size]] = {}
        """Forwards run under ``torch.autocast`` to this dtype (bf16 mixed precision; parameters,
        gradients and the optimizer stay fp32); None: no autocast."""

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # -- messages --------------------------------------------------------------------------------

    def _tag(self, kind: int, mb: int, stage: int) -> int:
        return (mb * self.n_stages + stage) * 2 + kind

    def _send(self, t: torch.Tensor, dst_stage: int, kind: int, mb: int, stage: int, works: list[Work]) -> None:
        t = t.detach().contiguous()
        dst, tag = self.rank_of_stage(dst_stage), self._tag(kind, mb, stage)
        key = (self._signature, kind, mb, stage)
        known = self._sent.get(key) if self._signature is not None else None
        if known is None:
            # built on the host, sent from the data's device (NCCL carries device tensors only)
            header = torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_HEADER - 2 - t.dim()),
                                  dtype=torch.int64).to(t.device)
            works.append(comm.isend(header, dst, group=self.group, tag=tag))
            if self._signature is not None:
                self._sent[key] = (t.dtype, t.shape)
        elif known != (t.dtype, t.shape):
            raise RuntimeError(f"pipeline stage {stage} sends a {t.dtype} {tuple(t.shape)} {_KINDS[kind]} for "
                               f"micro-batch {mb} where an earlier step with the same signature "
                               f"{self._signature!r} sent {known[0]} {tuple(known[1])}: the signature passed to "
                               f"run() must determine every message's shape")
        works.append(comm.isend(t, dst, group=self.group, tag=tag))

    def _recv(self, src_stage: int, kind: int, mb: int, stage: int) -> torch.Tensor:
        src, tag = self.rank_of_stage(src_stage), self._tag(kind, mb, stage)
        key = (self._signature, kind, mb, stage)
        try:
            known = self._received.get(key) if self._signature is not None else None
            if known is None:
                header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
                comm.recv(header, src, group=self.group, tag=tag)
                code, ndim, *dims = header.tolist()  # a host read (a GPU sync): first step of a signature only
                known = (_DTYPES[code], torch.Size(dims[:ndim]))
                if self._signature is not None:
                    self._received[key] = known
            out = torch.empty(known[1], dtype=known[0], device=self.device)
            comm.recv(out, src, group=self.group, tag=tag)
        except CollectiveError as exc:
            # name the pipeline's view of it: which stage waited for what, from whom
            me = self.rank_of_stage(stage + 1 if kind == _ACT else stage - 1)
            # a copy keeps the error's type and fields (PeerDied's ``missing``), with the message replaced
            named = copy.copy(exc)
            named.args = (f"pipeline stage {stage + 1 if kind == _ACT else stage - 1} (rank {me}) waited for "
                          f"the {_KINDS[kind]} of micro-batch {mb} from stage {src_stage} (rank {src}), which "
                          f"did not send it: {exc}",)
            raise named from exc
        return out

    # -- the step --------------------------------------------------------------------------------

    def run(self, actions: list[Action], inputs: list[Any], targets: list[torch.Tensor],
            forward_kwargs: dict[str, Any] | None = None, signature: Any = None,
            loss_scale: float = 1.0) -> tuple[torch.Tensor, StepStats]:
        """Execute ``actions``; ``inputs[mb]``/``targets[mb]`` are used by the first/last stage.
        Returns the sum of the micro-batch losses computed here (zero off the last stage).

        ``signature``: a value equal on every rank that fixes every message's dtype and shape (the
        trainer passes the batch shape). Messages then carry their (dtype, shape) header only in
        the first step with that signature; later steps allocate from it without a host read.
        None: every message carries its header.

        ``loss_scale``: backward runs on each micro-batch's loss times this (fp16 loss scaling;
        the returned loss is unscaled), so every gradient, sent between stages too, is scaled."""
        kw = forward_kwargs or {}
        self._signature = signature
        last = self.n_stages - 1
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor, int]] = {}
        remaining_b = {s: sum(1 for a in actions if a.kind == "B" and a.stage == s) for s in self.stages}
        works: list[Work] = []
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        stats, held = StepStats(), 0
        for a in actions:
            module = self.stages[a.stage]
            if a.kind == "F":
                if a.stage == 0:
                    x, inp = inputs[a.microbatch], None
                else:
                    inp = self._recv(a.stage - 1, _ACT, a.microbatch, a.stage - 1).requires_grad_()
                    x = inp
                start = time.perf_counter()
                meter = _Meter(self._params)
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t), self._autocast():
                    out = module(x, **kw)
                    if a.stage == last:
                        out = self.loss_fn(out, targets[a.microbatch])
                        loss_sum = loss_sum + out.detach().float()
                if a.stage != last:
                    self._send(out, a.stage + 1, _ACT, a.microbatch, a.stage, works)
                saved[(a.microbatch, a.stage)] = (inp, out, meter.bytes)
                held += meter.bytes
                stats.peak_activation_bytes = max(stats.peak_activation_bytes, held)
            else:
                inp, out, nbytes = saved.pop((a.microbatch, a.stage))
                grad = None if a.stage == last else self._recv(a.stage + 1, _GRAD, a.microbatch, a.stage + 1)
                start = time.perf_counter()
                remaining_b[a.stage] -= 1
                # data-parallel modules reduce gradients only in the stage's last backward of the step
                sync = remaining_b[a.stage] == 0 or not hasattr(module, "no_sync")
                if a.stage == last and loss_scale != 1.0:
                    out = out * loss_scale
                with contextlib.nullcontext() if sync else module.no_sync():
                    torch.autograd.backward(out, grad)
                if a.stage != 0:
                    self._send(inp.grad, a.stage - 1, _GRAD, a.microbatch, a.stage, works)
                del inp, out
                held -= nbytes
            stats.events.append({"kind": a.kind, "microbatch": a.microbatch, "stage": a.stage,
                                 "start": start, "end": time.perf_counter()})
            works = _pending(works)
        for w in works:
            w.wait()
        if saved:
            raise RuntimeError(f"pipeline schedule left micro-batches without backward: {sorted(saved)}")
        return loss_sum, stats
