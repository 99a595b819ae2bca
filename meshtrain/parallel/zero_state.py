"""Sharded state of a ZeRO model and optimizer: what each rank saves, and how any dp size loads it.

A rank's shard state names every piece it holds: ``{name: [(start, values), ...]}``, where
``values`` are the parameter's flattened elements ``[start, start + len)``. It also records every
parameter's global shape. Loading under another dp size gathers, for each parameter, the pieces
that overlap the new shard, from the shard states of every saving rank. No collective is needed,
and the saved files never depend on the dp size that reads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from .flat_unit import FlatUnit

Pieces = dict[str, list[tuple[int, torch.Tensor]]]


def unit_pieces(u: "FlatUnit", shard: torch.Tensor) -> Pieces:
    """The pieces of each parameter held in ``shard`` (a tensor laid out like ``u.master``)."""
    out: Pieces = {}
    for name, p_start, s_start, length in u.param_name_slices():
        out.setdefault(name, []).append((p_start, shard[s_start : s_start + length].detach().clone()))
    return out


def shard_from_pieces(u: "FlatUnit", pieces: Sequence[Pieces], dtype: torch.dtype, what: str) -> torch.Tensor:
    """Assemble this rank's shard of ``u`` from the pieces of any set of saving ranks."""
    out = torch.zeros(u.shard_size, dtype=dtype, device=u.master.device)
    for name, p_start, s_start, length in u.param_name_slices():
        covered = 0
        for src in pieces:
            for start, vals in src.get(name, []):
                a, b = max(start, p_start), min(start + vals.numel(), p_start + length)
                if a < b:
                    out[s_start + a - p_start : s_start + b - p_start] = vals[a - start : b - start].to(dtype)
                    covered += b - a
        if covered != length:
            raise ValueError(
                f"{what} {name}: the given shards cover {covered} of the {length} elements this rank "
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


