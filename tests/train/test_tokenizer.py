"""The BPE: trained on a small corpus, round-trips text, cached (no retraining, no re-tokenising);
local Hugging Face tokenizers; the token cache's layout."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from meshtrain.errors import DataError
from meshtrain.train import tokenizer as T
from meshtrain.train.config import load_config
from meshtrain.train.data import builtin_corpus, open_corpus

VOCAB = 400


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A ~200 KB slice of the built-in corpus and a BPE trained on it, in a private cache."""
    cache = str(tmp_path_factory.mktemp("tok"))
    corpus = builtin_corpus(max_bytes=200_000)
    return corpus, cache, T.load_or_train_tokenizer("", corpus, VOCAB, sample_bytes=100_000, cache=cache)


def test_bpe_round_trips_text(small):
    _, _, tok = small
    assert tok.vocab_size == VOCAB
    assert tok.decode([tok.eos_id]) == T.EOS
    for text in ("def f(x):\n    return x + 1\n", "héllo wörld ✓ 日本語 \t\r\n  ", ""):
        ids = tok.encode(text)
        assert all(0 <= i < VOCAB for i in ids)
        assert tok.decode(ids) == text
    code = "import os\nimport sys\n"
    assert len(tok.encode(code)) < len(code.encode())  # merges learned: fewer tokens than bytes


def test_bpe_cache_is_reused(small):
    corpus, cache, tok = small
    trained, mtime = T.STATS["trained"], tok.path.stat().st_mtime_ns
    again = T.load_or_train_tokenizer("", builtin_corpus(max_bytes=200_000), VOCAB, 100_000, cache)
    assert T.STATS["trained"] == trained  # loaded, not retrained
    assert again.path == tok.path and again.path.stat().st_mtime_ns == mtime
    assert again.fingerprint == tok.fingerprint
    assert not list(tok.path.parent.glob("*.tmp"))  # no temporary left behind
    other = T.load_or_train_tokenizer("", corpus, VOCAB + 50, 100_000, cache)
    assert T.STATS["trained"] == trained + 1 and other.path != tok.path  # the vocab size is part of the key


def test_processes_starting_together_train_once(small):
    corpus, cache, _ = small
    trained = T.STATS["trained"]
    with ThreadPoolExecutor(3) as pool:  # the file lock excludes threads as it does processes
        toks = list(pool.map(lambda _: T.load_or_train_tokenizer("", corpus, 333, 100_000, cache), range(3)))
    assert T.STATS["trained"] == trained + 1
    assert len({t.fingerprint for t in toks}) == 1


def test_corpus_tokens_are_cached(small):
    corpus, cache, tok = small
    before = T.STATS["tokenized"]
    tokens = T.tokenize_corpus(corpus, tok, cache)
    assert T.STATS["tokenized"] == before + 1
    docs = list(corpus.documents())
    assert tokens.dtype == np.uint16 and tokens[-1] == tok.eos_id
    assert int((tokens == tok.eos_id).sum()) == len(docs)  # one end-of-text after every document
    first = int(np.argmax(tokens == tok.eos_id))
    assert tok.decode(tokens[:first].tolist()) == docs[0]
    again = T.tokenize_corpus(corpus, tok, cache)
    assert T.STATS["tokenized"] == before + 1 and np.array_equal(again, tokens)
    meta = json.loads(T.tokens_cache_path(corpus, tok, cache).with_name("meta.json").read_text())
    assert meta["count"] == len(tokens) and meta["documents"] == len(docs)


def test_prepare_data_from_config(tmp_path, small):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"line {i} of the data"}) + "\n" for i in range(50)))
    cfg = load_config(None, [f"--data.path={tmp_path / 'd.jsonl'}", "--data.vocab_size=300"])
    corpus, tok, tokens = T.prepare_data(cfg.data, cache=tmp_path / "cache")
    assert corpus.kind == "files" and tok.vocab_size <= 300
    assert tok.decode(tokens.tolist()).split(T.EOS)[:2] == ["line 0 of the data", "line 1 of the data"]


def test_local_hugging_face_tokenizer(tmp_path, small):
    _, _, tok = small
    (tmp_path / "tokenizer.json").write_text(tok.backend.to_str())
    loaded = T.load_tokenizer(tmp_path)
    assert loaded.eos_id == tok.eos_id and loaded.encode("x = 1") == tok.encode("x = 1")
    assert T.load_or_train_tokenizer(str(tmp_path / "tokenizer.json")).vocab_size == VOCAB
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "x"}}))
    assert T.load_tokenizer(tmp_path).eos_id == tok.encode("x")[0]  # the config's eos_token wins


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="has no tokenizer.json"):
        T.load_tokenizer(tmp_path)
    with pytest.raises(DataError, match="not found"):
        T.load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot read tokenizer"):
        T.load_tokenizer(tmp_path)
    (tmp_path / "t.txt").write_text("a tiny text " * 20)
    plain = T.train_bpe(["abc abd"], 280)
    plain.add_special_tokens(["<pad>"])
    (tmp_path / "tokenizer.json").write_text(plain.to_str().replace(T.EOS, "<nothing>"))
    with pytest.raises(DataError, match="no end-of-text token"):
        T.load_tokenizer(tmp_path)
    with pytest.raises(DataError, match="too small"):
        T.load_or_train_tokenizer("", open_corpus(str(tmp_path / "t.txt")), vocab_size=100, cache=tmp_path)
