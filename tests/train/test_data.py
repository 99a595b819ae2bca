"""Corpora: the built-in one is deterministic and capped; user files in every format; every bad
input is a DataError naming the path and the fix."""

from __future__ import annotations

import importlib.util
import json
import sysconfig
from pathlib import Path

import pytest

from meshtrain.errors import DataError
from meshtrain.train.data import builtin_corpus, open_corpus


def _error(path: Path | str, **kw) -> str:
    with pytest.raises(DataError) as e:
        list(open_corpus(str(path), **kw).documents())
    return str(e.value)


def test_builtin_corpus_is_the_stdlib_read_deterministically():
    a, b = builtin_corpus(max_bytes=300_000), open_corpus("", max_bytes=300_000)
    assert a.fingerprint == b.fingerprint and a.kind == "builtin" and a.name.startswith("python-stdlib-")
    docs = list(a.documents())
    assert docs == list(b.documents())
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in a.files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert not any(part in ("test", "tests", "site-packages") for r in rel for part in r.split("/")[:-1])
    assert docs[0] == a.files[0].read_text(encoding="utf-8", errors="replace")
    assert sum(len(d.encode()) for d in docs) == 300_000  # the budget is filled exactly, the last file cut
    assert builtin_corpus(max_bytes=1000).fingerprint != a.fingerprint  # the budget is part of the identity


def test_user_files_in_every_format(tmp_path):
    (tmp_path / "b.txt").write_text("second file\n")
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third ü\n")
    (tmp_path / "notes.md").write_text("ignored")
    (tmp_path / ".hidden.txt").write_text("ignored")
    corpus = open_corpus(str(tmp_path))
    assert [f.name for f in corpus.files] == ["a.jsonl", "b.txt", "c.txt"]
    assert list(corpus.documents()) == ["one", "two", "second file\n", "third ü\n"]
    assert list(open_corpus(str(tmp_path / "a.jsonl")).documents()) == ["one", "two"]
    assert list(open_corpus(str(tmp_path), max_bytes=5).documents()) == ["one", "tw"]


def test_fingerprint_changes_with_the_files(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello")
    before = open_corpus(str(f)).fingerprint
    f.write_text("hello, world")
    assert open_corpus(str(f)).fingerprint != before


def test_missing_and_empty_paths(tmp_path):
    msg = _error(tmp_path / "nope")
    assert "nope" in msg and "does not exist" in msg and "point data.path at" in msg
    assert "no .txt, .jsonl or .parquet files under" in _error(tmp_path)
    (tmp_path / "x.csv").write_text("a,b")
    assert "(found: x.csv)" in _error(tmp_path)
    assert "unsupported data file" in _error(tmp_path / "x.csv")
    (tmp_path / "e.txt").write_text("")
    assert "is empty (1 file(s) of 0 bytes)" in _error(tmp_path / "e.txt")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    assert "every document is empty" in _error(tmp_path / "blank.jsonl")


def test_jsonl_errors_name_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    assert _error(f) == (f'{f}:2: no "text" field (found: body); each line must be a JSON object like {{"text": "..."}}, '
                         f'or set data.text_field to the field that holds the text')
    f.write_text('{"text": "ok"}\n{"text": 3}\n')
    assert f'{f}:2: "text" is int, not a string' == _error(f)
    f.write_text('{"text": "ok"}\n\n{oops\n')
    assert _error(f).startswith(f"{f}:3: not valid JSON")


def test_txt_must_be_utf8(tmp_path):
    f = tmp_path / "latin.txt"
    f.write_bytes("caf\xe9".encode("latin-1"))
    assert "is not UTF-8 text (byte 3" in _error(f)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_parquet_without_pyarrow_says_how_to_install(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    assert "needs pyarrow, which is not installed: pip install pyarrow" in _error(tmp_path / "d.parquet")


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow")
def test_parquet_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None, "b"], "n": [1, 2, 3]}), tmp_path / "d.parquet")
    assert list(open_corpus(str(tmp_path / "d.parquet")).documents()) == ["a", "b"]
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "e.parquet")
    assert 'has no "text" column (columns: body)' in _error(tmp_path / "e.parquet")


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_dataset_without_datasets_says_how_to_install(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": []}))
    (tmp_path / "dataset_info.json").write_text("{}")
    msg = _error(tmp_path)
    assert "is a saved Hugging Face dataset" in msg and "pip install datasets" in msg
