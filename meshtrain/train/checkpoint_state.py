"""What a rank holds of the full model and optimizer, as stateful objects a checkpoint saves and loads.

``ModelState(model)`` and ``OptimizerState(model, optimizer)`` follow torch.distributed.checkpoint's
*Stateful* protocol: ``state_dict()`` returns ``{key: ShardedTensor}`` whose pieces are **views**
of the live tensors (no copy, no communication), each piece a box of the full tensor; a save writes
the pieces this rank is the first replica of, a load reads into the same views and then calls
``load_state_dict`` to finish (refresh ZeRO's compute parameters, install optimizer state).

One description covers every layout: a plain parameter is one box (its tp slice); under ZeRO a
rank holds a contiguous range of each unit's flat fp32 master, which ``parallel/zero_state.py``
cuts into at most 2 x ndim - 1 boxes per parameter. So no rank ever gathers another rank's shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError
from ..parallel.parallel_model import ZERO_VIEW, ParallelModel, ParallelOptimizer, unwrap
from ..parallel.zero import ZeroModel
from ..parallel.zero_state import unit_regions
from ..placement import placement_of
from .checkpoint_io import Box, to_json

__all__ = ["ShardedTensor", "ModelState", "OptimizerState"]


@dataclass
class Region:
    """A box of the full tensor held at ``holder.view(-1)[start : start + prod(extent)]``."""

    box: Box
    start: int

    @property
    def extent(self) -> tuple[int, ...]:
        """The box's size per dim."""
        return tuple(hi - lo for lo, hi in self.box)


@dataclass
class Slot:
    """One parameter or buffer as this rank holds it: the tensor holding the values (the parameter,
    or ZeRO's flat fp32 master shard), the boxes of the full tensor in it, and whether this rank is
    the replica that writes them."""

    name: str
    shape: list[int]
    holder: torch.Tensor
    regions: list[Region]
    write: bool

    def views(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The regions' views into ``t``, a tensor laid out like ``holder`` (the holder itself, or an
        optimizer state tensor of it)."""
        flat = t.detach().view(-1)
        return [flat[r.start : r.start + math.prod(r.extent)].view(r.extent) for r in self.regions]


@dataclass
class ShardedTensor:
    """This rank's pieces of one full tensor: (box, values) with values a view of live state."""

    shape: list[int]
    pieces: list[tuple[Box, torch.Tensor]] = field(default_factory=list)
    write: bool = True


def param_slots(model: ParallelModel) -> list[Slot]:
    """Every parameter of this rank's stages, as slots (ZeRO: pieces of the fp32 master shards).
    Each parameter's ``placement`` gives the full shape and where its local tensor lies in it; the
    rank that writes a piece is the first of the ranks holding it (``Mesh.is_first_replica``)."""
    mesh = model.mesh
    slots: list[Slot] = []
    seen: set[str] = set()
    for stage in model.stages.values():
        if isinstance(stage, ZeroModel):
            params = dict(unwrap(stage).named_parameters())
            for u in stage.units:
                regions = unit_regions(u)
                for name in u.names:
                    placement = placement_of(params[name])
                    distinct = placement.sharded_over | {u.view or ZERO_VIEW}
                    slots.append(Slot(name, list(placement.global_shape), u.master,
                                      [Region(placement.shift(box), start) for box, start in regions[name]],
                                      mesh.is_first_replica(distinct)))
                    seen.add(name)
        else:
            for name, p in unwrap(stage).named_parameters():
                if name in seen:
                    continue
                seen.add(name)
                placement = placement_of(p)
                box = tuple((0, n) for n in p.shape)
                slots.append(Slot(name, list(placement.global_shape), p, [Region(placement.shift(box), 0)],
                                  mesh.is_first_replica(placement.sharded_over)))
    return slots


def buffer_slots(model: ParallelModel) -> list[tuple[Slot, torch.Tensor]]:
    """The buffers (replicated everywhere but over pp) as (slot, live buffer): the slot holds them
    in the dtype the model was built with (ZeRO may compute in another; then it holds a copy)."""
    out = []
    for stage in model.stages.values():
        dtypes = stage.buffer_dtypes() if isinstance(stage, ZeroModel) else {}
        for name, b in unwrap(stage).named_buffers():
            value = b.detach() if b.dtype == dtypes.get(name, b.dtype) else b.detach().to(dtypes[name])
            out.append((Slot(name, list(b.shape), value, [Region(tuple((0, n) for n in b.shape), 0)],
                             model.mesh.is_first_replica(())), b))
    return out


class ModelState:
    """The model's parameters and buffers as this rank holds them (see the module docstring)."""

    def __init__(self, model: ParallelModel) -> None:
        self.model = model
        self.params = param_slots(model)
        self.buffers = buffer_slots(model)

    def state_dict(self) -> dict[str, ShardedTensor]:
        """``model/<name>`` -> this rank's pieces (views of the parameters / master shards)."""
        out = {}
        for s in self.params + [s for s, _ in self.buffers]:
            out[f"model/{s.name}"] = ShardedTensor(s.shape, [(r.box, v) for r, v in zip(s.regions, s.views(s.holder))],
                                                   s.write)
        return out

    def load_state_dict(self, state: dict[str, ShardedTensor]) -> None:
        """Finish a load that read into the views of ``state`` (from ``state_dict()``; a buffer
        left out of it keeps its value): copy the buffers back where the view was a converted
        copy, and refresh ZeRO's compute parameters from the masters (collective over each stage's
        dp x cp group, in the same order on every rank)."""
        for s, live in self.buffers:
            if s.holder is not live and f"model/{s.name}" in state:
                with torch.no_grad():
                    live.copy_(s.holder)
        for stage in self.model.stages.values():
            if isinstance(stage, ZeroModel):
                for u in stage.units:
                    if stage.stage in (1, 2) or u.gathered:
                        u.refresh()


class OptimizerState:
    """The optimizer's per-parameter state laid out like the parameters (``optim/<name>/<key>``),
    per-parameter scalars such as Adam's step (JSON), and the hyperparameters."""

    def __init__(self, model: ParallelModel, optimizer: ParallelOptimizer, params: list[Slot] | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.slots = params if params is not None else param_slots(model)
        # the torch optimizers: ZeRO runs one per stage on its masters, plain training one in all
        self.torch_optimizers = [getattr(o, "optimizer", o) for o in optimizer.optimizers]
        self._by_param = {id(p): opt for opt in self.torch_optimizers for g in opt.param_groups for p in g["params"]}

    def _owner(self, holder: torch.Tensor) -> torch.optim.Optimizer:
        if id(holder) not in self._by_param:
            raise CheckpointError(f"internal error: a parameter ({tuple(holder.shape)}) is in no optimizer")
        return self._by_param[id(holder)]

    def state_dict(self) -> tuple[dict[str, ShardedTensor], dict[str, dict[str, Any]], list[dict[str, Any]]]:
        """(tensors as views, scalars per parameter name as JSON, param groups without params)."""
        tensors: dict[str, ShardedTensor] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for s in self.slots:
            for k, v in self._owner(s.holder).state.get(s.holder, {}).items():
                if torch.is_tensor(v) and v.shape == s.holder.shape and v.dim() > 0:
                    tensors[f"optim/{s.name}/{k}"] = ShardedTensor(
                        s.shape, [(r.box, t) for r, t in zip(s.regions, s.views(v))], s.write)
                elif torch.is_tensor(v) and v.numel() != 1:
                    raise CheckpointError(f"optimizer state {k!r} of {s.name} has shape {tuple(v.shape)}, neither the "
                                          f"parameter's {tuple(s.holder.shape)} nor a scalar; this optimizer's state "
                                          f"cannot be resharded (use AdamW/SGD-like optimizers)")
                elif s.write:
                    scalars.setdefault(s.name, {})[k] = to_json(v)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.torch_optimizers[0].param_groups]
        return tensors, scalars, groups

    def allocate(self, saved: dict[str, list[str]]) -> None:
        """Make sure every state tensor the checkpoint holds (``saved``: parameter name -> keys)
        exists, zero-filled where the optimizer has not stepped yet, so a load can read into it."""
        for s in self.slots:
            st = self._owner(s.holder).state.setdefault(s.holder, {})
            for k in saved.get(s.name, []):
                if not (torch.is_tensor(st.get(k)) and st[k].shape == s.holder.shape):
                    st[k] = torch.zeros_like(s.holder, memory_format=torch.contiguous_format)

    def load_state_dict(self, scalars: dict[str, dict[str, Any]], groups: list[list[dict[str, Any]]],
                        tensor_keys: dict[str, list[str]]) -> None:
        """Finish a load whose tensors were read into ``state_dict()``'s views: drop state keys the
        checkpoint does not hold, set the scalars (per parameter) and the hyperparameters (per
        torch optimizer)."""
        for s in self.slots:
            opt = self._owner(s.holder)
            keep = set(tensor_keys.get(s.name, [])) | set(scalars.get(s.name, {}))
            st = opt.state.get(s.holder, {})
            for k in [k for k in st if k not in keep]:
                del st[k]
            st.update(scalars.get(s.name, {}))
            if not st:
                opt.state.pop(s.holder, None)
        for opt, gs in zip(self.torch_optimizers, groups):
            for g, saved in zip(opt.param_groups, gs):
                g.update(saved)
