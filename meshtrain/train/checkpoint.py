"""Sharded, atomic, resharding checkpoints of a ``ParallelModel`` and its ``ParallelOptimizer``.

``save_checkpoint(root, step, model, optimizer, extra)`` is collective and moves no tensor between
ranks: every rank writes the pieces it holds and is the first replica of (``checkpoint_state``: a
tp slice is written by dp = cp = 0, a ZeRO shard by its own rank, a whole tensor once) into
``root/step-00000100.tmp/rank-R.safetensors``, streamed from the live tensors; after a barrier rank
0 writes ``metadata.json`` (the commit marker), renames the directory, points ``root/latest`` at it
and prunes old checkpoints.

``load_checkpoint(path, model, optimizer)`` works under any layout: each rank asks the same state
objects which boxes of which full tensors it holds, checks that the checkpoint covers them, and
(once every rank agrees) reads just those boxes from the files into its tensors. The file format
lives in ``checkpoint_io.py``; nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from .. import comm
from ..errors import CheckpointError, ConfigError
from ..parallel.parallel_model import ParallelModel, ParallelOptimizer
from .checkpoint_io import (FORMAT, LATEST, METADATA, STEP_RE, VERSION, Box, CheckpointReader, ReadPlan,
                            committed_steps, from_json, fsync_dir, merge_sidecars, replace_durable, step_dir_name,
                            to_json, write_durable, write_rank_shard)
from .checkpoint_state import ModelState, OptimizerState, ShardedTensor

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "agree_or_raise", "collect_pieces", "checkpoint_meta",
           "commit_shards"]


def agree_or_raise(model: ParallelModel, exc: BaseException | None, what: str) -> None:
    """Collective: if any rank failed, every rank raises — the failing ranks their own error, the
    others the first failing rank's message — so no rank goes on (or hangs) alone."""
    world = model.mesh.comm.world
    msg = b""
    if exc is not None:
        msg = (str(exc) if isinstance(exc, (CheckpointError, ConfigError)) else f"{type(exc).__name__}: {exc}"
               ).encode() or b"?"
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
    if isinstance(exc, (CheckpointError, ConfigError)):
        raise exc
    text = f"{what} failed on rank {world.ranks[src]}: {bytes(buf.tolist()).decode(errors='replace')}"
    raise CheckpointError(text) from exc


# -- save ----------------------------------------------------------------------------------------


Piece = tuple[str, torch.Tensor, list[int], Box]  # (key, values, full shape, box of the full tensor)


def _collect(model: ParallelModel, optimizer: ParallelOptimizer | None
             ) -> tuple[list[Piece], dict[str, dict], list[dict] | None]:
    """This rank's pieces to write (views of its own tensors: no copy, no communication), scalar
    optimizer state per parameter, and the optimizer's param groups."""
    ms = ModelState(model)
    pieces: list[Piece] = []

    def add(state: dict[str, ShardedTensor]) -> None:
        for key, st in state.items():
            if st.write:
                pieces.extend((key, t, st.shape, box) for box, t in st.pieces)

    add(ms.state_dict())
    scalars: dict[str, dict] = {}
    groups = None
    if optimizer is not None:
        tensors, scalars, groups = OptimizerState(model, optimizer, ms.params).state_dict()
        add(tensors)
    return pieces, scalars, groups


def collect_pieces(model: ParallelModel, optimizer: ParallelOptimizer | None, snapshot: bool
                   ) -> tuple[list[Piece], dict[str, dict], list[dict] | None]:
    """``_collect``: this rank's pieces, scalars and param groups; with ``snapshot`` the pieces are
    copies (the price of writing in the background while training changes the parameters)."""
    tensors, scalars, groups = _collect(model, optimizer)
    if snapshot:
        tensors = [(k, v.detach().clone(), shape, box) for k, v, shape, box in tensors]
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
        """Write this rank's shard file and sidecar; an error is kept for ``finish`` to share."""
        try:
            write_rank_shard(self.tmp, self.model.mesh.comm.rank, self.tensors, self.scalars)
        except BaseException as exc:  # noqa: BLE001 - every rank must learn of it (see agree_or_raise)
            self.error = exc
        self.tensors = None  # the snapshot's memory goes as soon as it is on disk

    def finish(self) -> str:
        """Agree that every shard is durable, commit on rank 0, agree again; returns the step dir."""
        model, rank, err = self.model, self.model.mesh.comm.rank, self.error
        try:
            agree_or_raise(model, err, "checkpoint save")  # doubles as the barrier before the commit
            try:
                if rank == 0:
                    _commit(self.root, self.tmp, self.final, self.step, model, self.has_optimizer, self.groups,
                            self.extra_json, self.keep)
            except BaseException as exc:  # noqa: BLE001
                err = exc
            agree_or_raise(model, err, "checkpoint commit")  # and as the barrier after it
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
        tensors, scalars, groups = collect_pieces(model, optimizer, snapshot)
        if rank == 0:
            if os.path.exists(tmp):  # left by a save that crashed at this step
                shutil.rmtree(tmp)
            os.makedirs(tmp)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it (see agree_or_raise)
        err = exc
    try:
        agree_or_raise(model, err, "checkpoint save")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PendingSave(root, step, model, optimizer is not None, tensors, scalars, groups, extra_json, keep)


def _commit(root: str, tmp: str, final: str, step: int, model: ParallelModel, has_optimizer: bool,
            groups: list[dict] | None, extra: Any, keep: int) -> None:
    """Rank 0, after every shard is durable: metadata.json (last), rename, ``latest``, prune."""
    commit_shards(root, tmp, final, checkpoint_meta(step, model, has_optimizer, groups, extra), keep)


def checkpoint_meta(step: int, model: ParallelModel, has_optimizer: bool, groups: list[dict] | None,
                    extra: Any) -> dict[str, Any]:
    """metadata.json but for what the shards add (``commit_shards`` fills in files, entries and the
    optimizer's scalars): everything rank 0 knows before a shard is written."""
    pc = model.config
    return {
        "format": FORMAT, "version": VERSION, "step": step,
        "layout": dict(model.mesh.shape), "axes": dict(model.mesh.axes), "world_size": model.mesh.world_size,
        "parallel": {"zero_stage": pc.zero_stage, "schedule": pc.schedule, "microbatches": pc.microbatches,
                     "virtual_stages": pc.virtual_stages, "sequence_parallel": pc.sequence_parallel},
        "files": {}, "entries": [],
        "optimizer": {"param_groups": to_json(groups or []), "scalars": {}, "has_state": False}
        if has_optimizer else None,
        "extra": extra,
    }


def commit_shards(root: str, tmp: str, final: str, meta: dict[str, Any], keep: int) -> None:
    """Rank 0, once every rank's shard and sidecar in ``tmp`` is durable: merge the sidecars into
    ``meta`` (``checkpoint_meta``'s) and commit it (``commit_step_dir``)."""
    entries, files, scalars = merge_sidecars(tmp)
    meta = {**meta, "files": files, "entries": entries}
    if meta["optimizer"] is not None:
        meta["optimizer"] = {**meta["optimizer"], "scalars": scalars,
                             "has_state": any(e["key"].startswith("optim/") for e in entries) or bool(scalars)}
    commit_step_dir(root, tmp, final, meta, keep)


def commit_step_dir(root: str, tmp: str, final: str, meta: dict[str, Any], keep: int) -> None:
    """Commit the written shards in ``tmp`` as ``final``: metadata.json (the commit marker, last),
    rename, point ``latest`` at it, keep the newest ``keep`` checkpoints, drop crashed saves' temp dirs."""
    from .run_dir import copy_tokenizer

    copy_tokenizer(meta.get("extra"), tmp)  # the checkpoint carries its run's tokenizer (self-contained)
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


_EXPERT_TENSORS = ("experts.w1", "experts.w2", "experts.w3", "router.gate.weight", "router.expert_bias")
"""A mixture-of-experts layer's tensors whose first dim is the number of experts."""


def _check(reader: CheckpointReader, key: str, shape: list[int]) -> None:
    """The checkpoint must hold ``key`` with the full ``shape`` this model has."""
    saved = reader.global_shape(key)
    what = key.split("/", 1)[1]
    if saved is None:
        raise CheckpointError(f"checkpoint {reader.path} has no tensor {key!r} for parameter {what}; it was saved "
                              f"from a different model (the model config must match the one that saved it)")
    if saved != list(shape) and what.endswith(_EXPERT_TENSORS) and saved[1:] == list(shape)[1:]:
        raise ConfigError(f"the checkpoint {reader.path} holds {saved[0]} experts per layer ({what}) but this model "
                          f"has model.n_experts = {shape[0]}; set model.n_experts = {saved[0]} as in the run that "
                          f"saved it (its config.toml), or start without resuming")
    if saved != list(shape):
        vocab = what.split(".")[0] in ("tok_emb", "head") and saved[1:] == list(shape)[1:]
        hint = (f"the vocabulary differs ({saved[0]} vs {shape[0]} rows): use the data.tokenizer, data.vocab_size "
                f"and model.vocab_size of the run that saved it (its config.toml)") if vocab else \
            "the model config must match the one that saved the checkpoint (its config.toml)"
        raise CheckpointError(f"parameter {what}: the checkpoint {reader.path} holds shape {tuple(saved)} "
                              f"({key}) but this model has {tuple(shape)}; {hint}")


def _plan(reader: CheckpointReader, key: str, st: ShardedTensor) -> list[ReadPlan]:
    """Checked plans to read each of ``st``'s pieces of tensor ``key`` from the checkpoint."""
    _check(reader, key, st.shape)
    return [reader.plan(key, box) for box, _ in st.pieces]


def _groups(reader: CheckpointReader, current: list[dict]) -> list[dict]:
    """Saved hyperparameters, with JSON lists turned back into tuples where the optimizer uses them."""
    saved = from_json(reader.meta["optimizer"]["param_groups"])
    if len(saved) == 1 and len(current) > 1:
        saved = saved * len(current)
    return [{k: (tuple(v) if isinstance(cur.get(k), tuple) and isinstance(v, list) else v) for k, v in s.items()}
            for s, cur in zip(saved, current)]


class _Load:
    """A load in torch.distributed.checkpoint's manner: the state objects' ``state_dict()`` views
    say what to read where. Phase 1 (construction) plans and checks every read and changes nothing;
    ``run`` (once every rank's phase 1 passed) reads into the views; ``finish`` calls
    ``load_state_dict``."""

    def __init__(self, path: str, model: ParallelModel, optimizer: ParallelOptimizer | None, verify: bool) -> None:
        self.reader = reader = CheckpointReader(path, verify)
        try:
            if optimizer is not None and reader.meta["optimizer"] is None:
                raise CheckpointError(f"checkpoint {path} has no optimizer state (it was saved without an "
                                      f"optimizer); pass optimizer=None to load only the model weights")
            self.model = ModelState(model)
            buffers = {f"model/{s.name}" for s, _ in self.model.buffers}
            # a buffer the checkpoint lacks keeps its value (buffers are derived, e.g. rotary tables)
            self.state = {k: st for k, st in self.model.state_dict().items() if k not in buffers or reader.has(k)}
            self.plans = {k: _plan(reader, k, st) for k, st in self.state.items()}
            self.optim: OptimizerState | None = None
            if optimizer is not None:
                self._plan_optimizer(OptimizerState(model, optimizer, self.model.params))
            self.extra = from_json(reader.meta.get("extra") or {})
        except BaseException:
            reader.close()
            raise

    def _plan_optimizer(self, optim: OptimizerState) -> None:
        """The optimizer's state tensors are cut like their parameters: plan them on its pieces."""
        reader, meta = self.reader, self.reader.meta["optimizer"]
        self.optim = optim
        self.keys: dict[str, list[str]] = {}  # parameter name -> state keys the checkpoint holds
        self.scalars = {n: from_json(v) for n, v in meta["scalars"].items()}
        for s in optim.slots:
            prefix = f"optim/{s.name}/"
            self.keys[s.name] = [k[len(prefix):] for k in reader.keys(prefix)]
            if not self.keys[s.name] and s.name not in self.scalars and meta["has_state"]:
                raise CheckpointError(f"checkpoint {reader.path} has no optimizer state for parameter {s.name}; "
                                      f"it was saved from a different model (the model config must match)")
            for k in self.keys[s.name]:
                self.plans[prefix + k] = _plan(reader, prefix + k, self.state[f"model/{s.name}"])
        self.groups = [_groups(reader, opt.param_groups) for opt in optim.torch_optimizers]

    def run(self) -> None:
        """Read every planned box into its view, through one bounded buffer."""
        with self.reader:
            for key, st in self.state.items():
                for (_, view), plan in zip(st.pieces, self.plans[key]):
                    self.reader.read_into(plan, view)
            if self.optim is not None:
                self.optim.allocate(self.keys)  # zeros where the optimizer has not stepped yet
                tensors, _, _ = self.optim.state_dict()
                for key, st in tensors.items():
                    for (_, view), plan in zip(st.pieces, self.plans.get(key, [])):
                        self.reader.read_into(plan, view)

    def finish(self) -> None:
        """Collective: refresh ZeRO's compute parameters; install optimizer scalars and groups."""
        self.model.load_state_dict(self.state)
        if self.optim is not None:
            self.optim.load_state_dict(self.scalars, self.groups, self.keys)


def load_checkpoint(path_or_root: str, model: ParallelModel, optimizer: ParallelOptimizer | None = None,
                    verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint saved under any layout into ``model`` (and ``optimizer``); return ``extra``.

    ``path_or_root`` is a step directory or a root (then ``latest`` is followed). Every rank calls
    it; each reads only the boxes its parameters (and their optimizer state) hold, straight into
    them. ``verify`` checks each shard file's sha256 before use (it reads the whole file once).
    Raises ``CheckpointError`` naming the problem and the fix on every rank if any rank fails; a
    checkpoint that does not fit (missing tensors, other shapes, damaged files) is found before any
    rank changes anything.
    """
    err: BaseException | None = None
    load: _Load | None = None
    try:
        load = _Load(_resolve(path_or_root), model, optimizer, verify)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it (see agree_or_raise)
        err = exc
    try:
        agree_or_raise(model, err, "checkpoint load")
    except CheckpointError:
        if load is not None:
            load.reader.close()
        raise
    assert load is not None
    try:
        load.run()
    except BaseException as exc:  # noqa: BLE001
        err = exc
    agree_or_raise(model, err, "checkpoint load")
    load.finish()
    return load.extra
