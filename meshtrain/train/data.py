"""Training text as a deterministic sequence of documents: the built-in corpus or the user's files.

The built-in corpus exists on every machine without a download: the ``.py`` sources of the running
Python's standard library (``sysconfig.get_paths()["stdlib"]``, without tests and site-packages),
read at run time in sorted path order; nothing is copied into the repository. User data is a
``.txt`` file (one document), a ``.jsonl`` file (one document per line, in a "text" field, or the
one ``data.text_field`` names), a ``.parquet`` file (that column; needs pyarrow), a directory of such files (sorted by path), or
a directory written by Hugging Face ``Dataset.save_to_disk`` (needs ``datasets``).

A ``Corpus`` is cheap to open (it lists and stats files); its ``fingerprint`` hashes what it is
made of (paths, sizes, modification times, byte budget), so caches built from it are found again
without reading the text. Problems are ``DataError``s naming the path and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import DataError

SUFFIXES = (".txt", ".jsonl", ".parquet")
DEFAULT_MAX_BYTES = 20_000_000
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_FORMAT = 1  # bump when the way documents are read changes, to invalidate caches built from them
_USAGE = ("point data.path at a .txt, .jsonl or .parquet file, a directory of them or a saved Hugging Face "
          "dataset directory (or leave it empty for the built-in corpus)")


@dataclass(frozen=True)
class Corpus:
    """A deterministic sequence of documents (strings) read lazily from ``files``."""

    name: str
    """What it is, for logs: "python-stdlib-3.11.7" or the resolved path."""
    kind: str
    """"builtin", "files" or "hf-dataset"."""
    root: Path
    """The directory or file the corpus was opened from."""
    files: tuple[Path, ...]
    """The files read, in order (for a Hugging Face dataset: the files of its directory)."""
    max_bytes: int
    """Stop after this many bytes of UTF-8 text (0: no limit); the last document is cut to fit."""
    fingerprint: str
    """Hex SHA-256 of the corpus identity: kind, paths, sizes, modification times, max_bytes."""
    text_field: str = "text"
    """JSON field / column holding the text (.jsonl, .parquet, Hugging Face datasets)."""

    @property
    def size_bytes(self) -> int:
        """Bytes of the files on disk (an estimate of the text size, before ``max_bytes``)."""
        total = sum(f.stat().st_size for f in self.files)
        return min(total, self.max_bytes) if self.max_bytes else total

    def documents(self) -> Iterator[str]:
        """The non-empty documents in order, up to ``max_bytes``; ``DataError`` if there are none."""
        budget, count = self.max_bytes or None, 0
        for text in self._raw_documents():
            if not text:
                continue
            if budget is not None:
                data = text.encode("utf-8")
                if len(data) >= budget:
                    text = data[:budget].decode("utf-8", "ignore")  # cut inside a character: drop it
                budget -= len(data)
            count += 1
            yield text
            if budget is not None and budget <= 0:
                break
        if count == 0:
            raise DataError(f"no text in {self.name!r}: every document is empty; {_USAGE}")

    def sample(self, sample_bytes: int) -> Iterator[str]:
        """About ``sample_bytes`` of documents spread evenly over the corpus (every k-th document),
        deterministically: what the tokenizer is trained on."""
        stride = max(1, -(-self.size_bytes // max(1, sample_bytes)))
        taken = 0
        for i, text in enumerate(self.documents()):
            if i % stride == 0:
                yield text
                taken += len(text)
                if taken >= sample_bytes:
                    return

    def _raw_documents(self) -> Iterator[str]:
        if self.kind == "builtin":
            for f in self.files:  # a few Python builds carry non-UTF-8 bytes: replace, never fail
                yield f.read_text(encoding="utf-8", errors="replace")
        elif self.kind == "hf-dataset":
            yield from read_hf_dataset(self.root, self.text_field)
        else:
            for f in self.files:
                yield from read_file(f, self.text_field)


# ------------------------------------------------------------------------------------------ readers

def read_file(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one .txt / .jsonl / .parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        yield read_txt(path)
    elif suffix == ".jsonl":
        yield from read_jsonl(path, text_field)
    elif suffix == ".parquet":
        yield from read_parquet(path, text_field)
    else:
        raise DataError(f"unsupported data file {str(path)!r} ({suffix or 'no suffix'}); {_USAGE}")


def read_txt(path: Path) -> str:
    """A whole .txt file as one document (strict UTF-8)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{str(path)!r} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 4]!r}); "
                        f"convert it, e.g. iconv -f latin1 -t utf-8") from None


def read_jsonl(path: Path, text_field: str = "text") -> Iterator[str]:
    """One document per non-blank line: the line's JSON object's ``text_field``."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); each line must be a "
                                f"JSON object like {{\"{text_field}\": \"...\"}}") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{n}: no \"{text_field}\" field (found: {keys}); each line must be a "
                                f"JSON object like {{\"{text_field}\": \"...\"}}, or set data.text_field to the "
                                f"field that holds the text")
            text = record[text_field]
            if not isinstance(text, str):
                raise DataError(f"{path}:{n}: \"{text_field}\" is {type(text).__name__}, not a string")
            yield text


def read_parquet(path: Path, text_field: str = "text") -> Iterator[str]:
    """One document per row of the ``text_field`` column, read in record batches (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {str(path)!r} needs pyarrow, which is not installed: pip install pyarrow "
                        f"(or convert the file to .jsonl)") from None
    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise DataError(f"{str(path)!r} has no \"{text_field}\" column (columns: {', '.join(pf.schema_arrow.names)}); "
                        f"set data.text_field to the column that holds the text")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def is_hf_dataset(path: Path) -> bool:
    """True if ``path`` is a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def read_hf_dataset(path: Path, text_field: str = "text") -> Iterator[str]:
    """The ``text_field`` column of a saved Hugging Face dataset (a DatasetDict's "train" split, or
    its only split)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{str(path)!r} is a saved Hugging Face dataset; reading it needs the datasets "
                        f"library: pip install datasets (or export it to .jsonl)") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        splits = sorted(ds)
        if "train" not in ds and len(splits) != 1:
            raise DataError(f"{str(path)!r} holds splits {splits} and none is \"train\"; save the split to "
                            f"train on by itself (ds[split].save_to_disk(dir))")
        ds = ds["train" if "train" in ds else splits[0]]
    if text_field not in ds.column_names:
        raise DataError(f"{str(path)!r} has no \"{text_field}\" column (columns: {', '.join(ds.column_names)}); "
                        f"set data.text_field to the column that holds the text")
    for batch in ds.select_columns([text_field]).iter(batch_size=1024):
        for text in batch[text_field]:
            if text is not None:
                yield text


# ------------------------------------------------------------------------------------------ opening

def _fingerprint(kind: str, root: Path, files: list[Path], max_bytes: int, extra: str = "") -> str:
    h = hashlib.sha256(f"{_FORMAT}|{kind}|{root}|{max_bytes}|{extra}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f.relative_to(root) if f != root else f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _walk(root: Path, keep) -> list[Path]:  # type: ignore[no-untyped-def]
    """Files under ``root`` for which ``keep(path)`` holds, in sorted relative-path order; hidden
    files and directories are skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and keep(Path(dirpath, d), True)]
        found += [Path(dirpath, f) for f in filenames if not f.startswith(".") and keep(Path(dirpath, f), False)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def builtin_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """This Python's standard-library ``.py`` sources (no tests, no site-packages), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _walk(root, lambda p, is_dir: p.name not in _SKIP_DIRS if is_dir else p.suffix == ".py")
    if not files:
        raise DataError(f"the built-in corpus found no .py files under {str(root)!r} (a Python without its "
                        f"standard-library sources?); {_USAGE}")
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(f"python-stdlib-{version}", "builtin", root, tuple(files), max_bytes,
                  _fingerprint("builtin", root, files, max_bytes, sys.version))


def open_corpus(path: str = "", max_bytes: int = DEFAULT_MAX_BYTES, text_field: str = "text") -> Corpus:
    """The corpus at ``path`` ("" for the built-in one). Raises ``DataError`` if the path is
    missing, holds no supported files, or every file is empty."""
    if not path:
        return builtin_corpus(max_bytes)
    root = Path(path).expanduser().resolve()
    if not root.exists():
        raise DataError(f"data path {path!r} does not exist; {_USAGE}")
    if is_hf_dataset(root):
        files = _walk(root, lambda p, is_dir: True)
        return Corpus(str(root), "hf-dataset", root, tuple(files), max_bytes,
                      _fingerprint("hf-dataset", root, files, max_bytes, text_field), text_field)
    if root.is_file():
        if root.suffix.lower() not in SUFFIXES:
            raise DataError(f"unsupported data file {path!r} ({root.suffix or 'no suffix'}); {_USAGE}")
        files = [root]
    else:
        files = _walk(root, lambda p, is_dir: is_dir or p.suffix.lower() in SUFFIXES)
        if not files:
            others = sorted(p.name for p in root.iterdir())[:5]
            raise DataError(f"no .txt, .jsonl or .parquet files under {path!r} (found: {', '.join(others) or 'nothing'}); "
                            f"{_USAGE}")
    if all(f.stat().st_size == 0 for f in files):
        raise DataError(f"data path {path!r} is empty ({len(files)} file(s) of 0 bytes); {_USAGE}")
    return Corpus(str(root), "files", root, tuple(files), max_bytes,
                  _fingerprint("files", root, files, max_bytes, text_field), text_field)
