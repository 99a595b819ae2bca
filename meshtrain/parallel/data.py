"""Data parallelism: a naive reference and the bucketed, overlapped ``DataParallel``.

Both average gradients over a group (the mesh's dp or dp x cp group), so the result equals the
single-process gradient of the global batch when every rank holds an equal share of it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .. import comm
from ..comm import Group
from ..comm.communicator import mark_helper_thread
from ..comm.device import on_host
from ..config.parallel import check_bucket_cap
from .bucket_size import log_auto, resolve_bucket_cap
from .buckets import GradBucket, build_buckets
from .grad_groups import ReduceGroup, by_reduce_group

CommHook = Callable[[GradBucket, Group], torch.Tensor]


def broadcast_tensors(tensors: list[torch.Tensor], group: Group, src_group_rank: int = 0) -> None:
    """Broadcast ``tensors`` in place from the group's rank ``src_group_rank``: one message per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        ts = by_dtype[dtype]
        flat = _flatten_dense_tensors([t.detach() for t in ts])
        comm.broadcast(flat, src=group.ranks[src_group_rank], group=group)
        for t, v in zip(ts, _unflatten_dense_tensors(flat, ts)):
            with torch.no_grad():
                t.copy_(v)


def allreduce_hook(bucket: GradBucket, group: Group) -> torch.Tensor:
    """The default communication hook: average the bucket in place over the group."""
    comm.all_reduce(bucket.buffer, op="avg", group=group)
    return bucket.buffer


class NaiveDataParallel(nn.Module):
    """Reference data parallelism: after ``backward``, call ``sync_gradients()`` to all-reduce
    (average) every gradient, one collective per parameter. Slow and obviously correct."""

    def __init__(self, module: nn.Module, group: Group | None = None) -> None:
        super().__init__()
        self.module = module
        self.group = group or comm.current().world
        broadcast_tensors(list(module.parameters()) + list(module.buffers()), self.group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        """Average every parameter's gradient over the group (parameters without one are skipped)."""
        for p in self.module.parameters():
            if p.grad is not None:
                comm.all_reduce(p.grad, op="avg", group=self.group)


class DataParallel(nn.Module):
    """Bucketed data parallelism with the reduction overlapped with backward, as torch DDP.

    * Parameters and buffers are broadcast from the group's first rank when wrapped; buffers again
      before every forward if ``broadcast_buffers`` (batch-norm statistics stay identical).
    * Gradients live in flat buckets of about ``bucket_cap_mb`` (the first: ``first_bucket_mb``,
      so the first reduction starts early) in reverse registration order; ``"auto"`` sizes them
      from the group's calibrated link at construction (``bucket_size.py``; collective, logged on
      rank 0, kept in ``bucket_cap_bytes``):
      every ``.grad`` is a view into its bucket, so no flatten/unflatten copies are made. A
      bucket's reduction starts on a background thread the moment its last gradient has been
      accumulated (post-accumulate-grad hooks), while backward goes on; buckets are launched in
      order, so every rank issues the same collectives in the same order. ``backward()`` returns
      once every bucket is reduced.
    * ``no_sync()`` accumulates gradients locally (gradient accumulation); the next backward
      outside it reduces the sum.
    * Parameters that receive no gradient in a backward: an error naming them, or with
      ``find_unused_parameters=True`` they count as zero; those unused on every rank keep
      ``grad = None`` so the optimizer skips them, as in a single process.
    * ``comm_hook(bucket, group) -> averaged flat tensor`` replaces the all-reduce (see
      ``meshtrain.comm.compress`` for fp16/bf16, int8, top-k and PowerSGD).
    * A parameter whose ``placement.reduce`` names a mesh view (a mixture-of-experts layer's) is
      broadcast and reduced over ``reduce_groups[view]`` instead of ``group``, in buckets of its
      own (``grad_groups``).
    """

    def __init__(self, module: nn.Module, group: Group | None = None, *, bucket_cap_mb: float | str = "auto",
                 first_bucket_mb: float = 1.0, find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 comm_hook: CommHook | None = None, reduce_groups: Mapping[str, ReduceGroup] | None = None) -> None:
        super().__init__()
        check_bucket_cap(bucket_cap_mb)  # before any collective: a bad value fails alike on every rank
        self.module = module
        self.group = group or comm.current().world
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.comm_hook: CommHook = comm_hook or allreduce_hook
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        parts = by_reduce_group(list(reversed(named)), ReduceGroup(self.group), reduce_groups)
        self.buckets: list[GradBucket] = []
        for rg, members in parts:  # every rank holds the same parameters of a group: broadcast within it
            broadcast_tensors([p for _, p in members], rg.group)
        broadcast_tensors([p for _, p in module.named_parameters() if not p.requires_grad] + list(module.buffers()),
                          self.group)
        position = {id(p): i for i, (_, p) in enumerate(reversed(named))}
        self.bucket_cap_bytes = 0
        """The bucket size in bytes of the wrapper's own group (with "auto": the size chosen)."""
        for rg, members in parts:
            # per reduce group: each is sized from its own link, identically on all its members
            nbytes = sum(p.numel() * p.element_size() for _, p in members)
            cap, why = resolve_bucket_cap(bucket_cap_mb, rg.group, nbytes)
            made = build_buckets(members, cap, first_cap_bytes=min(int(first_bucket_mb * (1 << 20)), cap),
                                 alloc=functools.partial(self._bucket_buffer, rg.group))
            for b in made:
                b.group, b.scale = rg.group, rg.scale
                self.buckets.append(b)
            if rg.group is self.group or not self.bucket_cap_bytes:
                self.bucket_cap_bytes = cap
                if why is not None and rg.group is self.group:
                    log_auto("DataParallel", cap, why, len(made), nbytes)
        # launched in the order backward fills them, the same on every rank of a stage
        self.buckets.sort(key=lambda b: position[id(b.params[0])])
        for i, b in enumerate(self.buckets):
            b.index = i
        self._where: dict[int, tuple[GradBucket, int]] = {}
        # The hook holds the wrapper weakly: a tensor's hooks are not seen by Python's collector,
        # so a bound method there kept every wrapper (its buckets and worker thread) alive forever.
        me = weakref.ref(self)

        def on_grad(p: torch.Tensor) -> None:
            dp = me()
            if dp is not None:
                dp._on_grad(p)

        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
                p.register_post_accumulate_grad_hook(on_grad)
        # a helper of the rank: its blocked reductions do not make the rank count as blocked for
        # the deadlock check (the training thread may be computing meanwhile)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="meshtrain-dp", initializer=mark_helper_thread)
        self._futures: list[Future] = []
        self._next = 0
        self._sync = True
        self._armed = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (after re-syncing buffers from the first rank if asked)."""
        if self.broadcast_buffers and torch.is_grad_enabled():
            bufs = list(self.module.buffers())
            if bufs:
                broadcast_tensors(bufs, self.group)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (the backward after this block reduces)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _bucket_buffer(self, group: Group, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A bucket's memory: symmetric on CPU, so that on one host's shared memory the all-reduce
        reads the peers' buckets in place (no copy into staging buffers); plain elsewhere."""
        if not on_host(device):
            return torch.empty(numel, dtype=dtype, device=device)
        return comm.symmetric_empty(numel, dtype, group)

    # -- backward machinery ---------------------------------------------------------------------

    def _on_grad(self, p: torch.Tensor) -> None:
        b, i = self._where[id(p)]
        view = b.view(i)
        if p.grad is not view and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)  # the grad was None before this backward (zero_grad(set_to_none))
            p.grad = view
        if not self._sync:
            return
        if not self._armed:
            self._armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        b.ready.add(i)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            b = self.buckets[self._next]
            self._futures.append(self._worker.submit(self._reduce, b))
            self._next += 1

    def _reduce(self, b: GradBucket) -> None:
        out = self.comm_hook(b, b.group)
        if out is not b.buffer:
            b.buffer.copy_(out.view_as(b.buffer))
        if b.scale != 1.0:
            b.buffer.mul_(b.scale)

    def _finalize(self) -> None:
        """End of backward: handle parameters without gradients, wait for every bucket."""
        self._armed = False
        try:
            missing = [(b, i) for b in self.buckets for i in range(len(b.params)) if i not in b.ready]
            if missing and not self.find_unused_parameters:
                names = [b.names[i] for b, i in missing]
                raise RuntimeError(
                    f"DataParallel: parameter(s) {names[:10]}{' ...' if len(names) > 10 else ''} received "
                    f"no gradient in this backward, so their buckets cannot be reduced. Pass "
                    f"find_unused_parameters=True, or make every parameter take part in the loss."
                )
            for b, i in missing:
                p = b.params[i]
                if p.grad is None:
                    b.view(i).zero_()  # contributes zero; stale values from an earlier step must not leak
                b.ready.add(i)
            self._launch_ready()
            # whether anyone used a parameter, asked of the ranks that hold it (its bucket's group)
            used: list[tuple[list[GradBucket], torch.Tensor]] = []
            if self.find_unused_parameters:
                by_group: dict[int, tuple[Group, list[GradBucket]]] = {}
                for b in self.buckets:
                    by_group.setdefault(id(b.group), (b.group, []))[1].append(b)
                for g, bs in by_group.values():
                    # on the buckets' device: NCCL moves device tensors only
                    flags = torch.tensor([float(p.grad is not None) for b in bs for p in b.params],
                                         device=bs[0].buffer.device)
                    used.append((bs, flags))
                    self._futures.append(self._worker.submit(comm.all_reduce, flags, "max", g))
            with self.group.comm.monitor.waiting():  # the training thread blocked on the reductions
                for f in self._futures:
                    f.result()
            for bs, flags in used:
                seen = iter(flags.tolist())  # one host read, not one per parameter
                for b in bs:
                    for i, p in enumerate(b.params):
                        p.grad = b.view(i) if next(seen) > 0 else None
        finally:
            self._futures = []
            self._next = 0
            for b in self.buckets:
                b.ready.clear()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every bucket (keeping ``.grad`` as views), or drop the grads with ``set_to_none``."""
        for b in self.buckets:
            if set_to_none:
                for p in b.params:
                    p.grad = None
            else:
                b.buffer.zero_()
                for i, p in enumerate(b.params):
                    p.grad = b.view(i)
