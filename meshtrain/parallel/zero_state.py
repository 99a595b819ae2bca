"""What a ZeRO rank holds of each full parameter, as boxes: the one description that checkpoints
(``train/checkpoint_state.py``) and the in-memory shard states below both use.

A rank owns a contiguous range of each unit's flat buffer, so its part of one parameter is a flat
range of that parameter. ``flat_boxes`` cuts a flat range into boxes of the parameter (a partial
first row, whole rows, a partial last row, recursively: at most 2 x ndim - 1, each contiguous in
memory), and ``unit_regions`` gives, per parameter, each box with where it starts in the shard.

A shard state names every piece a rank holds: ``{name: [(box, values), ...]}``, plus every
parameter's shape. Loading under another dp size copies, for each box this rank needs, the
overlapping parts of the pieces of every saving rank. No collective is needed, and what is saved
never depends on the dp size that reads it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from .flat_unit import FlatUnit

Box = tuple[tuple[int, int], ...]  # (lo, hi) per dim of the full tensor
Pieces = dict[str, list[tuple[Box, torch.Tensor]]]


def flat_boxes(shape: Sequence[int], a: int, b: int) -> list[tuple[Box, int]]:
    """Elements [a, b) of a row-major tensor of ``shape`` as boxes (each contiguous in memory), with
    the flat index each starts at."""
    if b <= a:
        return []
    if len(shape) <= 1:
        return [(((a, b),) if len(shape) else (), a)]
    inner = math.prod(shape[1:])
    first, last = -(-a // inner), b // inner  # the whole rows are [first, last)
    if first > last:  # inside one row
        r = a // inner
        return [(((r, r + 1),) + box, s + r * inner) for box, s in flat_boxes(shape[1:], a - r * inner, b - r * inner)]
    out: list[tuple[Box, int]] = []
    if a < first * inner:
        r = first - 1
        out += [(((r, r + 1),) + box, s + r * inner) for box, s in flat_boxes(shape[1:], a - r * inner, inner)]
    if last > first:
        out.append((((first, last),) + tuple((0, n) for n in shape[1:]), first * inner))
    if b > last * inner:
        out += [(((last, last + 1),) + box, s + last * inner) for box, s in flat_boxes(shape[1:], 0, b - last * inner)]
    return out


def unit_regions(u: "FlatUnit") -> dict[str, list[tuple[Box, int]]]:
    """Per parameter of ``u`` (every one, maybe with no box): the boxes of it this rank's shard
    holds, each with the index in the shard where its values start."""
    out: dict[str, list[tuple[Box, int]]] = {n: [] for n in u.names}
    for name, p_start, s_start, length in u.param_name_slices():
        shape = u.shapes[u.names.index(name)]
        out[name] += [(box, s_start + f - p_start) for box, f in flat_boxes(shape, p_start, p_start + length)]
    return out


def extent(box: Box) -> list[int]:
    """A box's size per dim."""
    return [hi - lo for lo, hi in box]


def unit_pieces(u: "FlatUnit", shard: torch.Tensor) -> Pieces:
    """The pieces of each parameter held in ``shard`` (a tensor laid out like ``u.master``), copied."""
    return {name: [(box, shard[s : s + math.prod(extent(box))].detach().clone().view(extent(box)))
                   for box, s in regions]
            for name, regions in unit_regions(u).items() if regions}


def shard_from_pieces(u: "FlatUnit", pieces: Sequence[Pieces], dtype: torch.dtype, what: str) -> torch.Tensor:
    """Assemble this rank's shard of ``u`` from the pieces of any set of saving ranks."""
    out = torch.zeros(u.shard_size, dtype=dtype, device=u.master.device)
    for name, regions in unit_regions(u).items():
        need = covered = 0
        for box, s in regions:
            dst = out[s : s + math.prod(extent(box))].view(extent(box))
            need += dst.numel()
            for src in pieces:
                for sbox, vals in src.get(name, []):
                    inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, sbox)]
                    if any(lo >= hi for lo, hi in inter):
                        continue
                    part = vals[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, sbox))]
                    dst[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, box))] = part.to(dtype)
                    covered += part.numel()
        if covered != need:
            raise ValueError(
                f"{what} {name}: the given shards cover {covered} of the {need} elements this rank "
                f"needs; pass the shard states of every rank that saved the checkpoint"
            )
    return out


def check_shapes(units: Sequence["FlatUnit"], shapes: dict[str, Sequence[int]]) -> None:
    """Every parameter of the model must have been saved with the same shape."""
    for u in units:
        for name, shape in zip(u.names, u.shapes):
            if name not in shapes:
                raise KeyError(f"parameter {name} is not in the saved state; was it saved from this model?")
            if tuple(shapes[name]) != tuple(shape):
                raise ValueError(f"{name}: saved shape {tuple(shapes[name])} does not match the model's "
                                 f"{tuple(shape)}")


def model_shard_state(units: Sequence["FlatUnit"], buffers: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's pieces of every parameter (fp32 masters), all shapes, and the buffers."""
    pieces: Pieces = {}
    for u in units:
        pieces.update(unit_pieces(u, u.master))
    shapes = {n: list(s) for u in units for n, s in zip(u.names, u.shapes)}
    return {"params": pieces, "shapes": shapes, "buffers": {k: v.detach().clone() for k, v in buffers.items()}}


def optimizer_shard_state(units: Sequence["FlatUnit"], opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's pieces of every per-element optimizer state; scalars (e.g. step) per parameter."""
    state: dict[str, dict[str, Any]] = {}
    for u in units:
        for key, val in opt.state.get(u.master, {}).items():
            if torch.is_tensor(val) and val.shape == u.master.shape:
                for name, ps in unit_pieces(u, val).items():
                    state.setdefault(name, {})[key] = ps
            else:
                for name in u.names:
                    state.setdefault(name, {})[key] = val.clone() if torch.is_tensor(val) else val
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"state": state, "param_groups": groups,
            "shapes": {n: list(s) for u in units for n, s in zip(u.names, u.shapes)}}


def load_optimizer_shards(units: Sequence["FlatUnit"], opt: torch.optim.Optimizer,
                          shards: Sequence[dict[str, Any]]) -> None:
    """Rebuild this rank's optimizer state from the shard states of every saving rank."""
    check_shapes(units, shards[0]["shapes"])
    for u in units:
        keys: dict[str, Any] = {}
        for sh in shards:
            for name in u.names:
                for key, val in sh["state"].get(name, {}).items():
                    keys.setdefault(key, val)
        if not keys:
            continue
        new: dict[str, Any] = {}
        for key, sample in keys.items():
            if isinstance(sample, list):  # pieces
                dtype = sample[0][1].dtype if sample else torch.float32
                per = [{n: sh["state"].get(n, {}).get(key, []) for n in u.names} for sh in shards]
                new[key] = shard_from_pieces(u, per, dtype, f"optimizer state {key!r} of")
            else:
                new[key] = sample.clone() if torch.is_tensor(sample) else sample
        opt.state[u.master] = new
    for g, saved in zip(opt.param_groups, shards[0]["param_groups"]):
        g.update(saved)
