"""Sharded, atomic, resharding checkpoints of a ``ParallelModel`` and its ``ParallelOptimizer``.

``save_checkpoint(root, step, model, optimizer, extra)`` is collective: the ranks with dp = 0 and
cp = 0 write their tensors once each (a parameter without ``.shard`` only from tp = 0) into
``root/step-00000100.tmp/``; after a barrier rank 0 writes ``metadata.json`` (the commit marker),
renames the directory, points ``root/latest`` at it and prunes old checkpoints. Under ZeRO the
stage's state is gathered over dp first and written as if dp were 1.

``load_checkpoint(path, model, optimizer)`` works under any layout: each rank computes which slice
of each full tensor its parameters (and their optimizer state) hold and reads just that slice
from the saved slices. The file format lives in ``checkpoint_io.py``; nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from .. import comm
from ..errors import CheckpointError
from ..parallel.parallel_model import ParallelModel, ParallelOptimizer, unwrap
from ..parallel.zero import ZeroModel
from .checkpoint_io import (FORMAT, LATEST, METADATA, STEP_RE, VERSION, CheckpointReader, Shard, slice_box,
                            committed_steps, from_json, fsync_dir, merge_sidecars, replace_durable,
                            step_dir_name, to_json, write_durable, write_rank_shard)

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint"]


def _shard(p: torch.Tensor) -> Shard:
    """A parameter's tensor-parallel slice (dim, index, parts); whole tensors are (0, 0, 1)."""
    return getattr(p, "shard", (0, 0, 1))


def _agree(model: ParallelModel, exc: BaseException | None, what: str) -> None:
    """Collective: if any rank failed, every rank raises — the failing ranks their own error, the
    others the first failing rank's message — so no rank goes on (or hangs) alone."""
    world = model.mesh.comm.world
    msg = b""
    if exc is not None:
        msg = (str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}").encode() or b"?"
    lengths = torch.zeros(world.size, dtype=torch.float64)
    if exc is not None:
        lengths[world.rank] = len(msg) + 1
    comm.all_reduce(lengths, group=world)
    failed = [r for r in range(world.size) if lengths[r] > 0]
    if not failed:
        return
    src = failed[0]
    buf = torch.zeros(int(lengths[src]) - 1, dtype=torch.int32)  # comm sends no uint8
    if world.rank == src:
        buf.copy_(torch.tensor(list(msg), dtype=torch.int32))
    comm.broadcast(buf, src=world.ranks[src], group=world)
    if isinstance(exc, CheckpointError):
        raise exc
    text = f"{what} failed on rank {world.ranks[src]}: {bytes(buf.tolist()).decode(errors='replace')}"
    raise CheckpointError(text) from exc


# -- save ----------------------------------------------------------------------------------------


def _writer(model: ParallelModel) -> bool:
    """Replicas over dp and cp are written once, by the rank with dp = 0 and cp = 0."""
    return model.mesh.coords.dp == 0 and model.mesh.coords.cp == 0


def _collect(model: ParallelModel, optimizer: ParallelOptimizer | None
             ) -> tuple[dict[str, tuple[torch.Tensor, Shard]], dict[str, dict], list[dict] | None]:
    """This rank's tensors to write (key -> (local tensor, shard)), scalar optimizer state per
    parameter, and the optimizer's param groups. Under ZeRO this gathers over dp (collective)."""
    mesh = model.mesh
    tensors: dict[str, tuple[torch.Tensor, Shard]] = {}
    scalars: dict[str, dict] = {}
    groups: list[dict] | None = None

    def add(name: str, value: torch.Tensor, shard: Shard, state: dict[str, Any] | None) -> None:
        if shard[2] == 1 and mesh.coords.tp != 0:
            return  # a whole tensor is replicated over tp: tp = 0 writes it
        tensors[f"model/{name}"] = (value, shard)
        for k, v in (state or {}).items():
            if torch.is_tensor(v) and v.shape == value.shape and v.dim() > 0:
                tensors[f"optim/{name}/{k}"] = (v, shard)
            elif torch.is_tensor(v) and v.numel() != 1:
                raise CheckpointError(f"optimizer state {k!r} of {name} has shape {tuple(v.shape)}, neither the "
                                      f"parameter's {tuple(value.shape)} nor a scalar; this optimizer's state "
                                      f"cannot be resharded (use AdamW/SGD-like optimizers)")
            else:
                scalars.setdefault(name, {})[k] = to_json(v)

    if model.config.zero_stage:
        opts = optimizer.optimizers if optimizer is not None else [None] * len(model.stages)
        for stage, zopt in zip(model.stages.values(), opts):
            assert isinstance(stage, ZeroModel)
            full = stage.full_state_dict()  # collective over dp x cp: every rank calls it
            ostate = zopt.full_state_dict() if zopt is not None else None
            shards = {n: _shard(p) for n, p in unwrap(stage).named_parameters()}
            if _writer(model):
                for name, value in full.items():
                    add(name, value, shards.get(name, (0, 0, 1)), ostate["state"].get(name) if ostate else None)
            if ostate is not None and groups is None:
                groups = ostate["param_groups"]
    else:
        params = model.named_parameters()
        if optimizer is not None:
            opt = optimizer.optimizers[0]
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        if _writer(model):
            for name, p in params:
                state = dict(optimizer.optimizers[0].state.get(p, {})) if optimizer is not None else None
                add(name, p.detach(), _shard(p), state)
            for stage in model.stages.values():
                for name, b in unwrap(stage).named_buffers():
                    add(name, b.detach(), (0, 0, 1), None)
    return tensors, scalars, groups


def save_checkpoint(root: str, step: int, model: ParallelModel, optimizer: ParallelOptimizer | None,
                    extra: dict[str, Any] | None = None, keep: int = 3) -> str:
    """Save model, optimizer state and ``extra`` as ``root/step-<step>/``; return that path.

    Collective: every rank calls it with the same arguments. ``extra`` (loader state, RNG states,
    config, ...) must be JSON-serialisable except that tensors are allowed (stored as lists, given
    back as tensors). Atomic: a crash leaves at most a ``.tmp`` directory that loading ignores.
    Keeps the newest ``keep`` committed checkpoints (by step), always including this one.
    """
    pending = begin_save(root, step, model, optimizer, extra, keep, snapshot=False)
    pending.write()
    return pending.finish()


class PendingSave:
    """A save in three phases: ``begin_save`` (collective: collect, agree, make the temp dir),
    ``write`` (this rank's shard file; no communication, so it may run on a background thread),
    ``finish`` (collective: agree, rank 0 commits metadata.json, rename, ``latest``, prune)."""

    def __init__(self, root: str, step: int, model: ParallelModel, has_optimizer: bool, tensors: Any,
                 scalars: Any, groups: Any, extra_json: Any, keep: int) -> None:
        self.root, self.step, self.model, self.has_optimizer = root, step, model, has_optimizer
        self.tensors, self.scalars, self.groups, self.extra_json, self.keep = tensors, scalars, groups, extra_json, keep
        self.final = os.path.join(root, step_dir_name(step))
        self.tmp = self.final + ".tmp"
        self.error: BaseException | None = None

    def write(self) -> None:
        """Write this rank's shard (if it is a writer); an error is kept for ``finish`` to share."""
        try:
            if _writer(self.model):
                write_rank_shard(self.tmp, self.model.mesh.comm.rank, self.tensors, self.scalars)
        except BaseException as exc:  # noqa: BLE001 - every rank must learn of it (see _agree)
            self.error = exc
        self.tensors = None  # the snapshot's memory goes as soon as it is on disk

    def finish(self) -> str:
        """Agree that every shard is durable, commit on rank 0, agree again; returns the step dir."""
        model, rank, err = self.model, self.model.mesh.comm.rank, self.error
        try:
            _agree(model, err, "checkpoint save")  # doubles as the barrier before the commit
            try:
                if rank == 0:
                    _commit(self.root, self.tmp, self.final, self.step, model, self.has_optimizer, self.groups,
                            self.extra_json, self.keep)
            except BaseException as exc:  # noqa: BLE001
                err = exc
            _agree(model, err, "checkpoint commit")  # and as the barrier after it
        except CheckpointError:
            if rank == 0:  # never leave a partial directory behind (loading would ignore it anyway)
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return self.final


def begin_save(root: str, step: int, model: ParallelModel, optimizer: ParallelOptimizer | None,
               extra: dict[str, Any] | None = None, keep: int = 3, snapshot: bool = True) -> PendingSave:
    """The collective first phase of a save. With ``snapshot`` the tensors are copied, so training
    may change the parameters while ``write`` runs in the background (an async save)."""
    if not isinstance(step, int) or step < 0 or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"save_checkpoint(step={step!r}, keep={keep!r}): step must be an integer >= 0 "
                              f"and keep an integer >= 1")
    rank = model.mesh.comm.rank
    tmp = os.path.join(root, step_dir_name(step)) + ".tmp"
    err: BaseException | None = None
    tensors = scalars = groups = extra_json = None
    try:
        extra_json = to_json(extra or {})
        json.dumps(extra_json)
        tensors, scalars, groups = _collect(model, optimizer)
        if snapshot:
            tensors = {k: (v.detach().clone(), shard) for k, (v, shard) in tensors.items()}
        if rank == 0:
            if os.path.exists(tmp):  # left by a save that crashed at this step
                shutil.rmtree(tmp)
            os.makedirs(tmp)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it (see _agree)
        err = exc
    try:
        _agree(model, err, "checkpoint save")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PendingSave(root, step, model, optimizer is not None, tensors, scalars, groups, extra_json, keep)


def _commit(root: str, tmp: str, final: str, step: int, model: ParallelModel, has_optimizer: bool,
            groups: list[dict] | None, extra: Any, keep: int) -> None:
    """Rank 0, after every shard is durable: metadata.json (last), rename, ``latest``, prune."""
    entries, files, scalars = merge_sidecars(tmp)
    pc = model.config
    meta = {
        "format": FORMAT, "version": VERSION, "step": step,
        "layout": dict(model.mesh.shape), "world_size": model.mesh.world_size,
        "parallel": {"zero_stage": pc.zero_stage, "schedule": pc.schedule, "microbatches": pc.microbatches,
                     "virtual_stages": pc.virtual_stages, "sequence_parallel": pc.sequence_parallel},
        "files": files, "entries": entries,
        "optimizer": {"param_groups": to_json(groups or []), "scalars": scalars,
                      "has_state": any(e["key"].startswith("optim/") for e in entries) or bool(scalars)}
        if has_optimizer else None,
        "extra": extra,
    }
    commit_step_dir(root, tmp, final, meta, keep)


def commit_step_dir(root: str, tmp: str, final: str, meta: dict[str, Any], keep: int) -> None:
    """Commit the written shards in ``tmp`` as ``final``: metadata.json (the commit marker, last),
    rename, point ``latest`` at it, keep the newest ``keep`` checkpoints, drop crashed saves' temp dirs."""
    write_durable(os.path.join(tmp, METADATA), json.dumps(meta, indent=1).encode())
    fsync_dir(tmp)
    old = final + ".replaced"
    if os.path.exists(final):  # the same step saved again (e.g. after a resume): swap it out
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    replace_durable(os.path.join(root, LATEST), (os.path.basename(final) + "\n").encode())
    if os.path.exists(old):
        shutil.rmtree(old)
    others = [p for _, p in committed_steps(root) if p != final]
    for p in others[: max(0, len(others) - (keep - 1))]:
        shutil.rmtree(p)
    for name in os.listdir(root):  # temp dirs of saves that crashed; they can never be committed
        if name.endswith(".tmp") and STEP_RE.match(name[:-4]):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# -- find ----------------------------------------------------------------------------------------


def latest_checkpoint(root: str) -> str | None:
    """The checkpoint ``root/latest`` points to; if there is no pointer, the committed checkpoint
    with the highest step; None if there is none. ``.tmp`` directories (crashed saves) never count."""
    ptr = os.path.join(root, LATEST)
    if os.path.isfile(ptr):
        with open(ptr, encoding="utf-8") as f:
            name = f.read().strip()
        if STEP_RE.match(name) and os.path.isdir(os.path.join(root, name)):
            return os.path.join(root, name)
    done = committed_steps(root)
    return done[-1][1] if done else None


def _resolve(path: str) -> str:
    """The step directory to load: ``path`` itself, or what a root's ``latest`` names; raises
    ``CheckpointError`` if there is none or it is incomplete (naming the previous good one)."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    base = os.path.basename(os.path.normpath(path))
    is_step = STEP_RE.match(base.removesuffix(".tmp")) is not None
    if not os.path.isdir(path) or not is_step:
        found = latest_checkpoint(path) if os.path.isdir(path) else None
        if found is None:
            raise CheckpointError(f"no checkpoint at {path}: it is neither a step-NNNNNNNN directory nor a root "
                                  f"holding one (or a 'latest' pointer); check the path, or start without "
                                  f"resuming")
        if os.path.isfile(os.path.join(found, METADATA)):
            return found
        path = found
    root = os.path.dirname(os.path.normpath(path))
    good = [p for _, p in committed_steps(root) if os.path.normpath(p) != os.path.normpath(path)]
    hint = f"resume from the previous complete checkpoint {good[-1]}" if good else \
        "no complete checkpoint exists beside it, so start without resuming"
    raise CheckpointError(f"checkpoint {path} is incomplete: it has no {METADATA}, so the save that wrote it "
                          f"was interrupted before committing; {hint} (and delete {path})")


# -- load ----------------------------------------------------------------------------------------


def _global(local: torch.Tensor, shard: Shard) -> tuple[list[int], list[tuple[int, int]]]:
    """Full shape and the box a local slice covers in it."""
    shape = list(local.shape)
    dim, index, parts = shard
    if shape:
        shape[dim] *= parts
    return shape, slice_box(shape, dim, index, parts)


def _read(reader: CheckpointReader, key: str, local: torch.Tensor, shard: Shard,
          keep_dtype: bool = False) -> torch.Tensor:
    """The slice of saved tensor ``key`` that ``local`` (with ``shard``) holds, checked, on the local
    device and (unless ``keep_dtype``: ZeRO keeps fp32 masters and state) in its dtype."""
    shape, box = _global(local, shard)
    saved = reader.global_shape(key)
    what = key.split("/", 1)[1]
    if saved is None:
        raise CheckpointError(f"checkpoint {reader.path} has no tensor {key!r} for parameter {what}; it was saved "
                              f"from a different model (the model config must match the one that saved it)")
    if saved != shape:
        vocab = what.split(".")[0] in ("tok_emb", "head") and saved[1:] == shape[1:]
        hint = (f"the vocabulary differs ({saved[0]} vs {shape[0]} rows): use the data.tokenizer, data.vocab_size "
                f"and model.vocab_size of the run that saved it (its config.toml)") if vocab else \
            "the model config must match the one that saved the checkpoint (its config.toml)"
        raise CheckpointError(f"parameter {what}: the checkpoint {reader.path} holds shape {tuple(saved)} "
                              f"({key}) but this model has {tuple(shape)}; {hint}")
    out = reader.read(key, box)
    return out.to(device=local.device) if keep_dtype else out.to(device=local.device, dtype=local.dtype)


def _state(reader: CheckpointReader, name: str, local: torch.Tensor, shard: Shard,
           keep_dtype: bool = False) -> dict[str, Any]:
    """The optimizer state of one parameter: tensors shaped like it (resliced) plus JSON scalars."""
    prefix = f"optim/{name}/"
    out: dict[str, Any] = {k[len(prefix):]: _read(reader, k, local, shard, keep_dtype) for k in reader.keys(prefix)}
    for k, v in reader.meta["optimizer"]["scalars"].get(name, {}).items():
        out[k] = from_json(v)
    if not out and reader.meta["optimizer"]["has_state"]:
        raise CheckpointError(f"checkpoint {reader.path} has no optimizer state for parameter {name}; it was "
                              f"saved from a different model (the model config must match)")
    return out


def _groups(reader: CheckpointReader, current: list[dict]) -> list[dict]:
    """Saved hyperparameters, with JSON lists turned back into tuples where the optimizer uses them."""
    saved = from_json(reader.meta["optimizer"]["param_groups"])
    if len(saved) == 1 and len(current) > 1:
        saved = saved * len(current)
    return [{k: (tuple(v) if isinstance(cur.get(k), tuple) and isinstance(v, list) else v) for k, v in s.items()}
            for s, cur in zip(saved, current)]


def load_checkpoint(path_or_root: str, model: ParallelModel, optimizer: ParallelOptimizer | None = None,
                    verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint saved under any layout into ``model`` (and ``optimizer``); return ``extra``.

    ``path_or_root`` is a step directory or a root (then ``latest`` is followed). Every rank calls
    it; each reads only the slices its parameters hold. ``verify`` checks each shard file's sha256
    before use (it reads the whole file once). Raises ``CheckpointError`` naming the problem and the
    fix on every rank if any rank fails; then no rank has changed anything (every rank reads all
    it needs first, the ranks agree, and only then is it copied in).
    """
    err: BaseException | None = None
    apply: list[Any] = []
    extra: dict[str, Any] = {}
    try:
        apply, extra = _read_all(_resolve(path_or_root), model, optimizer, verify)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it (see _agree)
        err = exc
    _agree(model, err, "checkpoint load")
    for fn, arg in apply:
        fn(arg)
    return extra


def _read_all(path: str, model: ParallelModel, optimizer: ParallelOptimizer | None,
              verify: bool) -> tuple[list[Any], dict[str, Any]]:
    """Everything this rank needs, as (function, argument) pairs that apply it, and ``extra``."""
    with CheckpointReader(path, verify) as reader:
        if optimizer is not None and reader.meta["optimizer"] is None:
            raise CheckpointError(f"checkpoint {path} has no optimizer state (it was saved without an "
                                  f"optimizer); pass optimizer=None to load only the model weights")
        apply: list[Any] = []
        if model.config.zero_stage:
            opts = optimizer.optimizers if optimizer is not None else [None] * len(model.stages)
            for stage, zopt in zip(model.stages.values(), opts):
                inner = unwrap(stage)
                named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]  # = ZeRO's units
                full = {n: _read(reader, f"model/{n}", p, _shard(p), True) for n, p in named}
                for n, b in inner.named_buffers():
                    full[n] = _read(reader, f"model/{n}", b, (0, 0, 1)) if reader.has(f"model/{n}") else b.detach()
                apply.append((stage.load_full_state_dict, full))
                if zopt is not None:
                    per_name = {n: _state(reader, n, p, _shard(p), True) for n, p in named}
                    apply.append((zopt.load_full_state_dict,
                                  {"state": per_name, "param_groups": _groups(reader, zopt.param_groups)}))
        else:
            named = model.named_parameters()
            values = [(p, _read(reader, f"model/{n}", p, _shard(p))) for n, p in named]
            values += [(b, _read(reader, f"model/{n}", b, (0, 0, 1))) for stage in model.stages.values()
                       for n, b in unwrap(stage).named_buffers() if reader.has(f"model/{n}")]
            apply.append((_copy_params, values))
            if optimizer is not None:
                opt = optimizer.optimizers[0]
                states = [(p, _state(reader, n, p, _shard(p))) for n, p in named]
                apply.append((_set_optimizer, (opt, states, _groups(reader, opt.param_groups))))
        extra = from_json(reader.meta.get("extra") or {})
    return apply, extra


def _copy_params(values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy read values into parameters / buffers (in place, so optimizers keep their references)."""
    with torch.no_grad():
        for p, v in values:
            p.copy_(v)


def _set_optimizer(arg: tuple[torch.optim.Optimizer, list[tuple[torch.Tensor, dict]], list[dict]]) -> None:
    """Install per-parameter state and hyperparameters into a plain torch optimizer."""
    opt, states, groups = arg
    for p, st in states:
        if st:
            opt.state[p] = st
        else:
            opt.state.pop(p, None)
    for g, saved in zip(opt.param_groups, groups):
        g.update(saved)
