"""The tokenizer and the token cache.

Either a byte-level BPE trained locally with Hugging Face ``tokenizers`` on a sample of the corpus
(``Corpus.sample``), or a local Hugging Face tokenizer (a directory with ``tokenizer.json`` or the
file itself). Training happens once: the result is cached under ``meshtrain.files.cache_dir()`` keyed by a hash of
the corpus identity, the vocabulary size and the sample size. The corpus tokenised by a tokenizer
is cached too, as a flat file of token ids (uint16 when the vocabulary fits, else int32) with a
``meta.json`` beside it; documents are separated by the end-of-text token.

Every cache file is written to a temporary name, fsynced and renamed, under a file lock, so
processes that start together build it once and nobody reads a partial file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np

from ..errors import DataError
from ..files import cache_dir
from .data import Corpus, open_corpus

if TYPE_CHECKING:
    import tokenizers

    from .config import DataSection

EOS = "<|endoftext|>"
EOS_CANDIDATES = (EOS, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
_FORMAT = 1  # bump when training or tokenising changes, to invalidate the caches
_CHUNK_DOCS = 256
STATS = {"trained": 0, "tokenized": 0}
"""How many times this process trained a BPE / tokenised a corpus (cache misses), for tests and logs."""


class Tokenizer:
    """Text <-> token ids over a Hugging Face ``tokenizers.Tokenizer``, with its end-of-text id."""

    def __init__(self, backend: "tokenizers.Tokenizer", eos_id: int, path: Path | None = None) -> None:
        self.backend = backend
        self.eos_id = eos_id
        """Id of the token that separates documents."""
        self.path = path
        """The tokenizer.json it was loaded from (None if built in memory)."""
        self.fingerprint = hashlib.sha256(backend.to_str().encode()).hexdigest()
        """Hex SHA-256 of the tokenizer's JSON: what the token cache is keyed by."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel (Rust threads)."""
        fast = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch  # fast: no offsets
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` (special tokens kept, so decode(encode(s)) == s)."""
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, path={str(self.path)!r})"


# -------------------------------------------------------------------------------------- file helpers

@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if needed), so concurrent processes build a cache once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        except ImportError:  # Windows: no lock; the atomic renames still keep files whole
            pass
        yield


def _atomic_write(path: Path, write: Any) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync it, rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a cache is shared like any other file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    _atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


# ----------------------------------------------------------------------------------------- tokenizer

def train_bpe(texts: Iterable[str], vocab_size: int) -> "tokenizers.Tokenizer":
    """A byte-level BPE (GPT-2 style: every byte is a token, so any text encodes) with ``EOS`` as
    its only special token, trained on ``texts``. A small text may give fewer than ``vocab_size``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def _eos_id(backend: "tokenizers.Tokenizer", path: Path) -> int:
    """The end-of-text id: tokenizer_config.json's eos_token, else a well-known end-of-text token."""
    names = list(EOS_CANDIDATES)
    config = path.parent / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        tid = backend.token_to_id(name)
        if tid is not None:
            return tid
    raise DataError(f"tokenizer {str(path)!r} has no end-of-text token (looked for {', '.join(names)}); set "
                    f"\"eos_token\" in a tokenizer_config.json beside it")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A local Hugging Face tokenizer: a directory holding ``tokenizer.json``, or the file itself."""
    from tokenizers import Tokenizer as HFTokenizer

    p = Path(path).expanduser()
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        hint = (" (it has no tokenizer.json: save a fast tokenizer with save_pretrained(), which writes one)"
                if p.is_dir() else "")
        raise DataError(f"tokenizer {str(path)!r} not found{hint}; set data.tokenizer to a local Hugging Face "
                        f"tokenizer directory or tokenizer.json, or to \"\" to train a BPE on the corpus")
    try:
        backend = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(f"cannot read tokenizer {str(file)!r}: {e}") from None
    return Tokenizer(backend, _eos_id(backend, file), file)


def bpe_cache_path(corpus: Corpus, vocab_size: int, sample_bytes: int, cache: str | Path | None = None) -> Path:
    """Where the BPE for this corpus, vocabulary and sample size is (or will be) cached."""
    import tokenizers

    version = ".".join(tokenizers.__version__.split(".")[:2])
    key = hashlib.sha256(f"bpe|{_FORMAT}|{corpus.fingerprint}|{vocab_size}|{sample_bytes}|{version}".encode())
    return Path(cache or cache_dir()) / "tokenizers" / f"bpe-{vocab_size}-{key.hexdigest()[:16]}" / "tokenizer.json"


def load_or_train_tokenizer(spec: str = "", corpus: Corpus | None = None, vocab_size: int = 8192,
                            sample_bytes: int = 4_000_000, cache: str | Path | None = None) -> Tokenizer:
    """The tokenizer of ``data.tokenizer``: ``spec`` a local Hugging Face tokenizer, or "" for a
    byte-level BPE of ``vocab_size`` trained on ``sample_bytes`` of ``corpus`` (default: the
    built-in one) — loaded from the cache if it was trained before, else trained and cached."""
    if spec:
        return load_tokenizer(spec)
    if vocab_size < 257:
        raise DataError(f"vocab_size = {vocab_size} is too small for a byte-level BPE (256 bytes + end-of-text)")
    corpus = corpus or open_corpus("")
    path = bpe_cache_path(corpus, vocab_size, sample_bytes, cache)
    if not path.is_file():
        with _locked(path.with_name("lock")):
            if not path.is_file():  # another process may have trained it while we waited
                backend = train_bpe(corpus.sample(sample_bytes), vocab_size)
                STATS["trained"] += 1
                _write_json(path.with_name("meta.json"), {"corpus": corpus.name, "fingerprint": corpus.fingerprint,
                                                          "vocab_size": vocab_size, "sample_bytes": sample_bytes})
                _atomic_write(path, lambda f: f.write(backend.to_str().encode()))
    return load_tokenizer(path)


# --------------------------------------------------------------------------------------- token cache

def tokens_cache_path(corpus: Corpus, tokenizer: Tokenizer, cache: str | Path | None = None) -> Path:
    """Where the token ids of ``corpus`` under ``tokenizer`` are (or will be) cached."""
    key = hashlib.sha256(f"tokens|{_FORMAT}|{corpus.fingerprint}|{tokenizer.fingerprint}".encode()).hexdigest()
    return Path(cache or cache_dir()) / "tokens" / key[:24] / "tokens.bin"


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2 ** 16 else np.int32)


def _read_tokens(path: Path) -> np.ndarray | None:
    """The cached ids as a read-only memory map, or None if absent or incomplete."""
    meta_path = path.with_name("meta.json")
    if not (meta_path.is_file() and path.is_file()):
        return None
    meta = json.loads(meta_path.read_text())
    dtype = np.dtype(meta["dtype"])
    if path.stat().st_size != meta["count"] * dtype.itemsize:
        return None
    return np.memmap(path, dtype=dtype, mode="r", shape=(meta["count"],)) if meta["count"] else np.zeros(0, dtype)


def tokenize_corpus(corpus: Corpus, tokenizer: Tokenizer, cache: str | Path | None = None) -> np.ndarray:
    """Every document's ids followed by ``eos_id``, as one flat array (a read-only memory map of the
    cache file); tokenised once, then read from the cache."""
    path = tokens_cache_path(corpus, tokenizer, cache)
    tokens = _read_tokens(path)
    if tokens is not None:
        return tokens
    with _locked(path.with_name("lock")):
        tokens = _read_tokens(path)
        if tokens is None:
            dtype = _token_dtype(tokenizer.vocab_size)
            counts = {"count": 0, "documents": 0}

            def write(f: Any) -> None:
                docs: list[str] = []
                for doc in corpus.documents():
                    docs.append(doc)
                    if len(docs) == _CHUNK_DOCS:
                        _write_chunk(f, tokenizer, docs, dtype, counts)
                        docs = []
                _write_chunk(f, tokenizer, docs, dtype, counts)

            _atomic_write(path, write)
            STATS["tokenized"] += 1
            _write_json(path.with_name("meta.json"), {**counts, "dtype": dtype.name, "eos_id": tokenizer.eos_id,
                                                      "corpus": corpus.name, "tokenizer": str(tokenizer.path)})
            tokens = _read_tokens(path)
    assert tokens is not None
    return tokens


def _write_chunk(f: Any, tokenizer: Tokenizer, docs: list[str], dtype: np.dtype, counts: dict[str, int]) -> None:
    if not docs:
        return
    ids = [np.asarray(e + [tokenizer.eos_id], dtype=dtype) for e in tokenizer.encode_batch(docs)]
    flat = np.concatenate(ids)
    f.write(flat.tobytes())
    counts["count"] += int(flat.size)
    counts["documents"] += len(docs)


def prepare_data(data: "DataSection", cache: str | Path | None = None) -> tuple[Corpus, Tokenizer, np.ndarray]:
    """What the trainer needs from ``[data]``: the corpus, its tokenizer and its token ids (each
    from the cache when it was built before). Run it once before starting the ranks, or on every
    rank: the lock makes the others wait for the first."""
    corpus = open_corpus(data.path, data.max_bytes, data.text_field)
    tokenizer = load_or_train_tokenizer(data.tokenizer, corpus, data.vocab_size, data.tokenizer_sample_bytes, cache)
    return corpus, tokenizer, tokenize_corpus(corpus, tokenizer, cache)
