"""ZeRO CPU offload (ZeRO-Offload, Ren et al. 2021; FSDP's ``CPUOffload``): each ``FlatUnit``'s fp32
master shard and its optimizer state live in host memory, and the optimizer steps on the CPU.

What lives where (``ZeroModel(..., offload="optimizer" | "params")``):

* host: the fp32 master shard (``unit.master``: the tensor the torch optimizer steps, so its state
  is created beside it, on the host) and a buffer the shard gradient is copied into, both
  page-locked where CUDA is available, so that the copies are DMA transfers the host does not wait
  for. The optimizer's moments are plain host memory: they never cross the bus.
* device: the compute copy. Stages 1 and 2 keep the full parameters; ZeRO-3 keeps this rank's
  shard in the compute dtype to all-gather from ("optimizer"), or, with "params", nothing: each
  all-gather first copies the master shard over. The shard gradient stays on the device until the
  step (``FlatUnit.grad``): the reduce-scatters add into it, HSDP averages it, and fp16 unscaling,
  the global norm and clipping read and scale it there, so they need no host round trip and the
  optimizer reads exactly what they produced.

The step (``step_on_host``) is a pipeline over units. Every unit's gradient copy to the host is
queued at once; the CPU steps a unit as soon as its own copy has landed, while the later copies
are in flight; it then queues the copy of the updated master back to the device and, for stages 1
and 2, the unit's all-gather, which run while the CPU steps the next unit. The norm and the fp16
overflow verdict need every unit's gradient, so no unit could step before the backward ends: the
copies start at the step, once each, whatever the number of micro-batches.

Host or device is ``comm.device.on_host``'s answer for the compute device: host tensors are copied
synchronously (and the gradient is handed to the optimizer as it is); device copies are
non-blocking and ordered by events (``torch.get_device_module``: the same calls on any
accelerator), so the accelerator double of the tests runs this path on CPU.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..comm.device import on_host

if TYPE_CHECKING:
    from .flat_unit import FlatUnit


class UnitOffload:
    """One unit's host side: where its master shard lives, how its gradient reaches the host and how
    the updated master goes back to the device (see the module docstring)."""

    def __init__(self, mode: str, device: torch.device, param_dtype: torch.dtype) -> None:
        self.mode = mode
        """"optimizer" or "params"."""
        self.device = device
        """The compute device, where the full parameters and the shard gradient are."""
        self.on_host = on_host(device)
        self.param_dtype = param_dtype
        # page-locked memory needs CUDA; it only matters for copies to and from a device
        self.pin = not self.on_host and torch.cuda.is_available()
        self.grad: torch.Tensor | None = None
        """The fp32 shard gradient on the compute device (``FlatUnit.grad``)."""
        self.staging: torch.Tensor | None = None
        """Host buffer the gradient is copied into (device only; on the host it is used as is)."""
        self.shard: torch.Tensor | None = None
        """This rank's shard in the compute dtype on the device, the all-gather's input."""
        self._version: int | None = None  # the master's version counter when ``shard`` was copied
        self._copied: Any = None  # event: the last copy from the master has finished reading it

    def host_master(self, shard: torch.Tensor) -> torch.Tensor:
        """An fp32 host copy of ``shard`` (the initial master), pinned where that helps."""
        host = torch.empty(shard.shape, dtype=torch.float32, device="cpu", pin_memory=self.pin)
        host.copy_(shard)
        return host

    # -- parameters: host -> device --------------------------------------------------------------

    def compute_shard(self, master: torch.Tensor) -> torch.Tensor:
        """The shard to all-gather from: "optimizer" keeps one and copies the master again only if
        it changed since (a checkpoint load writes it in place); "params" copies it every time."""
        if self.mode == "params" or self.shard is None or self._version != master._version:
            self.upload(master)
        assert self.shard is not None
        return self.shard

    def upload(self, master: torch.Tensor) -> None:
        """Queue the copy of the (updated) master into the device shard, cast to the compute dtype
        on the way; non-blocking from pinned memory, so the CPU goes on with the next unit."""
        if self.shard is None or self.mode == "params":
            self.shard = torch.empty(master.shape, dtype=self.param_dtype, device=self.device)
        self.shard.copy_(master.detach(), non_blocking=not self.on_host)
        self._copied = None if self.on_host else self._event()
        # fused optimizers write without bumping the version counter: the step uploads explicitly,
        # and this catches in-place writes through views (checkpoint loads) between steps
        self._version = master._version

    def gathered(self) -> None:
        """The all-gather is done: "params" keeps no shard on the device."""
        if self.mode == "params":
            self.shard = None

    def wait_copied(self) -> None:
        """Block until the last copy out of the master has read it (before the CPU writes it)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    # -- gradients: device -> host ---------------------------------------------------------------

    def grad_to_host(self) -> Any:
        """Queue the copy of the shard gradient to the host; returns what to wait on (None: ready)."""
        assert self.grad is not None
        if self.on_host:
            return None
        if self.staging is None:
            self.staging = torch.empty(self.grad.shape, dtype=torch.float32, device="cpu", pin_memory=self.pin)
        self.staging.copy_(self.grad, non_blocking=True)
        return self._event()

    def host_grad(self) -> torch.Tensor:
        """The gradient the host optimizer reads (after ``grad_to_host``'s copy has landed)."""
        out = self.grad if self.on_host else self.staging
        assert out is not None
        return out

    def _event(self) -> Any:
        """An event recorded on the compute device's current stream, after the copies just queued."""
        mod = torch.get_device_module(self.device)
        event = mod.Event()
        event.record(mod.current_stream(self.device))
        return event


def host_optimizer(optimizer_cls: type[torch.optim.Optimizer], params: list[torch.Tensor],
                   kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """``optimizer_cls`` over host tensors. Unless the caller chose ``foreach`` or ``fused=False``,
    fused where torch has a CPU kernel for it: AdamW's is one multi-threaded pass over the shard,
    6x its foreach form and 10x its per-tensor loop on one core here (1.5 G parameters/s, against
    0.25 and 0.16); else foreach."""
    kw = dict(kwargs)
    if "foreach" not in kw and kw.get("fused", True) and "fused" in inspect.signature(optimizer_cls).parameters:
        kw["fused"] = True
    try:
        return optimizer_cls(params, **kw)
    except RuntimeError:  # this torch has no CPU kernel of the fused form
        if not kw.pop("fused", False):
            raise
        return optimizer_cls(params, foreach=True, **kw)


def step_on_host(optimizer: torch.optim.Optimizer, units: Iterable["FlatUnit"], refresh: bool) -> None:
    """One optimizer step of offloaded units, pipelined (module docstring): all gradient copies
    queued, then each unit stepped on the CPU once its copy has landed, its master copied back and,
    with ``refresh`` (stages 1, 2), its full parameters all-gathered; returns when every copy and
    gather is done. Units without a gradient are not stepped, as a torch optimizer skips them."""
    pending = [(u, u.offload.grad_to_host()) for u in units if u.offload is not None and u.grad is not None]
    for u, copied in pending:
        if copied is not None:
            copied.synchronize()  # this unit's gradient only: the later copies go on
        u.offload.wait_copied()
        u.master.grad = u.offload.host_grad()
        try:
            optimizer.step()  # steps only the masters with a gradient: this unit's
        finally:
            u.master.grad = None
        if u.offload.mode == "optimizer":
            u.offload.upload(u.master)
        if refresh:
            u.refresh(async_op=True)
    for u, _ in pending:
        if refresh:
            u.wait_gathered()
        u.offload.wait_copied()  # the CPU may write the masters again (next step, a load)
