"""The on-disk format of meshtrain checkpoints: safetensors shards + one JSON metadata file.

A committed checkpoint is a directory ``step-00000100/`` holding ``rank-RRRRR.safetensors`` (one
per rank that wrote something) and ``metadata.json``, the commit marker, written last. Each tensor
entry of the metadata (format version 2) names its key, the file and the tensor name in it, the full
tensor's shape and the box ``[[lo, hi], ...]`` of it that the stored piece holds; the pieces of a
key tile its full tensor, each element exactly once. Version 1 (before per-rank ZeRO shards)
described a piece as slice ``index`` of ``parts`` equal parts along ``dim``, stored under the key
itself; the reader turns those into boxes, so both load. This module writes the shards (streamed
from the live tensors: no serialised copy in memory), merges the ranks' descriptions, and reads
just the boxes a rank needs. Nothing here unpickles: tensors come only from safetensors files,
everything else from JSON.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import itertools
import re
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable

import torch

from ..errors import CheckpointError
from ..files import atomic_path

FORMAT, VERSION = "meshtrain.checkpoint", 2
READABLE = (1, 2)  # format versions this code loads
METADATA, LATEST = "metadata.json", "latest"
STEP_RE = re.compile(r"^step-(\d{8,})$")
SHARD_RE = re.compile(r"^rank-\d{5,}\.safetensors$")

Box = tuple[tuple[int, int], ...]  # (lo, hi) per dim of the full tensor

# safetensors' dtype names; safetensors' own writer is not used because it serialises every tensor
# to bytes first (a second copy of this rank's state); the layout written here is the documented
# one: u64 header length, JSON header {name: {dtype, shape, data_offsets}}, then the data
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
_TORCH = {v: k for k, v in ST_DTYPES.items()}


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


def _no_space(path: str, size: int, exc: OSError) -> None:
    """Re-raise ``exc``; a full disk (or quota) removes the partial file and says what to do."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        raise exc
    try:
        os.remove(path)
    except OSError:
        pass
    raise CheckpointError(f"no space left on the device writing {path} ({size} bytes: {exc.strerror}); "
                          f"the checkpoint was not saved and the previous one is kept; free disk space or "
                          f"set checkpoint.dir to a disk with room, then resume") from exc


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (not atomic: callers write inside a temp dir). A full
    disk (or quota) removes the partial file and raises ``CheckpointError`` saying so."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        _no_space(path, len(data), exc)


def write_durable_stream(path: str, chunks: Iterable[Any], size: int) -> str:
    """Write the byte chunks to ``path`` one at a time (nothing joined in memory), fsync it and
    return its sha256; a full disk is handled as in ``write_durable`` (``size``: for the message)."""
    h = hashlib.sha256()
    try:
        with open(path, "wb") as f:
            for data in chunks:
                h.update(data)
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        _no_space(path, size, exc)
    return h.hexdigest()


def replace_durable(path: str, data: bytes) -> None:
    """Atomically replace ``path`` by ``data``: written to ``files.atomic_path``'s temporary file by
    ``write_durable`` (fsynced; a full disk said so), renamed, and the directory fsynced."""
    with atomic_path(path) as tmp:
        write_durable(tmp, data)
    fsync_dir(os.path.dirname(path) or ".")


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying them."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def write_rank_shard(tmp_dir: str, rank: int, pieces: list[tuple[str, torch.Tensor, list[int], Box]],
                     scalars: dict[str, dict[str, Any]]) -> None:
    """Write this rank's pieces (key, values, full shape, box) to ``rank-R.safetensors``, streamed
    from the tensors themselves, and a ``rank-R.json`` sidecar describing them; rank 0 merges the
    sidecars into metadata.json. Memory: one piece's contiguous copy at most (pieces are views)."""
    name = shard_file_name(rank)
    entries, header, offset = [], {}, 0
    for i, (key, t, shape, box) in enumerate(pieces):
        if t.dtype not in ST_DTYPES:
            raise CheckpointError(f"tensor {key!r} has dtype {t.dtype}, which a safetensors checkpoint cannot hold")
        tname = f"{key}#{i}"
        nbytes = t.numel() * t.element_size()
        header[tname] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        entries.append({"key": key, "file": name, "name": tname, "shape": list(shape), "box": [list(b) for b in box],
                        "dtype": str(t.dtype).removeprefix("torch.")})
    side: dict[str, Any] = {"rank": rank, "entries": entries, "scalars": scalars, "files": {}}
    if pieces:
        head = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # safetensors aligns the data to 8 bytes
        chunks = itertools.chain([struct.pack("<Q", len(head)) + head],
                                 (_raw(t if t.is_contiguous() and t.device.type == "cpu" else t.cpu().contiguous())
                                  for _, t, _, _ in pieces))
        digest = write_durable_stream(os.path.join(tmp_dir, name), chunks, 8 + len(head) + offset)
        side["files"] = {name: {"size": 8 + len(head) + offset, "sha256": digest}}
    write_durable(os.path.join(tmp_dir, f"rank-{rank:05d}.json"), json.dumps(side).encode())


def entry_box(e: dict[str, Any]) -> Box:
    """The box of the full tensor a metadata entry's piece holds (format 2 ``box``, or format 1's
    ``dim``/``index``/``parts``)."""
    if "box" in e:
        return tuple((int(lo), int(hi)) for lo, hi in e["box"])
    return tuple(slice_box(list(e["shape"]), e["dim"], e["index"], e["parts"]))


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
        boxes = [entry_box(e) for e in es]
        volume = sum(math.prod(hi - lo for lo, hi in b) for b in boxes)
        if len({tuple(e["shape"]) for e in es}) > 1 or volume != math.prod(es[0]["shape"]) or _overlap(boxes):
            raise CheckpointError(f"internal error while saving: tensor {key!r} was written as boxes {boxes} "
                                  f"of shapes {[e['shape'] for e in es]}; expected each element exactly once")
    return entries, files, scalars


def _overlap(boxes: list[Box]) -> bool:
    """Whether two boxes share an element: a sweep along dim 0 compares each box only with those
    whose dim-0 range it meets (a ZeRO save has ~3 x dp boxes per tensor, mostly row-disjoint)."""
    active: list[Box] = []
    for x in sorted(boxes, key=lambda b: b[0] if b else (0, 0)):
        if not x:
            return len(boxes) > 1  # a 0-dim tensor is one element
        active = [y for y in active if y[0][1] > x[0][0]]
        if any(all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(x, y)) for y in active):
            return True
        active.append(x)
    return False


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


def slice_box(shape: list[int], dim: int, index: int, parts: int) -> list[tuple[int, int]]:
    """The region of a tensor of global ``shape`` that slice ``index`` of ``parts`` along ``dim`` covers."""
    box = [(0, n) for n in shape]
    if shape:
        size = shape[dim] // parts
        box[dim] = (index * size, (index + 1) * size)
    return box


# -- reading -------------------------------------------------------------------------------------
# Only the parts of the stored pieces a rank needs, straight from the files into its tensors through
# one bounded buffer: ``plan(key, box)`` checks that the stored pieces cover ``box`` and opens (and
# checks) their files; ``read_into(plan, dst)`` reads each overlap as contiguous runs of the file
# with ``readinto`` into a buffer of at most ``CHUNK`` bytes and copies them (converting the dtype)
# into place. No file is memory-mapped, so resident memory grows by the buffer only.

CHUNK = 16 << 20  # the read buffer's size in bytes (a run of one row may exceed it)


@dataclass
class _Stored:
    """Where one stored piece's data lies: its file, the offset of its first byte, its box, dtype."""

    file: str
    offset: int
    box: Box
    dtype: torch.dtype


@dataclass
class ReadPlan:
    """The stored pieces that overlap a wanted box, with the overlaps (checked to cover it)."""

    key: str
    box: Box
    parts: list[tuple[_Stored, Box]]


class CheckpointReader:
    """A committed checkpoint directory, opened for reading boxes of its tensors. Shard files are
    opened (size and, with ``verify``, sha256 checked against the metadata, header checked against
    the entries) the first time a plan needs them. Use as a context manager to close them."""

    def __init__(self, path: str, verify: bool = True) -> None:
        self.path, self.verify = path, verify
        meta_path = os.path.join(path, METADATA)
        try:
            with open(meta_path, encoding="utf-8") as f:
                self.meta: dict[str, Any] = json.load(f)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {meta_path}: {exc}; the checkpoint is corrupt, resume from "
                                  f"another one") from exc
        fmt, ver = self.meta.get("format"), self.meta.get("version")
        if fmt != FORMAT or ver not in READABLE:
            raise CheckpointError(f"{meta_path} is format {fmt!r} version {ver!r}, but this meshtrain reads "
                                  f"{FORMAT!r} versions {', '.join(map(str, READABLE))}: a newer meshtrain wrote it "
                                  f"(upgrade meshtrain to load it) or it is not a meshtrain checkpoint")
        self.entries: dict[str, list[dict]] = {}
        for e in self.meta["entries"]:
            if not SHARD_RE.match(e["file"]) or e["file"] not in self.meta["files"]:
                raise CheckpointError(f"{meta_path} names shard file {e['file']!r}, which is not a shard of "
                                      f"this checkpoint (rank-NNNNN.safetensors listed under 'files'); the "
                                      f"metadata is corrupt or was tampered with, resume from another checkpoint")
            self.entries.setdefault(e["key"], []).append(e)
        self._files: dict[str, tuple[BinaryIO, dict[str, Any], int]] = {}
        self._buf: torch.Tensor | None = None

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the shard files and drop the buffer."""
        for f, _, _ in self._files.values():
            f.close()
        self._files.clear()
        self._buf = None

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

    # -- files -----------------------------------------------------------------------------------

    def _file(self, name: str) -> tuple[BinaryIO, dict[str, Any], int]:
        """Open shard file ``name`` once, after checking it is present and intact: (file, its
        safetensors header, the offset its data starts at)."""
        if name in self._files:
            return self._files[name]
        path = os.path.join(self.path, name)
        want = self.meta["files"][name]
        from .run_records import earlier_checkpoint_fix  # (lazily: it names the checkpoint before this one)

        def fix() -> str:
            return earlier_checkpoint_fix(self.path)

        if not os.path.isfile(path):
            raise CheckpointError(f"shard file {path} is missing (metadata.json lists it); {fix()}")
        size = os.path.getsize(path)
        if size != want["size"]:
            raise CheckpointError(f"shard file {path} is {size} bytes but was written with {want['size']}: "
                                  f"it is truncated or corrupt; {fix()}")
        f = open(path, "rb", buffering=0)
        try:
            if self.verify:
                h = hashlib.sha256()
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
                if h.hexdigest() != want["sha256"]:
                    raise CheckpointError(f"shard file {path} is corrupt: its sha256 differs from the one recorded "
                                          f"at save time; {fix()}")
            f.seek(0)
            try:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > min(size - 8, 100 << 20):
                    raise ValueError(f"header length {n} exceeds the file")
                header = json.loads(f.read(n))
            except (ValueError, struct.error) as exc:
                raise CheckpointError(f"shard file {path} is corrupt (its safetensors header: {exc}); {fix()}") from exc
        except BaseException:
            f.close()
            raise
        self._files[name] = (f, header, 8 + n)
        return self._files[name]

    def _stored(self, e: dict[str, Any]) -> _Stored:
        """Locate an entry's piece in its file, checking the file's header agrees with the metadata."""
        _, header, start = self._file(e["file"])
        tname = e.get("name", e["key"])  # format 1 stored a key's one piece under the key
        box = entry_box(e)
        h = header.get(tname)
        ok = isinstance(h, dict) and _TORCH.get(h.get("dtype")) is not None and \
            list(h.get("shape", [])) == [hi - lo for lo, hi in box] and len(h.get("data_offsets", [])) == 2
        dtype = _TORCH[h["dtype"]] if ok else torch.float32
        if ok:
            a, b = h["data_offsets"]
            ok = b - a == math.prod(hi - lo for lo, hi in box) * dtype.itemsize and \
                start + b <= self.meta["files"][e["file"]]["size"]
        if not ok:
            raise CheckpointError(f"shard file {os.path.join(self.path, e['file'])} does not hold {tname!r} as "
                                  f"metadata.json describes it (a box of extent {[hi - lo for lo, hi in box]}); the "
                                  f"file does not belong to this metadata, resume from another checkpoint")
        return _Stored(e["file"], start + h["data_offsets"][0], box, dtype)

    # -- reading ---------------------------------------------------------------------------------

    def plan(self, key: str, box: Box) -> ReadPlan:
        """The stored pieces of ``key`` overlapping ``box`` (a box of the full tensor); raises
        ``CheckpointError`` unless they cover it. The caller has checked the key and full shape."""
        parts, covered = [], 0
        for e in self.entries[key]:
            ebox = entry_box(e)
            inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, ebox))
            if any(lo >= hi for lo, hi in inter):
                continue
            parts.append((self._stored(e), inter))
            covered += math.prod(hi - lo for lo, hi in inter)
        need = math.prod(hi - lo for lo, hi in box)
        if covered != need or (need and not parts):
            raise CheckpointError(f"checkpoint {self.path}: the saved pieces of {key!r} cover {covered} of the "
                                  f"{need} values this rank needs; the metadata is inconsistent, resume from "
                                  f"another checkpoint")
        return ReadPlan(key, box, parts)

    def read(self, key: str, box: list[tuple[int, int]]) -> torch.Tensor:
        """A new tensor holding box ``box`` of ``key``, in the saved dtype (export reads whole tensors
        this way). The caller has checked that ``key`` exists and the shapes agree."""
        plan = self.plan(key, tuple(box))
        dtype = plan.parts[0][0].dtype if plan.parts else getattr(torch, self.entries[key][0]["dtype"])
        out = torch.empty([hi - lo for lo, hi in box], dtype=dtype)
        self.read_into(plan, out)
        return out

    def read_into(self, plan: ReadPlan, dst: torch.Tensor) -> None:
        """Copy the planned box into ``dst`` (a tensor of the box's extent; any dtype, any strides)."""
        for stored, inter in plan.parts:
            f, _, _ = self._files[stored.file]
            item = stored.dtype.itemsize
            ext = [hi - lo for lo, hi in stored.box]
            if not ext:  # a 0-dim tensor
                buf = self._buffer(item)
                f.seek(stored.offset)
                _read_exact(f, buf, stored.file)
                with torch.no_grad():
                    dst.copy_(buf.view(stored.dtype).view(()))
                continue
            lo = [a - e for (a, _), (e, _) in zip(inter, stored.box)]  # the overlap in the piece's coords
            n = [hi - a for a, hi in inter]
            shift = [e - p for (e, _), (p, _) in zip(stored.box, plan.box)]  # piece coords -> dst coords
            # the overlap is contiguous in the file along dim k and the whole dims after it
            k = len(ext) - 1
            while k > 0 and n[k] == ext[k]:
                k -= 1
            inner = math.prod(ext[k + 1:])
            strides = [math.prod(ext[d + 1:]) for d in range(len(ext))]
            tail = tuple(slice(shift[d], shift[d] + ext[d]) for d in range(k + 1, len(ext)))
            step = max(1, CHUNK // (inner * item))  # rows of dim k per read: the buffer stays bounded
            for idx in itertools.product(*(range(lo[d], lo[d] + n[d]) for d in range(k))):
                base = sum(i * s for i, s in zip(idx, strides))
                out = dst[tuple(i + shift[d] for d, i in enumerate(idx))]
                for r in range(lo[k], lo[k] + n[k], step):
                    rows = min(step, lo[k] + n[k] - r)
                    buf = self._buffer(rows * inner * item)
                    f.seek(stored.offset + (base + r * strides[k]) * item)
                    _read_exact(f, buf, stored.file)
                    with torch.no_grad():
                        out[(slice(r + shift[k], r + shift[k] + rows),) + tail].copy_(
                            buf.view(stored.dtype).view([rows] + ext[k + 1:]))

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A byte buffer of ``nbytes``, reusing (growing once) one allocation."""
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(max(nbytes, min(CHUNK, 1 << 20)), dtype=torch.uint8)
        return self._buf[:nbytes]


def _read_exact(f: BinaryIO, buf: torch.Tensor, name: str) -> None:
    """Fill ``buf`` from the file's position; a short read means the file changed under us."""
    view = memoryview(buf.numpy()).cast("B")
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"shard file {name} ended early while reading; it changed after it was "
                                  f"checked, resume from another checkpoint")
        got += n
