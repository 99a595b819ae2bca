"""The mesh's dimensions as one table: the degrees a run sets, the axes they lay out, the views.

Everything that iterates over the parallel dimensions reads this module: the ``[parallel]``
config keys (``ParallelSection`` gets one field per ``DEGREES`` entry), their checks
(``check_degrees``), the training ``Mesh`` (its axes and views), the launcher's world size, the
run summary and the emitted cluster jobs. A new dimension is a ``Degree`` here, its axes in
``AXES`` and the views that name it in ``VIEWS``, plus the files of the feature itself.

Degrees either multiply the world size (dp, pp, cp, tp) or are *carved* out of others and add no
ranks: ``dp_replicate`` out of dp (HSDP: replicas of ZeRO's shards), ``ep`` out of dp_shard x cp
(expert parallelism, as torchtitan lays it out: experts are split over ep, and the ranks of one
expert-parallel group exchange tokens). Plain data, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from ..errors import ConfigError


@dataclass(frozen=True)
class Degree:
    """One parallel dimension a run sets: ``[parallel] <name> = <int>``."""

    name: str
    doc: str
    default: int = 1
    carved_from: tuple[str, ...] = ()
    """() when the degree multiplies the world size; else the (derived) degrees whose product it
    must divide, adding no ranks."""


DEGREES: tuple[Degree, ...] = (
    Degree("dp", "Data-parallel degree (replicas, or ZeRO shards).", 2),
    Degree("dp_replicate", "Of dp, how many replicas of ZeRO's shards (HSDP): ZeRO shards over dp / "
           "dp_replicate (x cp) and averages each shard's gradient over the replicas; must divide dp. "
           "Without ZeRO every dp rank is a replica anyway.", 1, ("dp",)),
    Degree("tp", "Tensor-parallel degree (heads, MLP width and vocabulary split over tp ranks).", 2),
    Degree("pp", "Pipeline-parallel degree (stages).", 1),
    Degree("cp", "Context-parallel degree (ring attention over sequence chunks).", 1),
    Degree("ep", "Expert-parallel degree (mixture-of-experts models): the routed experts are split "
           "over ep ranks taken out of dp_shard x cp (it adds no ranks; a multiple of cp dividing "
           "dp / dp_replicate x cp and model.n_experts), which exchange tokens by all-to-all.", 1,
           ("dp_shard", "cp")),
)
"""The degrees, in config order."""

DEGREE_NAMES = tuple(d.name for d in DEGREES)
WORLD_DEGREES = tuple(d.name for d in DEGREES if not d.carved_from)
"""The degrees whose product is the number of ranks."""


def _derived(d: Mapping[str, int]) -> dict[str, int]:
    """The degrees plus the products the carving rules name (dp_shard = dp / dp_replicate)."""
    out = dict(d)
    out["dp_shard"] = d["dp"] // d["dp_replicate"]
    return out


def ep_in_dp(d: Mapping[str, int]) -> int:
    """The part of ep taken from dp_shard (the rest of ep is cp: ep spans the whole cp group)."""
    return d["ep"] // d["cp"] if d["ep"] > 1 else 1


AXES: dict[str, Callable[[Mapping[str, int]], int]] = {
    "dp_replicate": lambda d: d["dp_replicate"],
    "dp_shard_mod_ep": lambda d: d["dp"] // d["dp_replicate"] // ep_in_dp(d),
    "dp_shard_in_ep": ep_in_dp,
    "pp": lambda d: d["pp"],
    "cp": lambda d: d["cp"],
    "tp": lambda d: d["tp"],
}
"""The training mesh's axes, slowest first, each sized from the degrees. dp_shard is cut in two
(the part outside and inside an expert group), so a rank's number is the one it had before ep
existed: rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i."""

VIEWS: dict[str, tuple[str, ...]] = {
    "dp_shard": ("dp_shard_mod_ep", "dp_shard_in_ep"),
    "dp": ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep"),
    "dp_cp": ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp"),
    "dp_shard_cp": ("dp_shard_mod_ep", "dp_shard_in_ep", "cp"),
    "ep": ("dp_shard_in_ep", "cp"),
}
"""Named sets of axes read as one (a rank's coordinate is their digits, slowest first): dp (the
rows of the batch), dp_cp (dense gradients are averaged over it), dp_shard_cp (ZeRO shards dense
parameters over it), ep (experts are split over it)."""

REDUCTION_VIEWS: tuple[str, ...] = ("dp_replicate", "dp_cp", "dp_shard_cp")
"""The axes and views gradients are reduced over (data parallelism, ZeRO's shards, HSDP's
replicas). The mesh builds each a second group for the reduction alone (``Mesh.reduction_group``),
apart from the computation's even where the ranks are the same: the two streams of calls issue
in orders of their own, and one group carries one stream."""

DIMS = ("dp", "pp", "cp", "tp", "ep")
"""The degrees ``Mesh.shape`` reports (dp is dp_replicate x dp_shard)."""


def positive_int(v: object) -> bool:
    """True for an int (not a bool) >= 1: what a degree, a count or a size must be."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def degrees_of(values: object) -> dict[str, int]:
    """Every degree read off an object with one attribute per degree (a ``ParallelSection``)."""
    return {d.name: getattr(values, d.name) for d in DEGREES}


def world_size_of(degrees: Mapping[str, int]) -> int:
    """The number of ranks a layout needs: the product of the degrees that are not carved."""
    return math.prod(degrees.get(n, 1) for n in WORLD_DEGREES)


def _suggest(world_size: int, degrees: Mapping[str, int]) -> str:
    """A valid factorisation close to the given one: keep what divides, put the rest on dp."""
    keep = {d: v for d, v in degrees.items() if d in WORLD_DEGREES and d != "dp" and positive_int(v)}
    inner = 1
    for d in ("tp", "cp", "pp"):
        v = keep.get(d, 1)
        if world_size % (inner * v) == 0:
            inner *= v
        else:
            keep[d] = 1
    keep["dp"] = world_size // inner
    return ", ".join(f"{d}={keep.get(d, 1)}" for d in ("dp", "pp", "cp", "tp"))


def check_degrees(degrees: Mapping[str, object], world_size: int | None = None,
                  key: Callable[[str], str] = lambda n: n) -> dict[str, int]:
    """Raise ``ConfigError`` unless every degree is a positive integer, the world degrees multiply
    to ``world_size`` (when given) and each carved degree divides what it is carved from (ep also
    a multiple of cp). Missing degrees are 1. Returns the degrees, complete. ``key`` names a degree
    in messages (``parallel.ep`` in a config)."""
    d: dict[str, object] = {n: degrees.get(n, 1) for n in DEGREE_NAMES}
    unknown_names = sorted(set(degrees) - set(DEGREE_NAMES))
    if unknown_names:
        raise ConfigError(f"unknown parallel degree(s) {unknown_names}; the degrees are {', '.join(DEGREE_NAMES)}")
    bad = [f"{key(n)} = {v!r}" for n, v in d.items() if not positive_int(v)]
    if bad:
        hint = f"; for world size {world_size} use e.g. {_suggest(world_size, d)}" if world_size else ""  # type: ignore[arg-type]
        raise ConfigError(f"parallel degrees must be positive integers, got {', '.join(bad)} (each >= 1; 1 turns "
                          f"a dimension off){hint}")
    ints: dict[str, int] = {n: int(v) for n, v in d.items()}  # type: ignore[call-overload]
    prod = world_size_of(ints)
    if world_size is not None and prod != world_size:
        names = "*".join(WORLD_DEGREES)
        vals = "*".join(str(ints[n]) for n in WORLD_DEGREES)
        raise ConfigError(f"{names} = {vals} = {prod} but the world size is {world_size}; the degrees must "
                          f"multiply to the number of ranks, e.g. {_suggest(world_size, ints)}")
    check_dp_replicate(ints["dp"], ints["dp_replicate"], key("dp_replicate"))
    derived = _derived(ints)
    for deg in DEGREES:
        if not deg.carved_from or deg.name == "dp_replicate":
            continue
        whole = math.prod(derived[n] for n in deg.carved_from)
        rule = _CARVE_RULES.get(deg.name, lambda x, d: True)
        if whole % ints[deg.name] or not rule(ints[deg.name], ints):
            choices = [x for x in range(1, whole + 1) if whole % x == 0 and rule(x, ints)]
            what = " x ".join(f"{n} = {derived[n]}" for n in deg.carved_from)
            extra = f" and be a multiple of cp = {ints['cp']}" if deg.name == "ep" else ""
            raise ConfigError(f"{key(deg.name)} = {ints[deg.name]} must divide {what} (= {whole}){extra}; it is "
                              f"carved out of them and adds no ranks: use one of {choices}")
    return ints


_CARVE_RULES: dict[str, Callable[[int, Mapping[str, int]], bool]] = {
    "ep": lambda v, d: v == 1 or v % d["cp"] == 0,  # an expert group holds whole cp groups (torchtitan's rule)
}
"""Rules a carved degree obeys beyond dividing what it is carved from."""


def check_dp_replicate(dp: int, dp_replicate: object, key: str = "dp_replicate") -> None:
    """Raise ``ConfigError`` unless ``dp_replicate`` is a positive integer dividing ``dp``
    (dp = dp_replicate x dp_shard: replicas of ZeRO's shards, HSDP)."""
    if isinstance(dp_replicate, bool) or not isinstance(dp_replicate, int) or dp_replicate < 1 or dp % dp_replicate:
        ok = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ConfigError(f"{key} = {dp_replicate!r} must be a positive integer that divides dp = {dp} "
                          f"(dp = dp_replicate x dp_shard); use one of {ok}")


def axis_sizes(degrees: Mapping[str, int]) -> dict[str, int]:
    """The training mesh's axis sizes, slowest first, for checked degrees."""
    return {axis: size(degrees) for axis, size in AXES.items()}


__all__ = ["Degree", "DEGREES", "DEGREE_NAMES", "WORLD_DEGREES", "AXES", "VIEWS", "REDUCTION_VIEWS", "DIMS", "degrees_of",
           "world_size_of", "check_degrees", "check_dp_replicate", "axis_sizes", "ep_in_dp", "positive_int"]
