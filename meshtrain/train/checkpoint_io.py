"""The on-disk format of meshtrain checkpoints: safetensors shards + one JSON metadata file.

A committed checkpoint is a directory ``step-00000100/`` holding ``rank-RRRRR.safetensors`` (one
per rank that wrote something) and ``metadata.json``, the commit marker, written last. Each tensor
entry of the metadata names its key, file, global shape and slice ``(dim, index, parts)``: the
file holds slice ``index`` of ``parts`` equal parts along ``dim`` of the full tensor. This module
writes and reads that format; ``checkpoint.py`` decides what goes in it. Nothing here unpickles:
tensors come only from safetensors files, everything else from JSON.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
from contextlib import ExitStack
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from ..errors import CheckpointError

FORMAT, VERSION = "meshtrain.checkpoint", 1
METADATA, LATEST = "metadata.json", "latest"
STEP_RE = re.compile(r"^step-(\d{8,})$")
SHARD_RE = re.compile(r"^rank-\d{5,}\.safetensors$")

Shard = tuple[int, int, int]  # (dim, index, parts)


def step_dir_name(step: int) -> str:
    """``step-00000100``: zero-padded so names sort like steps."""
    return f"step-{step:08d}"


def shard_file_name(rank: int) -> str:
    """``rank-00003.safetensors``."""
    return f"rank-{rank:05d}.safetensors"


# -- JSON values that may hold tensors (RNG states, optimizer step counts) ------------------------


def to_json(obj: Any) -> Any:
    """``obj`` with tensors replaced by ``{"__tensor__": values, "dtype", "shape"}`` and tuples by
    lists; raises ``CheckpointError`` naming the first value JSON cannot hold."""
    if torch.is_tensor(obj):
        t = obj.detach().cpu()
        return {"__tensor__": t.reshape(-1).tolist(), "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape)}
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise CheckpointError(f"checkpoint extra: dict key {bad[0]!r} is not a string; JSON keys "
                                  f"must be strings, convert it with str()")
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"checkpoint extra: value of type {type(obj).__name__} ({obj!r:.60}) is not "
                          f"JSON-serialisable; store numbers, strings, lists, dicts or tensors")


def from_json(obj: Any) -> Any:
    """Inverse of ``to_json``: tensor records become tensors again."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            dtype = getattr(torch, obj["dtype"])
            return torch.tensor(obj["__tensor__"], dtype=dtype).reshape(obj["shape"])
        return {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    return obj


# -- durable writes ------------------------------------------------------------------------------


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (not atomic: callers write inside a temp dir). A full
    disk (or quota) removes the partial file and raises ``CheckpointError`` saying so."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        try:
            os.remove(path)
        except OSError:
            pass
        raise CheckpointError(f"no space left on the device writing {path} ({len(data)} bytes: {exc.strerror}); "
                              f"the checkpoint was not saved and the previous one is kept; free disk space or "
                              f"set checkpoint.dir to a disk with room, then resume") from exc


def replace_durable(path: str, data: bytes) -> None:
    """Atomically replace ``path`` by ``data`` (temp file in the same dir, fsync, os.replace)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    write_durable(tmp, data)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def write_rank_shard(tmp_dir: str, rank: int, tensors: dict[str, tuple[torch.Tensor, Shard]],
                     scalars: dict[str, dict[str, Any]]) -> None:
    """Write this rank's tensors (key -> (local slice, shard)) to ``rank-R.safetensors`` and a
    ``rank-R.json`` sidecar describing them; rank 0 merges the sidecars into metadata.json."""
    name = shard_file_name(rank)
    # clone: safetensors refuses tensors that share storage (ZeRO parameters are views of one buffer)
    data = st_save({k: t.detach().cpu().contiguous().clone() for k, (t, _) in tensors.items()})
    entries = []
    for key, (t, (dim, index, parts)) in tensors.items():
        shape = list(t.shape)
        if shape:
            shape[dim] *= parts
        entries.append({"key": key, "file": name, "shape": shape, "dim": dim, "index": index,
                        "parts": parts, "dtype": str(t.dtype).removeprefix("torch.")})
    if tensors:
        write_durable(os.path.join(tmp_dir, name), data)
    side = {"rank": rank, "entries": entries, "scalars": scalars,
            "files": {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}} if tensors else {}}
    write_durable(os.path.join(tmp_dir, f"rank-{rank:05d}.json"), json.dumps(side).encode())


def merge_sidecars(tmp_dir: str) -> tuple[list[dict], dict[str, dict], dict[str, dict]]:
    """Read and delete every rank's sidecar; return (entries, files, scalars). Checks that every
    tensor is written exactly once: its slices are 0..parts-1, each once, with one global shape."""
    entries: list[dict] = []
    files: dict[str, dict] = {}
    scalars: dict[str, dict] = {}
    for name in sorted(os.listdir(tmp_dir)):
        if re.fullmatch(r"rank-\d{5,}\.json", name):
            path = os.path.join(tmp_dir, name)
            with open(path, encoding="utf-8") as f:
                side = json.load(f)
            entries += side["entries"]
            files.update(side["files"])
            for pname, st in side["scalars"].items():
                scalars.setdefault(pname, {}).update(st)
            os.remove(path)
    by_key: dict[str, list[dict]] = {}
    for e in entries:
        by_key.setdefault(e["key"], []).append(e)
    for key, es in by_key.items():
        idx = sorted(e["index"] for e in es)
        if idx != list(range(es[0]["parts"])) or len({(tuple(e["shape"]), e["dim"], e["parts"]) for e in es}) > 1:
            raise CheckpointError(f"internal error while saving: tensor {key!r} was written as slices {idx} "
                                  f"of {[e['parts'] for e in es]}; expected each slice exactly once")
    return entries, files, scalars


def committed_steps(root: str) -> list[tuple[int, str]]:
    """(step, path) of every committed checkpoint (step dir with metadata.json) under ``root``, by step."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = STEP_RE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, METADATA)):
            out.append((int(m.group(1)), path))
    return sorted(out)


# -- reading -------------------------------------------------------------------------------------


def slice_box(shape: list[int], dim: int, index: int, parts: int) -> list[tuple[int, int]]:
    """The region of a tensor of global ``shape`` that slice ``index`` of ``parts`` along ``dim`` covers."""
    box = [(0, n) for n in shape]
    if shape:
        size = shape[dim] // parts
        box[dim] = (index * size, (index + 1) * size)
    return box


class CheckpointReader:
    """A committed checkpoint directory, opened for reading slices of its tensors lazily.

    Shard files are opened (and their size and sha256 checked against the metadata) the first time
    a tensor in them is read. Use as a context manager to close them."""

    def __init__(self, path: str, verify: bool = True) -> None:
        self.path, self.verify = path, verify
        meta_path = os.path.join(path, METADATA)
        try:
            with open(meta_path, encoding="utf-8") as f:
                self.meta: dict[str, Any] = json.load(f)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {meta_path}: {exc}; the checkpoint is corrupt, resume from "
                                  f"another one") from exc
        if self.meta.get("format") != FORMAT or self.meta.get("version") != VERSION:
            raise CheckpointError(f"{meta_path} is not a meshtrain checkpoint of format version {VERSION} "
                                  f"(format={self.meta.get('format')!r}, version={self.meta.get('version')!r})")
        self.entries: dict[str, list[dict]] = {}
        for e in self.meta["entries"]:
            if not SHARD_RE.match(e["file"]) or e["file"] not in self.meta["files"]:
                raise CheckpointError(f"{meta_path} names shard file {e['file']!r}, which is not a shard of "
                                      f"this checkpoint (rank-NNNNN.safetensors listed under 'files'); the "
                                      f"metadata is corrupt or was tampered with, resume from another checkpoint")
            self.entries.setdefault(e["key"], []).append(e)
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the shard files."""
        self._stack.close()
        self._open.clear()

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds tensor ``key``."""
        return key in self.entries

    def keys(self, prefix: str) -> list[str]:
        """Tensor keys that start with ``prefix``."""
        return sorted(k for k in self.entries if k.startswith(prefix))

    def global_shape(self, key: str) -> list[int] | None:
        """The saved full shape of ``key`` (None if absent)."""
        es = self.entries.get(key)
        return list(es[0]["shape"]) if es else None

    def _file(self, name: str) -> Any:
        """Open shard file ``name`` once, after checking it is present and intact."""
        if name in self._open:
            return self._open[name]
        path = os.path.join(self.path, name)
        want = self.meta["files"][name]
        fix = "restore the file, or resume from an earlier checkpoint"
        if not os.path.isfile(path):
            raise CheckpointError(f"shard file {path} is missing (metadata.json lists it); {fix}")
        size = os.path.getsize(path)
        if size != want["size"]:
            raise CheckpointError(f"shard file {path} is {size} bytes but was written with {want['size']}: "
                                  f"it is truncated or corrupt; {fix}")
        if self.verify:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            if h.hexdigest() != want["sha256"]:
                raise CheckpointError(f"shard file {path} is corrupt: its sha256 differs from the one recorded "
                                      f"at save time; {fix}")
        try:
            handle = self._stack.enter_context(safe_open(path, framework="pt"))
        except Exception as exc:  # safetensors raises its own error type for a bad header
            raise CheckpointError(f"shard file {path} is corrupt ({exc}); {fix}") from exc
        self._open[name] = handle
        return handle

    def read(self, key: str, box: list[tuple[int, int]]) -> torch.Tensor:
        """The region ``box`` ([(lo, hi)] per dim) of full tensor ``key``, assembled from the saved
        slices that overlap it. The caller has checked that ``key`` exists and the shapes agree."""
        es = self.entries[key]
        out: torch.Tensor | None = None
        covered = 0
        for e in es:
            ebox = slice_box(e["shape"], e["dim"], e["index"], e["parts"])
            inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, ebox)]
            if any(lo >= hi for lo, hi in inter) and inter:
                continue
            src = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, ebox))
            piece = self._file(e["file"]).get_slice(key)[src] if inter else self._file(e["file"]).get_tensor(key)
            if out is None:
                out = torch.empty([hi - lo for lo, hi in box], dtype=piece.dtype)
            dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, box))
            out[dst] = piece
            covered += math.prod(hi - lo for lo, hi in inter)
        need = math.prod(hi - lo for lo, hi in box)
        if out is None or covered != need:
            raise CheckpointError(f"checkpoint {self.path}: the saved slices of {key!r} cover {covered} of the "
                                  f"{need} values this rank needs; the metadata is inconsistent, resume from "
                                  f"another checkpoint")
        return out
