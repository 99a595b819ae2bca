"""FlatUnit: a set of parameters flattened into one buffer and sharded evenly over a group.

This is ZeRO's (and FSDP's FlatParameter's) unit of communication. Rank r of the group owns
elements [r*S, (r+1)*S) of the flat buffer, padded with zeros to a multiple of the group size. It
keeps an fp32 ``master`` copy of its shard for the optimizer. The full buffer (``full``, in the
compute dtype) holds the parameters as views. For ZeRO-3 it exists only between ``gather`` and
``free``: freeing resizes its storage to zero, so the views and the tensors that autograd saved
stay valid and see the data again after the next gather. With CPU offload (``offload.py``) the
master lives in host memory and ``grad``, the shard gradient, stays on the compute device.

ZeRO-1/2 in fp32 keep ``full`` allocated, so there the master is not a copy but ``full``'s own
slice: the optimizer updates the parameters in place, and the all-gather that refreshes ``full``
takes its input from the output's own block (every ``meshtrain.comm`` all-gather runs in place).
ZeRO-1 keeps the full gradient buffer too, and with fp32 reductions the shard gradient is that
buffer's own slice (``grad_in_full``). Half-precision ``full``, offload and ZeRO-3 keep copies.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import comm
from ..comm import Group, Work
from .offload import UnitOffload


class FlatUnit:
    """One shard-able block of parameters (see the module docstring)."""

    def __init__(self, index: int, named: list[tuple[str, nn.Parameter]], group: Group,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None, *,
                 replicas: Group | None = None, scale: float = 1.0, view: str | None = None,
                 offload: str = "none", stage: int = 3) -> None:
        """``stage``: the ZeRO stage; 1 and 2 never free ``full`` (module docstring)."""
        self.index = index
        self.group = group
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        """HSDP: the ranks holding copies of this rank's shard; the shard gradient is averaged over them."""
        self.scale = scale
        """What the averaged gradient is multiplied by (``grad_groups.ReduceGroup.scale``)."""
        self.view = view
        """The mesh view of ``group`` (the axes along which ranks hold different shards), if known."""
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        world = max(group.size, 1)
        self.shard_size = math.ceil(total / world) if total else 0
        self.padded = self.shard_size * world
        rank = max(group.rank, 0)
        self.lo = rank * self.shard_size  # this rank's shard: [lo, lo + shard_size) of the flat buffer
        src = self.params[0] if self.params else torch.empty(0)
        self.device = src.device
        """The compute device: the full parameters and the gradients live there."""
        self.param_dtype = param_dtype or src.dtype
        self.reduce_dtype = reduce_dtype or torch.float32
        flat = torch.zeros(self.padded, dtype=torch.float32, device=src.device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
        in_place = stage < 3 and offload == "none" and self.param_dtype == torch.float32
        self.master_in_full = in_place
        """The master is ``full``'s own slice, not a copy (ZeRO-1/2, fp32 compute, no offload)."""
        self.grad_in_full = in_place and stage == 1 and self.reduce_dtype == torch.float32
        """The shard gradient is ``grad_full``'s own slice, not a separate buffer (ZeRO-1, fp32)."""
        shard = flat[self.lo : self.lo + self.shard_size]
        if not in_place:
            shard = shard.clone()
        self.offload = UnitOffload(offload, self.device, self.param_dtype) if offload != "none" else None
        """CPU offload's host side of this unit (None: everything on the compute device)."""
        self.master = nn.Parameter(self.offload.host_master(shard) if self.offload else shard)
        self.full = flat.to(self.param_dtype) if self.param_dtype != torch.float32 else flat
        self._bind()
        self.grad_full: torch.Tensor | None = None
        self._held: torch.Tensor | None = None  # grad_in_full: the shard gradient set aside during a backward
        self.ready: set[int] = set()
        self.gathered = True
        self._pending: Work | None = None

    @property
    def grad(self) -> torch.Tensor | None:
        """This rank's fp32 shard gradient, on the compute device: what the reduce-scatters add
        into and the norm, fp16 unscaling and clipping act on (``master.grad`` unless offloaded)."""
        return self.offload.grad if self.offload is not None else self.master.grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        if self.offload is not None:
            self.offload.grad = value
        elif self.grad_in_full:  # the values go into grad_full's own slice, which stays zero while None
            if value is None:
                if self.grad_full is not None:
                    self._own_grad().zero_()
                self.master.grad = None
            else:
                own = self._own_grad()
                if value.data_ptr() != own.data_ptr():
                    own.copy_(value)
                self.master.grad = own
        else:
            self.master.grad = value

    def _own_grad(self) -> torch.Tensor:
        """``grad_full``'s slice of this rank's shard (allocating the buffer if needed)."""
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.device)
        return self.grad_full[self.lo : self.lo + self.shard_size]

    def _bind(self) -> None:
        """Point every parameter at its slice of ``full``."""
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            p.data = self.full[off : off + math.prod(shape)].view(shape)

    # -- parameters ------------------------------------------------------------------------------

    def free(self) -> None:
        """Release the full parameters' memory (ZeRO-3); the views stay valid for the next gather."""
        if self.master_in_full:
            raise RuntimeError("FlatUnit.free: the master shard is a slice of the full parameters (ZeRO-1/2)")
        if self._pending is not None:  # a prefetch still writes into the buffer: let it land first
            self.wait_gathered()
        if self.gathered and self.padded:
            self.full.untyped_storage().resize_(0)
        self.gathered = False

    def gather(self, async_op: bool = False) -> Work | None:
        """All-gather every rank's shard into ``full`` (in the compute dtype)."""
        if self.gathered or self._pending is not None:
            return self._pending
        # resize only what ``free`` released: in ZeRO-1/2 the master is ``full``'s slice, and a
        # checkpoint writing it through ``.numpy()`` makes the storage's size fixed
        nbytes = self.padded * self.full.element_size()
        if self.full.untyped_storage().nbytes() != nbytes:
            self.full.untyped_storage().resize_(nbytes)
        # (master_in_full: the input is the output's own block, which the all-gather leaves as it is)
        shard = self.offload.compute_shard(self.master) if self.offload else self.master.detach().to(self.param_dtype)
        work = comm.all_gather_into_tensor(self.full, shard, group=self.group, async_op=async_op)
        if async_op:
            self._pending = work
            return work
        self._gathered()
        return None

    def _gathered(self) -> None:
        self.gathered = True
        if self.offload is not None:
            self.offload.gathered()

    def wait_gathered(self) -> None:
        """Block until the parameters are present (gathering now if no prefetch is in flight)."""
        if self._pending is not None:
            work, self._pending = self._pending, None
            work.wait()
            self._gathered()
        elif not self.gathered:
            self.gather()

    def refresh(self, async_op: bool = False) -> Work | None:
        """After an optimizer step: bring the (still allocated) full parameters up to date
        (``async_op``: start it; ``wait_gathered`` ends it)."""
        self.gathered = False
        self._pending = None
        return self.gather(async_op)

    def shard_of(self, full: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This rank's shard of the flat vector made of ``full[name]`` for every parameter."""
        out = torch.zeros(self.shard_size, dtype=dtype, device=self.master.device)
        for name, p_start, s_start, length in self.param_name_slices():
            t = full[name]
            if t.numel() != math.prod(self.shapes[self.names.index(name)]):
                raise ValueError(f"{name}: saved shape {tuple(t.shape)} does not match the model's "
                                 f"{tuple(self.shapes[self.names.index(name)])}")
            out[s_start : s_start + length] = t.reshape(-1)[p_start : p_start + length].to(dtype)
        return out

    def load_shard(self, full: dict[str, torch.Tensor]) -> None:
        """Set the master shard from full parameter tensors and refresh the compute parameters."""
        with torch.no_grad():
            self.master.copy_(self.shard_of(full))
            if self.gathered:
                for name, p, off in zip(self.names, self.params, self.offsets):
                    self.full[off : off + p.numel()].copy_(full[name].reshape(-1).to(self.full.dtype))

    # -- gradients -------------------------------------------------------------------------------

    def add_grad(self, i: int, grad: torch.Tensor) -> None:
        """Accumulate parameter ``i``'s gradient into the unit's full gradient buffer."""
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.device)
        if self.grad_in_full and not self.ready and self.master.grad is not None:
            # accumulation: this backward's local gradients must not add to the shard gradient the
            # reduce-scatter would then average too; hold it aside until the reduction is done
            own = self._own_grad()
            self._held = own.clone()
            own.zero_()
        off = self.offsets[i]
        self.grad_full[off : off + grad.numel()].add_(grad.reshape(-1))
        self.ready.add(i)

    def complete(self) -> bool:
        """True once every parameter's gradient of this backward has arrived."""
        return len(self.ready) == len(self.params)

    def reduce_scatter(self, keep_full: bool) -> Work:
        """Start averaging the gradient over the group into this rank's shard; when it is done,
        it is added to ``grad`` and the full gradient buffer is zeroed (``keep_full``,
        ZeRO-1) or dropped (ZeRO-2/3). Issued from the calling thread, so every rank orders its
        collectives identically."""
        if self.grad_in_full and not keep_full:
            raise ValueError("FlatUnit.reduce_scatter: a unit whose shard gradient lives in grad_full keeps it")
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.device)
        full = self.grad_full
        p, size = self.group.size, self.shard_size
        if self.reduce_dtype in (torch.float16, torch.bfloat16) and p > 1:
            # meshtrain.comm sums half precision in fp32 on the wire; to send half the bytes,
            # exchange the half-precision chunks (all-to-all) and sum them here in fp32
            recv = torch.empty_like(full)
            work = comm.all_to_all(list(recv.split(size)), list(full.split(size)), group=self.group,
                                   async_op=True)

            def result() -> torch.Tensor:
                return recv.view(p, size).float().sum(0).div_(p)
        else:
            shard = torch.empty(size, dtype=self.reduce_dtype, device=self.device)
            work = comm.reduce_scatter_tensor(shard, full, op="avg", group=self.group, async_op=True)

            def result() -> torch.Tensor:
                return shard.float()

        def done(w: Work) -> None:
            if w._exc is not None:  # the error is raised by whoever waits
                return
            g = result()
            if self.scale != 1.0:
                g.mul_(self.scale)
            if self.grad_in_full:  # own slice = g (+ what was held: the same sum as grad.add_(g))
                lo, hi = self.lo, self.lo + size
                own = full[lo:hi].copy_(g)
                if self._held is not None:
                    own.add_(self._held)
                    self._held = None
                full[:lo].zero_()
                full[hi:].zero_()
                self.master.grad = own
                return
            if self.grad is None:
                self.grad = g
            else:
                self.grad.add_(g)
            if keep_full:
                full.zero_()

        work.add_done_callback(done)
        if not keep_full:
            self.grad_full = None  # the collective holds the buffer until it is done
        return work

    def param_name_slices(self) -> list[tuple[str, int, int, int]]:
        """For each parameter that overlaps this rank's shard: (name, start in the parameter's
        flat values, start in the shard, length). A checkpoint stores shards with this map."""
        out = []
        hi = self.lo + self.shard_size
        for name, p, off in zip(self.names, self.params, self.offsets):
            a, b = max(off, self.lo), min(off + math.prod(p.shape), hi)
            if a < b:
                out.append((name, a - off, a - self.lo, b - a))
        return out
