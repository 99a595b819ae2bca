"""ZeRO stages 1-3 over a data-parallel group (Rajbhandari et al. 2020), with mixed precision.

``ZeroModel(module, stage=s, group=dp)`` flattens the parameters into ``FlatUnit``s (ZeRO-3: one per
block; ZeRO-1/2: buckets of ``bucket_cap_mb`` of gradient, "auto" by default as DataParallel's), each
sharded evenly over the group, and ``ZeroOptimizer(zero_model, torch.optim.AdamW, lr=...)`` runs any torch
optimizer on this rank's fp32 shards only:

* stage 1: optimizer state is 1/dp per rank; every rank keeps full parameters and a full gradient
  buffer;
* stage 2: gradients too. Each unit's gradient is reduce-scattered the moment its last gradient
  has arrived (overlapping the rest of backward) and the full buffer is dropped;
* stage 3: parameters too. Each unit (by default every direct child module that has parameters,
  plus a root unit for the rest) is all-gathered just before its forward and again before its
  backward, prefetching the next unit while the current one computes, and freed afterwards.

Gradient accumulation: call backward several times, then ``step``; the shard gradients add up.
CPU offload (``offload="optimizer"`` or ``"params"``): the masters and the optimizer live on the host
(``offload.py``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

from .. import comm
from ..comm import Group, Work
from ..config.parallel import check_bucket_cap, check_offload
from .bucket_size import log_auto, resolve_bucket_cap, split_by_bytes
from .flat_unit import FlatUnit
from .grad_groups import ReduceGroup, by_reduce_group
from .offload import host_optimizer, step_on_host
from .precision import MixedPrecision
from .zero_state import (check_shapes, load_optimizer_shards, model_shard_state, optimizer_shard_state,
                         shard_from_pieces)


class ZeroModel(nn.Module):
    """A module whose parameters are sharded over ``group`` in ZeRO ``stage`` 1, 2 or 3; with a
    ``replicate_group`` (HSDP), each of its ranks holds a replica of this rank's shards; with
    ``offload`` ("optimizer", or "params" for stage 3) the fp32 masters live in host memory.

    ``units`` are the blocks ZeRO-3 gathers around their forward (default: the direct children
    with parameters). ZeRO-1/2 cut their units by ``bucket_cap_mb`` instead (MiB of reduced
    gradient, or "auto": sized from the group's link at construction, collective, logged on rank 0;
    ``bucket_cap_bytes`` keeps it); ``bucket_cap_mb=None`` gives them one unit per block too."""

    def __init__(self, module: nn.Module, stage: int, group: Group | None = None, *,
                 units: Iterable[nn.Module] | None = None, mixed_precision: MixedPrecision | None = None,
                 prefetch: bool = True, replicate_group: Group | None = None, view: str | None = None,
                 reduce_groups: Mapping[str, ReduceGroup] | None = None, offload: str = "none",
                 bucket_cap_mb: float | str | None = "auto") -> None:
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        check_offload(offload, stage)
        if bucket_cap_mb is not None:
            check_bucket_cap(bucket_cap_mb)
        self.module = module
        self.stage = stage
        self.offload = offload
        self.group = group or comm.current().world
        self.mp = mixed_precision or MixedPrecision()
        self.prefetch = prefetch
        from .data import broadcast_tensors

        # HSDP: replicas of the whole sharded model (torchtitan's dp_replicate); gradients are
        # averaged over them once a step, before anything reads them (``reduce_replicas``)
        self.replicate = replicate_group if replicate_group is not None and replicate_group.size > 1 else None
        self._replicas_pending = False
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # a mixture-of-experts layer's parameters are sharded over their own group (``grad_groups``)
        parts = by_reduce_group(named, ReduceGroup(self.group, 1.0, self.replicate, view), reduce_groups)
        rg_of = {id(p): rg for rg, members in parts for _, p in members}
        for rg, members in parts:  # every rank of a group (and its replicas) holds the same values
            for g in (rg.group, rg.replicas):
                if g is not None and g.size > 1:
                    broadcast_tensors([p for _, p in members], g)
        for g in (self.group, self.replicate):
            if g is not None and g.size > 1:
                broadcast_tensors([p for _, p in module.named_parameters() if not p.requires_grad]
                                  + list(module.buffers()), g)
        self._buffer_dtypes = {n: b.dtype for n, b in module.named_buffers()}
        bdtype = self.mp.buffer_dtype or self.mp.param_dtype
        for b in module.buffers():
            if b.is_floating_point() and b.dtype != bdtype:
                b.data = b.data.to(bdtype)
        blocks = list(units) if units is not None else [
            m for m in module.children() if any(p.requires_grad for p in m.parameters())]
        owner: dict[int, int] = {}
        for b, m in enumerate(blocks):
            for p in m.parameters():
                owner.setdefault(id(p), b)
        # slot 0 holds the root (parameters outside every block), then one slot per block; a slot
        # has one unit per reduce group its parameters name
        # parameters of a module that asks to compute in fp32 (an MoE router) get fp32 units
        fp32 = {id(p) for m in module.modules() if getattr(m, "compute_fp32", False) for p in m.parameters()}
        per_slot: list[dict[tuple[int, bool], list[tuple[str, nn.Parameter]]]] = [{} for _ in range(len(blocks) + 1)]
        for name, p in named:
            slot = owner[id(p)] + 1 if id(p) in owner else 0
            per_slot[slot].setdefault((id(rg_of[id(p)]), id(p) in fp32), []).append((name, p))
        chunks = [[(fp, members) for (_, fp), members in by_group.items()] for by_group in per_slot]
        self.bucket_cap_bytes: int | None = None
        """ZeRO-1/2's unit size in bytes of gradients (with "auto": the size chosen); None: units are blocks."""
        if stage < 3 and bucket_cap_mb is not None:
            # ZeRO-1/2 gather nothing around a block's forward: their units are buckets by size, as
            # DataParallel's (and DeepSpeed's reduce_bucket_size), in one slot
            chunks = [self._size_units(named, rg_of, fp32, bucket_cap_mb)]
        self.units: list[FlatUnit] = []
        self._slots: list[list[FlatUnit]] = []
        self._slot_of_module: dict[int, int] = {}  # a block -> its index in _slots
        for slot, pieces in enumerate(chunks):
            made = []
            for keep_fp32, members in pieces:
                rg = rg_of[id(members[0][1])]
                dtype = torch.float32 if keep_fp32 else self.mp.param_dtype
                made.append(FlatUnit(len(self.units), members, rg.group, dtype, self.mp.reduce_dtype,
                                     replicas=rg.replicas, scale=rg.scale, view=rg.view, offload=offload,
                                     stage=stage))
                self.units.append(made[-1])
            if made:
                if slot:
                    self._slot_of_module[id(blocks[slot - 1])] = len(self._slots)
                self._slots.append(made)
        self._root = self._slots[0] if chunks[0] and self._slots else []
        self._where = {}
        for u in self.units:
            for i, p in enumerate(u.params):
                self._where[id(p)] = (u, i)
                p.register_post_accumulate_grad_hook(self._on_grad)
        self._works: list[Work] = []
        self._launched: set[int] = set()
        self._armed = False
        # forwards whose backward has not finished: a pipeline runs several forwards before their
        # backwards, and ZeRO-3 must keep what a later backward still needs
        self._outstanding = 0
        if stage == 3:
            for m in blocks:
                if id(m) in self._slot_of_module:
                    m.register_forward_pre_hook(self._pre_forward)
                    m.register_forward_hook(self._post_forward)
            for u in self.units:
                u.free()

    def _size_units(self, named: list[tuple[str, nn.Parameter]], rg_of: dict[int, ReduceGroup], fp32: set[int],
                    bucket_cap_mb: float | str) -> list[tuple[bool, list[tuple[str, nn.Parameter]]]]:
        """ZeRO-1/2's units: per (reduce group, fp32) the parameters cut by ``bucket_cap_mb`` of reduced
        gradient, from the end as backward produces them; all in order of their first parameter, so
        that backward completes them from the last. "auto" sizes each group from its link (collective)."""
        parts: dict[tuple[int, bool], list[tuple[str, nn.Parameter]]] = {}
        for name, p in named:
            parts.setdefault((id(rg_of[id(p)]), id(p) in fp32), []).append((name, p))
        out = []
        elem = torch.empty((), dtype=self.mp.reduce_dtype or torch.float32).element_size()
        for (_, keep_fp32), members in parts.items():
            rg = rg_of[id(members[0][1])]
            nbytes = sum(p.numel() for _, p in members) * elem
            cap, why = resolve_bucket_cap(bucket_cap_mb, rg.group, nbytes, "reduce_scatter")
            runs = split_by_bytes(members, cap, elem)
            out += [(keep_fp32, run) for run in runs]
            if rg.group is self.group and not keep_fp32:
                self.bucket_cap_bytes = cap
                if why is not None:
                    log_auto(f"ZeRO-{self.stage}", cap, why, len(runs), nbytes)
        position = {id(p): i for i, (_, p) in enumerate(named)}
        return sorted(out, key=lambda c: position[id(c[1][0][1])])

    def _gather_slot(self, slot: int) -> None:
        """Start gathering every unit of a slot (prefetch)."""
        if self.prefetch and 0 <= slot < len(self._slots):
            for u in self._slots[slot]:
                u.gather(async_op=True)

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; for ZeRO-3 the root unit is gathered for the whole step."""
        if self.stage == 3:
            for u in self._root:
                u.wait_gathered()
        if torch.is_grad_enabled():
            self._outstanding += 1
        if self.mp.param_dtype != torch.float32:
            args = tuple(a.to(self.mp.param_dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                         for a in args)
        out = self.module(*args, **kwargs)
        if self.mp.output_dtype is not None and torch.is_tensor(out) and out.is_floating_point():
            out = out.to(self.mp.output_dtype)
        return out

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        slot = self._slot_of_module[id(module)]
        for u in self._slots[slot]:
            u.wait_gathered()
        if torch.is_grad_enabled():
            self._gather_slot(slot + 1)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        slot = self._slot_of_module[id(module)]
        units = self._slots[slot]
        for u in units:
            u.free()
        if torch.is_grad_enabled():
            fired = [False]

            def pre_backward(grad: torch.Tensor) -> torch.Tensor:
                if not fired[0]:
                    fired[0] = True
                    self._arm()
                    for u in units:
                        u.wait_gathered()
                    self._gather_slot(slot - 1)
                return grad

            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(pre_backward)
        return output

    # -- backward --------------------------------------------------------------------------------

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _on_grad(self, p: torch.Tensor) -> None:
        u, i = self._where[id(p)]
        self._arm()
        u.add_grad(i, p.grad)
        p.grad = None
        if u.complete():
            self._launch(u)

    def _launch(self, u: FlatUnit) -> None:
        """Reduce-scatter ``u`` on the worker thread, in the same order on every rank."""
        # Units complete in reverse order; one that finishes early waits for the later ones, so
        # the sequence of collectives is identical everywhere.
        pending = [v for v in reversed(self.units) if v.index not in self._launched]
        for v in pending:
            if not v.complete():
                break
            self._launched.add(v.index)
            if self.stage == 3 and v not in self._root and self._outstanding <= 1:
                v.free()  # (with more backwards to come, the unit stays for them)
            self._works.append(v.reduce_scatter(keep_full=self.stage == 1))

    def _finalize(self) -> None:
        """End of backward: every unit must be complete; wait for all reductions."""
        self._armed = False
        try:
            missing = [u.names[i] for u in self.units for i in range(len(u.params)) if i not in u.ready]
            if missing:
                raise RuntimeError(
                    f"ZeRO: parameter(s) {missing[:10]} received no gradient in this backward; ZeRO "
                    f"reduces whole units, so every parameter must take part in the loss (or set "
                    f"requires_grad=False on the unused ones before wrapping)."
                )
            for w in self._works:
                w.wait()
            self._replicas_pending = any(u.replicas is not None for u in self.units)
        finally:
            self._works = []
            self._launched.clear()
            for u in self.units:
                u.ready.clear()
            self._outstanding = max(self._outstanding - 1, 0)
            if self.stage == 3 and self._outstanding == 0:
                for u in self.units:  # the last backward of the step: nothing is needed any more
                    u.free()

    def reduce_replicas(self) -> None:
        """Average the shard gradients over the replica group (HSDP), once after the backwards of a
        step; a no-op without replicas or when already done. Collective over the replicas."""
        if not self._replicas_pending:
            return
        self._replicas_pending = False
        for u in self.units:
            if u.grad is not None and u.replicas is not None:
                comm.all_reduce(u.grad, op="avg", group=u.replicas)

    def buffer_dtypes(self) -> dict[str, torch.dtype]:
        """Each buffer's dtype before mixed precision converted it (what a checkpoint stores)."""
        return dict(self._buffer_dtypes)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state (parameters in fp32 from the masters, plus buffers) on every rank,
        gathered on the compute device (an offloaded master is copied there first)."""
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            flat = torch.empty(u.padded, dtype=torch.float32, device=u.device)
            comm.all_gather_into_tensor(flat, u.master.detach().to(u.device), group=u.group)
            for name, off, shape in zip(u.names, u.offsets, u.shapes):
                out[name] = flat[off : off + shape.numel()].view(shape).clone()
        for name, b in self.module.named_buffers():
            out[name] = b.detach().to(self._buffer_dtypes.get(name, b.dtype)).clone()
        return out


    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) parameters and buffers, saved under any dp size; collective-free."""
        names = {n for u in self.units for n in u.names} | {n for n, _ in self.module.named_buffers()}
        missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
        if missing or unexpected:
            raise KeyError(f"state dict does not match the model: missing {missing[:5]}, unexpected "
                           f"{unexpected[:5]}")
        for u in self.units:
            u.load_shard({n: state[n] for n in u.names})
        for name, b in self.module.named_buffers():
            with torch.no_grad():
                b.copy_(state[name].to(b.dtype))


    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's pieces of the fp32 parameters plus the buffers: save one per rank."""
        return model_shard_state(self.units, dict(self.module.named_buffers()))

    def load_shard_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Load shard states of every saving rank (any dp size), or this rank's own."""
        shards = state if isinstance(state, list) else [state]
        check_shapes(self.units, shards[0]["shapes"])
        for u in self.units:
            shard = shard_from_pieces(u, [sh["params"] for sh in shards], torch.float32, "parameter")
            with torch.no_grad():
                u.master.copy_(shard)
            if u.gathered:
                u.refresh()
        for name, b in self.module.named_buffers():
            with torch.no_grad():
                b.copy_(shards[0]["buffers"][name].to(b.dtype))


class ZeroOptimizer:
    """Runs ``optimizer_cls`` on a ZeroModel's fp32 shards and puts the results back.

    ``clip_grad_norm_(max_norm)`` clips by the norm over all shards of all ranks;
    ``scaler`` (a ``DynamicLossScaler``) skips steps whose gradients overflowed on any rank.
    """

    def __init__(self, model: ZeroModel, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        self.model = model
        masters = [u.master for u in model.units]
        # offloaded masters are host tensors: the optimizer runs on the CPU (fused where torch can)
        self.optimizer = host_optimizer(optimizer_cls, masters, kwargs) if model.offload != "none" \
            else optimizer_cls(masters, **kwargs)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (set ``lr`` here)."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the shard gradients."""
        for u in self.model.units:
            u.grad = None

    def grad_norm(self) -> float:
        """The L2 norm of the full gradient, from every rank's shards (padding is zero). For a model
        sharded over one group; a mixture of experts' (several groups) is normed by
        ``ParallelOptimizer.clip_grad_norm_``, which knows the mesh."""
        if len({id(u.group) for u in self.model.units}) > 1:
            raise ValueError("ZeroOptimizer.grad_norm: the units are sharded over different groups (expert "
                             "parallelism); use ParallelOptimizer.clip_grad_norm_, which sums over the mesh")
        self.model.reduce_replicas()
        sq = torch.zeros(1, dtype=torch.float64)
        for u in self.model.units:
            if u.grad is not None:
                sq += u.grad.double().pow(2).sum()
        comm.all_reduce(sq, op="sum", group=self.model.group)
        return float(sq.sqrt())

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the shard gradients so the global norm is at most ``max_norm``; return the norm."""
        norm = self.grad_norm()
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for u in self.model.units:
                if u.grad is not None:
                    u.grad.mul_(coef)
        return norm

    def step(self, scaler: Any = None) -> bool:
        """One optimizer step on the shards, then refresh the full parameters (stages 1, 2); offloaded,
        pipelined unit by unit on the CPU (``offload.step_on_host``). Returns False if ``scaler``
        found inf/NaN on any rank and skipped it."""
        self.model.reduce_replicas()
        if scaler is not None and not scaler.unscale_and_check(self.model.units, self.model.group):
            self.zero_grad()
            return False
        if self.model.offload != "none":
            step_on_host(self.optimizer, self.model.units, refresh=self.model.stage in (1, 2))
            return True
        self.optimizer.step()
        if self.model.stage in (1, 2):
            for u in self.model.units:
                u.refresh()
        return True

    def full_state_dict(self) -> dict[str, Any]:
        """The optimizer state per parameter name, unsharded (collective): loadable under any dp."""
        per_name: dict[str, dict[str, Any]] = {}
        for u in self.model.units:
            st = self.optimizer.state.get(u.master, {})
            for key, val in sorted(st.items()):
                if torch.is_tensor(val) and val.shape == u.master.shape:  # gathered on the compute device
                    flat = torch.empty(u.padded, dtype=val.dtype, device=u.device)
                    comm.all_gather_into_tensor(flat, val.contiguous().to(u.device), group=u.group)
                    for name, off, shape in zip(u.names, u.offsets, u.shapes):
                        per_name.setdefault(name, {})[key] = flat[off : off + shape.numel()].view(shape).clone()
                else:  # scalars such as Adam's step count: equal on every shard
                    for name in u.names:
                        per_name.setdefault(name, {})[key] = val.clone() if torch.is_tensor(val) else val
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"state": per_name, "param_groups": groups}

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``full_state_dict`` returned, whatever dp size saved it (reshards)."""
        per_name = state["state"]
        for u in self.model.units:
            keys = {k for n in u.names for k in per_name.get(n, {})}
            if not keys:
                continue
            new: dict[str, Any] = {}
            for key in sorted(keys):
                sample = per_name[u.names[0]][key]
                if torch.is_tensor(sample) and sample.shape == u.shapes[0]:
                    new[key] = u.shard_of({n: per_name[n][key] for n in u.names}, sample.dtype)
                else:
                    new[key] = sample.clone() if torch.is_tensor(sample) else sample
            self.optimizer.state[u.master] = new
        for g, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            g.update(saved)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state, as pieces of named parameters: save one per
        rank; ``load_state_dict`` reads the set back under any dp size."""
        return optimizer_shard_state(self.model.units, self.optimizer)

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Load shard states saved by ``state_dict`` on every rank of any dp size (a list), or this
        rank's own (same dp size)."""
        load_optimizer_shards(self.model.units, self.optimizer, state if isinstance(state, list) else [state])

def _tensors(out: Any) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []
