"""The metadata fingerprint the shared-memory and board checks compare (``runner.call_fingerprint``):
memoized per distinct call, with the sequence number mixed in, it must still tell apart any two
calls whose metadata or sequence number differ, and give every rank the same number."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.comm import runner

pytestmark = pytest.mark.timeout(60)

metas = st.fixed_dictionaries(
    {"op": st.sampled_from(["all_reduce", "all_gather", "broadcast"]),
     "shapes": st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=2).map(tuple),
     "dtype": st.sampled_from(["float32", "bfloat16"]),
     "algorithm": st.sampled_from(["native", "ring", "auto"])},
    optional={"root": st.integers(0, 3), "redop": st.sampled_from(["sum", "max"])})


@settings(max_examples=200, deadline=None)
@given(metas, metas, st.integers(0, 2**40), st.integers(0, 2**40))
def test_fingerprints_differ_exactly_where_the_calls_do(a, b, seq_a, seq_b):
    fa, fb = runner.call_fingerprint(a, seq_a), runner.call_fingerprint(b, seq_b)
    assert -2**63 <= fa < 2**63
    same = json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) and seq_a == seq_b
    assert (fa == fb) == same


def test_the_memo_gives_what_hashing_afresh_gives_in_any_key_order(monkeypatch):
    monkeypatch.setattr(runner, "_MEMO", {})
    meta = {"shapes": ((4, 2),), "dtype": "float32", "algorithm": "native", "redop": "sum", "op": "all_reduce"}
    first = runner.call_fingerprint(meta, 7)
    assert len(runner._MEMO) == 1
    assert runner.call_fingerprint(dict(meta), 7) == first  # from the memo
    assert runner.call_fingerprint(meta, 8) != first
    reordered = dict(reversed(list(meta.items())))  # another rank may build its dict in another order
    assert runner.call_fingerprint(reordered, 7) == first
    monkeypatch.setattr(runner, "_MEMO", {})
    assert runner.call_fingerprint(meta, 7) == first  # hashed afresh


def test_a_value_that_cannot_key_the_memo_is_hashed_every_call(monkeypatch):
    monkeypatch.setattr(runner, "_MEMO", {})
    meta = {"op": "all_to_all", "shapes": [[2]], "extra": {"k": [1, 2]}}  # lists and a dict
    assert runner.call_fingerprint(meta, 3) == runner.call_fingerprint(dict(meta), 3)
    assert runner.call_fingerprint(meta, 3) != runner.call_fingerprint(dict(meta, extra={"k": [1, 3]}), 3)
    assert runner._MEMO == {}


def test_the_memo_stays_bounded(monkeypatch):
    monkeypatch.setattr(runner, "_MEMO", {})
    monkeypatch.setattr(runner, "_MEMO_MOST", 8)
    for n in range(50):
        runner.call_fingerprint({"op": "all_reduce", "shapes": ((n,),)}, n)
    assert 0 < len(runner._MEMO) <= 8
