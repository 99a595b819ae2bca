"""The rank grid: a mesh of named axes, the groups derived from it, and views that flatten axes.

A ``Mesh`` is an ordered list of named axes, slowest first, over a communicator's world: a rank's
coordinate on each axis is its mixed-radix digit, so the last axis varies fastest (a tp group is a
run of consecutive ranks: the same host on a real cluster). A *view* names a flattened run of axes
(``dp`` = dp_replicate x dp_shard); its coordinate is the axes' digits read together. Every axis
and view has a group; any new dimension (expert parallel next) joins by adding an axis and the
views that flatten it, as torchtitan's ``ParallelDims`` does.

The training mesh ``Mesh(dp, pp, cp, tp, dp_replicate=1)`` has the axes
(dp_replicate, dp_shard, pp, cp, tp) and the views dp, dp_cp (the gradient-averaging group) and
dp_shard_cp (the ZeRO sharding group); with dp_replicate = 1,
rank = ((dp * pp + pp_i) * cp + cp_i) * tp + tp_i.
"""

from __future__ import annotations

import math
from itertools import product
from typing import Iterator, Mapping, Sequence

from . import comm
from .comm import Communicator, Group
from .config.parallel import check_dp_replicate
from .errors import ConfigError

DIMS = ("dp", "pp", "cp", "tp")
"""The four user-facing degrees of the training mesh (dp is the view dp_replicate x dp_shard)."""
TRAINING_AXES = ("dp_replicate", "dp_shard", "pp", "cp", "tp")
"""The training mesh's axes, slowest first."""
TRAINING_VIEWS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}
"""Flattened axes of the training mesh: data parallel, gradient averaging, ZeRO sharding."""


class Coords:
    """A rank's coordinate on every axis and view of a mesh: ``coords.tp``, ``coords["dp_shard"]``."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, int]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> int:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no mesh axis or view {name!r}; have {sorted(self._values)}") from None

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Coords are read-only")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Coords) and other._values == self._values

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __reduce__(self) -> tuple:
        return (Coords, (self._values,))

    def __repr__(self) -> str:
        return "Coords(" + ", ".join(f"{k}={v}" for k, v in self._values.items()) + ")"


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


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def validate_degrees(world_size: int, dp: int, pp: int = 1, cp: int = 1, tp: int = 1,
                     dp_replicate: int = 1) -> None:
    """Raise ``ConfigError`` unless the degrees are positive integers whose product is ``world_size``
    and ``dp_replicate`` divides ``dp``."""
    degrees = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    bad = [f"{d}={v!r}" for d, v in degrees.items() if not _positive_int(v)]
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
    check_dp_replicate(dp, dp_replicate)


class Mesh:
    """Named axes over a communicator's world, with one group per axis and per view.

    ``Mesh(dp, pp, cp, tp, dp_replicate=1)`` is the training mesh; ``Mesh.of(axes, views)`` any
    other. Every rank creates the groups of every axis and view in the same order (as
    ``new_group`` requires) and keeps the ones it belongs to: ``mesh.group("tp")`` is this rank's
    tensor-parallel group. An axis or view whose non-trivial axes are those of one already built
    shares its group (dp_shard and dp are one group when dp_replicate = 1). Degrees are validated
    before any group is created.
    """

    def __init__(self, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1,
                 communicator: Communicator | None = None, *, dp_replicate: int = 1) -> None:
        c = communicator or comm.current()
        validate_degrees(c.world_size, dp, pp, cp, tp, dp_replicate)
        sizes = dict(zip(TRAINING_AXES, (dp_replicate, dp // dp_replicate, pp, cp, tp)))
        self._setup(c, sizes, TRAINING_VIEWS, DIMS)

    @classmethod
    def of(cls, axes: Mapping[str, int], views: Mapping[str, Sequence[str]] | None = None,
           communicator: Communicator | None = None) -> "Mesh":
        """A mesh of any named axes (slowest first) and views (each a run of those axes)."""
        c = communicator or comm.current()
        if not axes or not all(_positive_int(v) for v in axes.values()):
            raise ConfigError(f"mesh axes must be positive integers, got {dict(axes)!r}")
        if math.prod(axes.values()) != c.world_size:
            raise ConfigError(f"the mesh axes {dict(axes)} hold {math.prod(axes.values())} ranks but the world "
                              f"size is {c.world_size}; their sizes must multiply to it")
        order = list(axes)
        for name, run in (views or {}).items():
            idx = [order.index(a) if a in order else -1 for a in run]
            if name in axes or not run or -1 in idx or idx != list(range(idx[0], idx[0] + len(idx))):
                raise ConfigError(f"view {name!r} = {tuple(run)} must be a new name for a run of adjacent "
                                  f"mesh axes, slowest first, out of {order}")
        mesh = cls.__new__(cls)
        mesh._setup(c, dict(axes), {k: tuple(v) for k, v in (views or {}).items()}, tuple(axes))
        return mesh

    def _setup(self, c: Communicator, sizes: dict[str, int], views: dict[str, tuple[str, ...]],
               dims: tuple[str, ...]) -> None:
        self.comm = c
        self.world_size, self.rank = c.world_size, c.rank
        self.axes: dict[str, int] = sizes
        """Axis name -> size, slowest first."""
        self.views: dict[str, tuple[str, ...]] = views
        """View name -> the axes it flattens."""
        self.dims = dims
        self.coords = self.coords_of(self.rank)
        self._groups: dict[str, Group] = {}
        built: dict[tuple[str, ...], Group] = {}
        # fastest axis first, then the views: the order every rank creates groups in
        for name, run in [(a, (a,)) for a in reversed(list(sizes))] + list(views.items()):
            key = tuple(a for a in run if sizes[a] > 1)
            if key not in built:
                built[key] = self._build(run)
            self._groups[name] = built[key]

    # -- sizes and coordinates ---------------------------------------------------------------------

    def size(self, name: str) -> int:
        """The number of ranks along an axis or view."""
        return math.prod(self.axes[a] for a in self._run(name))

    def _run(self, name: str) -> tuple[str, ...]:
        if name in self.axes:
            return (name,)
        if name in self.views:
            return self.views[name]
        raise ValueError(f"unknown mesh axis {name!r}: use one of {sorted(self._groups)}")

    @property
    def shape(self) -> dict[str, int]:
        """The size of each user-facing dimension (dp, pp, cp, tp for the training mesh)."""
        return {d: self.size(d) for d in self.dims}

    def rank_of(self, *positional: int, **coords: int) -> int:
        """The global rank at these coordinates (positional in ``dims`` order, or by axis or view
        name; a missing one is 0)."""
        named = dict(zip(self.dims, positional))
        named.update(coords)
        digits = {a: 0 for a in self.axes}
        for name, v in named.items():
            run = self._run(name)
            if not 0 <= v < self.size(name):
                raise ValueError(f"{name} coordinate {v} out of range 0..{self.size(name) - 1}")
            for a in reversed(run):  # a view's coordinate is its axes' digits, last axis fastest
                digits[a], v = v % self.axes[a], v // self.axes[a]
        rank = 0
        for a, n in self.axes.items():
            rank = rank * n + digits[a]
        return rank

    def coords_of(self, rank: int) -> Coords:
        """The coordinates of a global rank on every axis and view."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")
        values: dict[str, int] = {}
        rest = rank
        for a in reversed(list(self.axes)):
            values[a], rest = rest % self.axes[a], rest // self.axes[a]
        values = {a: values[a] for a in self.axes}
        for name, run in self.views.items():
            v = 0
            for a in run:
                v = v * self.axes[a] + values[a]
            values[name] = v
        return Coords(values)

    # -- groups ------------------------------------------------------------------------------------

    def _build(self, run: tuple[str, ...]) -> Group:
        """Create the groups that vary along ``run`` (all of them, on every rank); return ours."""
        fixed = [a for a in self.axes if a not in run]
        mine: Group | None = None
        for fixed_vals in product(*(range(self.axes[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_vals))
            ranks = [self.rank_of(**base, **dict(zip(run, vals)))
                     for vals in product(*(range(self.axes[a]) for a in run))]
            if len(ranks) == 1:
                if ranks[0] == self.rank:  # a size-1 axis needs no group of the world's
                    mine = _Singleton(self.comm, ranks)
                continue
            g = self.comm.new_group(ranks)
            if self.rank in ranks:
                mine = g
        assert mine is not None
        return mine

    def group(self, name: str) -> Group:
        """This rank's group along an axis or view (training mesh: 'dp_replicate', 'dp_shard',
        'pp', 'cp', 'tp', 'dp', 'dp_cp', 'dp_shard_cp')."""
        if name not in self._groups:
            raise ValueError(f"unknown mesh axis {name!r}: use one of {sorted(self._groups)}")
        return self._groups[name]

    def is_first_replica(self, distinct: Sequence[str]) -> bool:
        """Whether this rank is coordinate 0 on every axis other than ``distinct`` (the axes along
        which the ranks hold different values) and pp: the one rank of a set of identical copies
        that writes it."""
        flat = {a for name in distinct for a in self._run(name)} | {"pp"}
        return all(self.coords[a] == 0 for a in self.axes if a not in flat)

    @property
    def dp(self) -> int:
        """Data-parallel degree (dp_replicate x dp_shard)."""
        return self.size("dp")

    @property
    def pp(self) -> int:
        """Pipeline-parallel degree."""
        return self.size("pp")

    @property
    def cp(self) -> int:
        """Context-parallel degree."""
        return self.size("cp")

    @property
    def tp(self) -> int:
        """Tensor-parallel degree."""
        return self.size("tp")

    @property
    def dp_group(self) -> Group:
        """Data-parallel group (dp_replicate x dp_shard)."""
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
        return self.coords.pp == self.size("pp") - 1

    def stage_rank(self, stage: int) -> int:
        """The global rank of pipeline ``stage`` that shares this rank's other coordinates."""
        here = {a: self.coords[a] for a in self.axes}
        here["pp"] = stage % self.size("pp")
        return self.rank_of(**here)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.world_size))

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={n}" for a, n in self.axes.items())
        at = ", ".join(f"{a}={self.coords[a]}" for a in self.axes)
        return f"Mesh({shape}; rank {self.rank} at {at})"


class _Singleton(Group):
    """A group holding only this rank, for a size-1 axis: no collective ever moves data."""

    def __init__(self, communicator: Communicator, ranks: list[int]) -> None:
        super().__init__(communicator, -1, ranks, communicator.timeout)
