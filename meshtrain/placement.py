"""Where each parameter's local tensor lies in its global tensor, on every mesh axis.

A ``Placement`` is nanotron's sharded-parameter info (or DTensor's placements, resolved for one
rank): the global shape, and for each mesh axis the parameter is split over, the tensor dim, this
rank's index and the number of parts. Over every other axis the parameter is replicated. Pipeline
stages hold different parameters, so pp is never listed.

Initialisation (``full.narrow`` to the local box), gradient clipping (which axes a gradient is
distinct along) and checkpoints (the box of the full tensor, and which replica writes it) read
``param.placement``; export reads the checkpoint. ``attach_placements`` derives it from the layers
that split a parameter (``shard_dims`` on a module), so nothing is copied around by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Split:
    """One mesh axis a tensor is cut along: ``dim`` into ``parts`` equal slices, this rank's ``index``."""

    axis: str
    dim: int
    index: int
    parts: int


@dataclass(frozen=True)
class Placement:
    """A parameter's global shape and how this rank's local tensor is cut out of it."""

    global_shape: tuple[int, ...]
    splits: tuple[Split, ...] = ()
    """The axes the tensor is split over, outermost first (two splits of one dim nest)."""
    reduce: str | None = None
    """The mesh view whose ranks hold partial gradients of this parameter that add up to the
    whole (what data parallelism reduces it over, and ZeRO shards it over): None for the wrapper's
    default (dp x cp in training); a mixture-of-experts layer names its own, since its experts
    see other tokens than the dense layers do."""

    @classmethod
    def replicated(cls, shape: tuple[int, ...] | torch.Size) -> "Placement":
        """A parameter every rank holds whole."""
        return cls(tuple(shape))

    @property
    def sharded_over(self) -> frozenset[str]:
        """The axes along which ranks hold different slices."""
        return frozenset(s.axis for s in self.splits if s.parts > 1)

    @property
    def box(self) -> Box:
        """This rank's (start, stop) in the global tensor, per dim."""
        lo = [0] * len(self.global_shape)
        size = list(self.global_shape)
        for s in self.splits:
            size[s.dim] //= s.parts
            lo[s.dim] += s.index * size[s.dim]
        return tuple((a, a + n) for a, n in zip(lo, size))

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's tensor."""
        return tuple(b - a for a, b in self.box)

    def shift(self, local_box: Box) -> Box:
        """A box of the local tensor as a box of the global one."""
        return tuple((lo + a, hi + a) for (lo, hi), (a, _) in zip(local_box, self.box))

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the global tensor ``full`` (a view)."""
        for d, (a, b) in enumerate(self.box):
            full = full.narrow(d, a, b - a)
        return full

    @classmethod
    def split(cls, local_shape: tuple[int, ...] | torch.Size, axis: str, dim: int, index: int,
              parts: int, reduce: str | None = None) -> "Placement":
        """A tensor of ``local_shape`` that is slice ``index`` of ``parts`` along ``dim`` over ``axis``."""
        full = list(local_shape)
        full[dim] *= parts
        return cls(tuple(full), (Split(axis, dim, index, parts),) if parts > 1 else (), reduce)


def placement_of(p: torch.Tensor) -> Placement:
    """A parameter's placement (replicated if none was attached)."""
    return getattr(p, "placement", None) or Placement.replicated(p.shape)


def attach_placements(model: nn.Module, axis: str = "tp") -> None:
    """Give every parameter of ``model`` a ``placement``: split along the dims the module that owns
    it declares (``module.shard_dims = {param_name: dim}``, its ``group`` naming index and parts,
    over mesh axis ``module.shard_axis``, default ``axis``), replicated otherwise; its gradient
    reduced over the view the nearest enclosing module names in ``grad_reduce`` (default None).
    Idempotent; call after any step (``to_empty``) that makes new parameter objects."""
    reduce_of: dict[str, str | None] = {}
    owner: dict[int, tuple[str, nn.Module, str]] = {}
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0] if name else None
        reduce_of[name] = getattr(module, "grad_reduce", None) or (reduce_of.get(parent) if parent is not None else None)
        for pname, p in module.named_parameters(recurse=False):
            # a parameter two modules share (tied embeddings) takes its split from the one that splits it
            if id(p) not in owner or pname in getattr(module, "shard_dims", {}):
                owner[id(p)] = (name, module, pname)
    for p in model.parameters():
        name, module, pname = owner[id(p)]
        dims, group = getattr(module, "shard_dims", {}), getattr(module, "group", None)
        if pname in dims and group is not None:
            p.placement = Placement.split(p.shape, getattr(module, "shard_axis", axis), dims[pname],  # type: ignore[attr-defined]
                                          group.rank, group.size, reduce_of[name])
        else:
            p.placement = Placement(tuple(p.shape), (), reduce_of[name])  # type: ignore[attr-defined]
