"""The 4D rank grid: ``Mesh(dp, pp, cp, tp)`` and its communication groups.

rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i: tp varies fastest, so a tp group is a run of
consecutive ranks (the same host on a real cluster), and dp varies slowest.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Iterator

from . import comm
from .comm import Communicator, Group
from .errors import ConfigError

DIMS = ("dp", "pp", "cp", "tp")


@dataclass(frozen=True)
class Coords:
    """A rank's position on each axis of the mesh."""

    dp: int
    pp: int
    cp: int
    tp: int


def _suggest(world_size: int, degrees: dict[str, int]) -> str:
    """A valid factorisation close to the given one: keep what divides, put the rest on dp."""
    keep = {d: v for d, v in degrees.items() if d != "dp" and isinstance(v, int) and v > 0}
    inner = 1
    for d in ("tp", "cp", "pp"):
        v = keep.get(d, 1)
        if world_size % (inner * v) == 0:
            inner *= v
        else:
            keep[d] = 1
    keep["dp"] = world_size // inner
    return ", ".join(f"{d}={keep.get(d, 1)}" for d in DIMS)


def validate_degrees(world_size: int, dp: int, pp: int = 1, cp: int = 1, tp: int = 1) -> None:
    """Raise ``ConfigError`` unless the degrees are positive integers whose product is ``world_size``."""
    degrees = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    bad = [f"{d}={v!r}" for d, v in degrees.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad:
        raise ConfigError(
            f"parallel degrees must be positive integers, got {', '.join(bad)}; "
            f"for world size {world_size} use e.g. {_suggest(world_size, degrees)}"
        )
    prod = dp * pp * cp * tp
    if prod != world_size:
        raise ConfigError(
            f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {prod} but the world size is {world_size}; the "
            f"degrees must multiply to the number of ranks, e.g. {_suggest(world_size, degrees)}"
        )


class Mesh:
    """The (dp, pp, cp, tp) grid over a communicator's world, with one group per axis.

    Every rank creates every group of every axis in the same order (as ``new_group`` requires) and
    keeps the ones it belongs to: ``mesh.group("tp")`` is this rank's tensor-parallel group, and
    ``mesh.dp_cp`` the combined dp x cp group over which gradients are reduced when context
    parallelism is on. Degrees are validated before any group is created.
    """

    def __init__(self, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1,
                 communicator: Communicator | None = None) -> None:
        self.comm = communicator or comm.current()
        self.world_size = self.comm.world_size
        validate_degrees(self.world_size, dp, pp, cp, tp)
        self.shape = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        self.dp, self.pp, self.cp, self.tp = dp, pp, cp, tp
        self.rank = self.comm.rank
        self.coords = self.coords_of(self.rank)
        self._groups: dict[str, Group] = {}
        for axes in (("tp",), ("cp",), ("pp",), ("dp",), ("dp", "cp")):
            self._groups["_".join(axes)] = self._build(axes)

    def _build(self, axes: tuple[str, ...]) -> Group:
        """Create the groups that vary along ``axes`` (all of them, on every rank); return ours."""
        fixed = [d for d in DIMS if d not in axes]
        mine: Group | None = None
        for fixed_vals in product(*(range(self.shape[d]) for d in fixed)):
            base = dict(zip(fixed, fixed_vals))
            ranks = [self.rank_of(**base, **dict(zip(axes, vals)))
                     for vals in product(*(range(self.shape[a]) for a in axes))]
            if len(ranks) == 1:
                if ranks[0] == self.rank:  # a size-1 axis needs no group of the world's
                    mine = _Singleton(self.comm, ranks)
                continue
            g = self.comm.new_group(ranks)
            if self.rank in ranks:
                mine = g
        assert mine is not None
        return mine

    def rank_of(self, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates."""
        for d, v in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)):
            if not 0 <= v < self.shape[d]:
                raise ValueError(f"{d} coordinate {v} out of range 0..{self.shape[d] - 1}")
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    def coords_of(self, rank: int) -> Coords:
        """The coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")
        tp_i = rank % self.tp
        cp_i = rank // self.tp % self.cp
        pp_i = rank // (self.tp * self.cp) % self.pp
        dp_i = rank // (self.tp * self.cp * self.pp)
        return Coords(dp_i, pp_i, cp_i, tp_i)

    def group(self, axis: str) -> Group:
        """This rank's group along ``axis``: 'dp', 'pp', 'cp', 'tp' or 'dp_cp'."""
        if axis not in self._groups:
            raise ValueError(f"unknown mesh axis {axis!r}: use one of {sorted(self._groups)}")
        return self._groups[axis]

    @property
    def dp_group(self) -> Group:
        """Data-parallel group."""
        return self._groups["dp"]

    @property
    def tp_group(self) -> Group:
        """Tensor-parallel group."""
        return self._groups["tp"]

    @property
    def cp_group(self) -> Group:
        """Context-parallel group."""
        return self._groups["cp"]

    @property
    def pp_group(self) -> Group:
        """Pipeline-parallel group (ordered by stage)."""
        return self._groups["pp"]

    @property
    def dp_cp(self) -> Group:
        """The group gradients are averaged over: dp x cp."""
        return self._groups["dp_cp"]

    @property
    def is_first_stage(self) -> bool:
        """True on pipeline stage 0."""
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage."""
        return self.coords.pp == self.pp - 1

    def stage_rank(self, stage: int) -> int:
        """The global rank of pipeline ``stage`` that shares this rank's dp, cp and tp coordinates."""
        c = self.coords
        return self.rank_of(c.dp, stage % self.pp, c.cp, c.tp)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.world_size))

    def __repr__(self) -> str:
        c = self.coords
        return (f"Mesh(dp={self.dp}, pp={self.pp}, cp={self.cp}, tp={self.tp}; rank {self.rank} at "
                f"dp={c.dp} pp={c.pp} cp={c.cp} tp={c.tp})")


class _Singleton(Group):
    """A group holding only this rank, for a size-1 axis: no collective ever moves data."""

    def __init__(self, communicator: Communicator, ranks: list[int]) -> None:
        super().__init__(communicator, -1, ranks, communicator.timeout)
