"""The loader: windows of the stream, a seeded order independent of the layout, every sample
once per epoch, and a resume that continues with the next sample."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from meshtrain.errors import DataError
from meshtrain.train.loader import GlobalBatchLoader, dp_rows

SEQ, BATCH = 8, 6
TOKENS = np.random.default_rng(0).integers(0, 1000, size=SEQ * 50 + 1).astype(np.uint16)  # 50 samples


def _ids(loader: GlobalBatchLoader, n: int) -> list[int]:
    return [i for _ in range(n) for i in loader.next_batch().sample_ids]


def test_batches_are_windows_of_the_stream():
    loader = GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=1)
    batch = next(iter(loader))
    assert batch.tokens.shape == (BATCH, SEQ + 1) and batch.tokens.dtype == torch.int64
    for row, i in zip(batch.tokens, batch.sample_ids):
        assert row.tolist() == TOKENS[i * SEQ:i * SEQ + SEQ + 1].tolist()
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    assert loader.num_samples == 50


def test_order_depends_only_on_the_seed():
    a, b = _ids(GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=3), 20), _ids(GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=3), 20)
    assert a == b
    assert a != _ids(GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=4), 20)
    # the global batch size only groups the same sequence of samples differently
    assert _ids(GlobalBatchLoader(TOKENS, SEQ, 4, seed=3), 30) == a
    assert _ids(GlobalBatchLoader(torch.from_numpy(TOKENS.astype(np.int64)), SEQ, BATCH, seed=3), 20) == a


def test_every_sample_once_per_epoch():
    loader = GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=0)
    ids = _ids(loader, 25)  # 150 ids = 3 epochs of 50; batches straddle the epoch boundaries
    for e in range(3):
        assert sorted(ids[e * 50:(e + 1) * 50]) == list(range(50))
    assert ids[:50] != ids[50:100]  # a fresh permutation each epoch
    assert (loader.epoch, loader.index) == (3, 0)


@pytest.mark.parametrize("stop", [1, 8, 9, 17])
def test_resume_continues_with_the_next_sample(stop):
    steps = 20
    reference = GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=7)
    expected = [reference.next_batch() for _ in range(steps)]

    first = GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=7)
    seen = [first.next_batch() for _ in range(stop)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=7)
    resumed.load_state_dict(state)
    seen += [resumed.next_batch() for _ in range(steps - stop)]

    assert [b.sample_ids for b in seen] == [b.sample_ids for b in expected]
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(seen, expected))
    flat = [i for b in seen for i in b.sample_ids]  # 120 samples: 2 full epochs + 20, none twice per epoch
    assert sorted(flat[:50]) == sorted(flat[50:100]) == list(range(50))
    assert len(set(flat[100:])) == 20


def test_resume_with_another_global_batch_keeps_the_sample_order():
    first = GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=2)
    head = _ids(first, 5)
    resumed = GlobalBatchLoader(TOKENS, SEQ, 4, seed=2)
    resumed.load_state_dict(first.state_dict())
    assert head + _ids(resumed, 10) == _ids(GlobalBatchLoader(TOKENS, SEQ, 1, seed=2), 70)


@pytest.mark.parametrize("dp", [1, 2, 3, 6])
def test_same_samples_whatever_the_layout(dp):
    """Every dp rank builds the same loader; its rows of each global batch, gathered over the
    ranks, are the global batch of a single process."""
    one = GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=5)
    single = [one.next_batch().sample_ids for _ in range(12)]
    ranks = [GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=5) for _ in range(dp)]
    for step in range(12):
        batches = [r.next_batch() for r in ranks]
        gathered = [i for rank, b in enumerate(batches) for i in b.sample_ids[dp_rows(BATCH, dp, rank)]]
        assert gathered == single[step]
        assert all(torch.equal(b.tokens, batches[0].tokens) for b in batches)


def test_bad_inputs():
    with pytest.raises(DataError, match="fewer than one sample of seq_len \\+ 1 = 9"):
        GlobalBatchLoader(TOKENS[:8], SEQ, BATCH)
    with pytest.raises(DataError, match="flat array"):
        GlobalBatchLoader(TOKENS.reshape(1, -1), SEQ, BATCH)
    loader = GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=0)
    with pytest.raises(DataError, match="saved with seed = 0 but this run has seed = 1"):
        GlobalBatchLoader(TOKENS, SEQ, BATCH, seed=1).load_state_dict(loader.state_dict())
    with pytest.raises(DataError, match="saved with num_samples = 50 but this run has num_samples = 25"):
        GlobalBatchLoader(TOKENS[:SEQ * 25 + 1], SEQ, BATCH).load_state_dict(loader.state_dict())
    with pytest.raises(DataError, match="not divisible by dp = 4"):
        dp_rows(BATCH, 4, 0)
