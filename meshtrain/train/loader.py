"""A deterministic, resumable loader of global batches over a flat stream of token ids.

Sample ``i`` is the window ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` (inputs and the targets
shifted by one; neighbouring windows share one token), for ``i`` in ``0 .. num_samples-1``. Each
epoch visits every sample once in a seeded permutation that depends only on (seed, epoch); the
epochs' permutations are read back to back, ``global_batch`` samples at a time, so a batch may
straddle two epochs and no sample is ever dropped.

So the order depends only on the seed (and the batches on the global batch size), never on the
layout: every rank builds the same loader and gets the same global batch, and the model takes its
own dp rows and cp share (``ParallelModel.local_batch``). The position (epoch, index) is the
loader's whole state: ``state_dict`` / ``load_state_dict`` resume with the next sample, none
skipped or repeated.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from ..errors import DataError


class Batch(NamedTuple):
    """A global batch: ``tokens`` (global_batch, seq_len + 1) int64 and the sample id of each row."""

    tokens: torch.Tensor
    sample_ids: list[int]

    @property
    def inputs(self) -> torch.Tensor:
        """The first seq_len tokens of each row."""
        return self.tokens[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        """The last seq_len tokens of each row (the inputs shifted by one)."""
        return self.tokens[:, 1:]


def dp_rows(global_batch: int, dp: int, dp_rank: int) -> slice:
    """The rows of a global batch that data-parallel rank ``dp_rank`` of ``dp`` trains on:
    contiguous blocks, as ``ParallelModel.local_batch`` takes them."""
    if global_batch % dp:
        raise DataError(f"global batch {global_batch} is not divisible by dp = {dp}")
    rows = global_batch // dp
    return slice(dp_rank * rows, (dp_rank + 1) * rows)


class GlobalBatchLoader:
    """Global batches of ``global_batch`` windows of ``seq_len + 1`` tokens, forever (epoch after
    epoch), in an order fixed by ``seed``. Iterate it, or call ``next_batch()``."""

    def __init__(self, tokens: np.ndarray | torch.Tensor | Sequence[int], seq_len: int, global_batch: int,
                 seed: int = 0) -> None:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.cpu().numpy()
        self.tokens = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)
        """The token stream (a memory map of the token cache is read, never copied whole)."""
        if self.tokens.ndim != 1:
            raise DataError(f"tokens must be a flat array of token ids, got shape {tuple(self.tokens.shape)}")
        if seq_len < 1 or global_batch < 1:
            raise DataError(f"seq_len = {seq_len} and global_batch = {global_batch} must be >= 1")
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.num_samples = (len(self.tokens) - 1) // seq_len if len(self.tokens) > 0 else 0
        """Windows in the stream (one epoch)."""
        if self.num_samples < 1:
            raise DataError(f"the data has {len(self.tokens)} tokens, fewer than one sample of seq_len + 1 = "
                            f"{seq_len + 1}; use more data (data.path, data.max_bytes) or a shorter train.seq_len")
        self.epoch = 0
        """Epoch of the next sample."""
        self.index = 0
        """Position of the next sample in this epoch's permutation."""
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    # -- order ------------------------------------------------------------------------------------

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the samples in ``epoch``: a permutation seeded by (seed, epoch) only."""
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm_epoch, self._perm = epoch, rng.permutation(self.num_samples)
        return self._perm

    def sample(self, sample_id: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of one sample."""
        start = sample_id * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def next_ids(self) -> list[int]:
        """The sample ids of the next global batch, advancing the position."""
        ids: list[int] = []
        while len(ids) < self.global_batch:
            perm = self.permutation(self.epoch)
            take = min(self.global_batch - len(ids), self.num_samples - self.index)
            ids += perm[self.index:self.index + take].tolist()
            self.index += take
            if self.index == self.num_samples:
                self.epoch, self.index = self.epoch + 1, 0
        return ids

    def next_batch(self) -> Batch:
        """The next global batch (every rank gets the same one)."""
        ids = self.next_ids()
        rows = np.stack([self.sample(i) for i in ids])
        return Batch(torch.from_numpy(rows), ids)

    def __iter__(self) -> "GlobalBatchLoader":
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    @property
    def batches_per_epoch(self) -> float:
        """Global batches in one pass over the data (fractional: batches straddle epochs)."""
        return self.num_samples / self.global_batch

    # -- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position and what it is valid for (a checkpoint stores it)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "seq_len": self.seq_len,
                "num_samples": self.num_samples, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position: the next batch starts with the sample after the last one
        served. The seed, seq_len and data must be those of the saved run (else ``DataError``); the
        global batch may differ (the sample order does not depend on it)."""
        for key in ("seed", "seq_len", "num_samples"):
            if state[key] != getattr(self, key):
                raise DataError(f"the loader state was saved with {key} = {state[key]} but this run has "
                                f"{key} = {getattr(self, key)}; resume with the same train.seed, train.seq_len "
                                f"and data, or start a new run")
        if not (0 <= state["index"] < self.num_samples and state["epoch"] >= 0):
            raise DataError(f"bad loader position epoch = {state['epoch']}, index = {state['index']} "
                            f"(an epoch has {self.num_samples} samples)")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
