"""The rank grid: a mesh of named axes, the groups derived from it, and views that flatten axes.

A ``Mesh`` is an ordered list of named axes, slowest first, over a communicator's world: a rank's
coordinate on each axis is its mixed-radix digit, so the last axis varies fastest (a tp group is a
run of consecutive ranks: the same host on a real cluster). A *view* names a set of axes read as
one (``dp`` = dp_replicate x dp_shard); its coordinate is the axes' digits read together, slowest
first. Every axis and view has a group.

The training mesh ``Mesh(dp, pp, cp, tp, dp_replicate=1, ep=1)`` takes its axes and views from
the dimensions' table, ``meshtrain.config.dims``: the axes (dp_replicate, dp_shard_mod_ep,
dp_shard_in_ep, pp, cp, tp) and the views dp, dp_shard, dp_cp (dense gradients are averaged over
it), dp_shard_cp (ZeRO's shards) and ep (the expert-parallel group, dp_shard_in_ep x cp). A layer
that needs another set of axes (the experts' gradient group) adds it with ``add_views``.
rank = ((dp * pp + pp_i) * cp + cp_i) * tp + tp_i, whatever ep is.

One group carries one stream of calls. The training thread calls the computation's collectives
(tp, cp, pp, the experts' all-to-all, statistics) in program order; data parallelism reduces
gradients on a thread of its own, in bucket order, and ZeRO gathers and reduce-scatters from its
hooks. Two streams on one group would interleave differently on different ranks (the all-to-all
in backward and a bucket's all-reduce: a mismatch, a hang, or on NCCL garbage), so the views
gradients are reduced over (``REDUCTION_VIEWS``, plus those ``add_views(..., reduction=...)``
names) get groups of their own, ``reduction_group(name)``, even where their ranks are those of a
computation group (torchtitan's DeviceMesh and Megatron's expert grid do the same).
"""

from __future__ import annotations

import math
from itertools import product
from typing import Iterable, Iterator, Mapping, Sequence

from . import comm
from .comm import Communicator, Group
from .config.dims import AXES, DIMS, REDUCTION_VIEWS, VIEWS, axis_sizes, check_degrees, positive_int
from .errors import ConfigError

TRAINING_AXES = tuple(AXES)
"""The training mesh's axes, slowest first (``meshtrain.config.dims.AXES``)."""
TRAINING_VIEWS: dict[str, tuple[str, ...]] = dict(VIEWS)
"""Named sets of the training mesh's axes (``meshtrain.config.dims.VIEWS``)."""


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


def _check_view(name: str, run: tuple[str, ...], order: list[str], views: Mapping[str, tuple[str, ...]]) -> None:
    """Raise ``ConfigError`` unless view ``name`` is a new name (or one already meaning ``run``)
    for mesh axes listed in mesh order."""
    idx = [order.index(a) if a in order else -1 for a in run]
    if name in order or not run or -1 in idx or idx != sorted(set(idx)) or views.get(name, run) != run:
        raise ConfigError(f"view {name!r} = {run} must be a new name for mesh axes in mesh order, slowest first, "
                          f"out of {order}")


def validate_degrees(world_size: int, dp: int, pp: int = 1, cp: int = 1, tp: int = 1, **carved: int) -> None:
    """Raise ``ConfigError`` unless the degrees are positive integers whose product is ``world_size``
    and each carved degree (``dp_replicate``, ``ep``) divides what it is carved from."""
    check_degrees({"dp": dp, "pp": pp, "cp": cp, "tp": tp, **carved}, world_size)


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
                 communicator: Communicator | None = None, **carved: int) -> None:
        c = communicator or comm.current()
        degrees = check_degrees({"dp": dp, "pp": pp, "cp": cp, "tp": tp, **carved}, c.world_size)
        self.degrees: dict[str, int] = degrees
        """The degrees the training mesh was built from (every one of ``config.dims.DEGREES``)."""
        self._setup(c, axis_sizes(degrees), TRAINING_VIEWS, DIMS, REDUCTION_VIEWS)

    @classmethod
    def of(cls, axes: Mapping[str, int], views: Mapping[str, Sequence[str]] | None = None,
           communicator: Communicator | None = None, reduction: Sequence[str] = ()) -> "Mesh":
        """A mesh of any named axes (slowest first) and views (each a set of those axes, in mesh
        order); ``reduction`` names the axes and views that also get a reduction group."""
        c = communicator or comm.current()
        if not axes or not all(positive_int(v) for v in axes.values()):
            raise ConfigError(f"mesh axes must be positive integers, got {dict(axes)!r}")
        if math.prod(axes.values()) != c.world_size:
            raise ConfigError(f"the mesh axes {dict(axes)} hold {math.prod(axes.values())} ranks but the world "
                              f"size is {c.world_size}; their sizes must multiply to it")
        for name, run in (views or {}).items():
            _check_view(name, tuple(run), list(axes), {})
        mesh = cls.__new__(cls)
        mesh.degrees = {}
        mesh._setup(c, dict(axes), {k: tuple(v) for k, v in (views or {}).items()}, tuple(axes), tuple(reduction))
        return mesh

    def _setup(self, c: Communicator, sizes: dict[str, int], views: dict[str, tuple[str, ...]],
               dims: tuple[str, ...], reduction: tuple[str, ...]) -> None:
        self.comm = c
        self.world_size, self.rank = c.world_size, c.rank
        self.axes: dict[str, int] = sizes
        """Axis name -> size, slowest first."""
        self.views: dict[str, tuple[str, ...]] = dict(views)
        """View name -> the axes it flattens."""
        self.dims = dims
        self.coords = self.coords_of(self.rank)
        self._groups: dict[str, Group] = {}
        self._reduction: dict[str, Group] = {}
        self._built: dict[tuple[bool, tuple[str, ...]], Group] = {}
        # fastest axis first, then the views, then the reduction's: the order every rank creates groups in
        for name, run in [(a, (a,)) for a in reversed(list(sizes))] + list(views.items()):
            self._group_for(name, run)
        self._add_reduction(reduction)

    def _group_for(self, name: str, run: tuple[str, ...], reduction: bool = False) -> None:
        # groups of one stream are shared where their ranks are (dp, dp_cp and dp_shard_cp are one
        # group when cp = dp_replicate = 1); the two streams never share one
        key = (reduction, tuple(a for a in run if self.axes[a] > 1))
        if key not in self._built:
            self._built[key] = self._build(run)
        (self._reduction if reduction else self._groups)[name] = self._built[key]

    def _add_reduction(self, names: Sequence[str]) -> None:
        for name in names:
            if name not in self._reduction:
                self._group_for(name, self._run(name), reduction=True)

    def add_views(self, views: Mapping[str, Sequence[str]], reduction: Sequence[str] = ()) -> None:
        """Add named sets of axes (each in mesh order) and their groups, and reduction groups for
        the axes and views ``reduction`` names (``reduction_group``). Collective over the world:
        every rank must add the same views in the same order (a view already there with the same
        axes is kept)."""
        for name, run in views.items():
            run = tuple(run)
            _check_view(name, run, list(self.axes), self.views)
            if name not in self.views:
                self.views[name] = run
                self._group_for(name, run)
        self._add_reduction(reduction)
        self.coords = self.coords_of(self.rank)

    # -- sizes and coordinates ---------------------------------------------------------------------

    def size(self, name: str) -> int:
        """The number of ranks along an axis or view."""
        return math.prod(self.axes[a] for a in self._run(name))

    def axes_of(self, names: Iterable[str]) -> frozenset[str]:
        """The axes the given axes and views are made of."""
        return frozenset(a for n in names for a in self._run(n))

    def _run(self, name: str) -> tuple[str, ...]:
        if name in self.axes:
            return (name,)
        if name in self.views:
            return self.views[name]
        raise ValueError(f"unknown mesh axis {name!r}: use one of {sorted(self._groups)}")

    def name_of(self, axes: Sequence[str]) -> str:
        """The name of the axis or view made of exactly ``axes`` (in mesh order); ValueError if none."""
        run = tuple(a for a in self.axes if a in set(axes))
        for name in list(self.axes) + list(self.views):
            if self._run(name) == run:
                return name
        raise ValueError(f"no mesh axis or view is {run}; add it with Mesh.add_views")

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
        """This rank's group along an axis or view (training mesh: its axes, and 'dp', 'dp_shard',
        'dp_cp', 'dp_shard_cp', 'ep', plus any ``add_views`` added)."""
        if name not in self._groups:
            raise ValueError(f"unknown mesh axis {name!r}: use one of {sorted(self._groups)}")
        return self._groups[name]

    def reduction_group(self, name: str) -> Group:
        """This rank's group along an axis or view for gradient reduction alone (data parallelism,
        ZeRO): the same ranks as ``group(name)`` but a group of its own, so that the reduction's
        calls never interleave with the computation's (module docstring). The training mesh has
        one for each of ``REDUCTION_VIEWS``; ``add_views(..., reduction=...)`` adds others."""
        if name not in self._reduction:
            raise ValueError(f"no reduction group for mesh axis or view {name!r}: the mesh has them for "
                             f"{sorted(self._reduction)}; add one with Mesh.add_views(..., reduction=[{name!r}])")
        return self._reduction[name]

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
    def ep(self) -> int:
        """Expert-parallel degree (carved out of dp_shard x cp)."""
        return self.size("ep") if "ep" in self.views or "ep" in self.axes else 1

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
