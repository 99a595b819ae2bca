"""Which ranks reduce which gradients: parameters grouped by the view their placement names.

Dense parameters are replicas over dp x cp and their gradients are averaged there. A mixture-of-
experts layer's are not: an expert is held by the expert-data-parallel ranks only, and with
tp > 1 each tp rank routes other tokens, so its gradient is partial over tp too. Each parameter's
``placement.reduce`` names that view; data parallelism and ZeRO build one reduction unit per view
(``ReduceGroup``) instead of one for the whole model.

Every gradient is the sum of the ranks' partial gradients divided by the number of loss shares
(dp x cp: each such rank's loss is the mean over its share of the tokens). Averaging over a group
of g ranks divides by g, so ``scale`` = g / (dp x cp) makes up the difference: 1 for dense
parameters, tp / ep for experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torch import nn

from ..comm import Group
from ..placement import placement_of


@dataclass(frozen=True)
class ReduceGroup:
    """Where the gradients of a set of parameters are reduced: averaged over ``group`` (ZeRO:
    reduce-scattered over it, then averaged over ``replicas``, the HSDP copies of the shards), then
    multiplied by ``scale``."""

    group: Group
    scale: float = 1.0
    replicas: Group | None = None
    view: str | None = None
    """The mesh view ``group`` is (what checkpoints and the gradient norm read: the axes along
    which ZeRO's shards differ)."""


def by_reduce_group(named: list[tuple[str, nn.Parameter]], default: ReduceGroup,
                    groups: Mapping[str, ReduceGroup] | None) -> list[tuple[ReduceGroup, list[tuple[str, nn.Parameter]]]]:
    """``named`` split by the view each placement's ``reduce`` names (None: ``default``), each part
    in the given order, the parts in order of their first parameter. Raises ``ValueError`` for a
    view ``groups`` does not hold."""
    parts: dict[str | None, list[tuple[str, nn.Parameter]]] = {}
    for name, p in named:
        parts.setdefault(placement_of(p).reduce, []).append((name, p))
    out = []
    for view, members in parts.items():
        if view is None:
            out.append((default, members))
        elif groups is None or view not in groups:
            raise ValueError(f"parameter {members[0][0]} is reduced over mesh view {view!r}, which this wrapper was "
                             f"not given (reduce_groups has {sorted(groups or {})})")
        else:
            out.append((groups[view], members))
    return out
