"""The training step reads the device at most once (loss, gradient norm and under fp16 the overflow
verdict together): every
``item`` / ``tolist`` / ``float`` / ``int`` / ``bool`` of a tensor from meshtrain's own code is
counted, over runs of 2 and 5 steps, so set-up and the end of the run cancel out. On a GPU each
such read is a sync that stalls the queue of kernels; on this CPU the count is what can be checked."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

from meshtrain.cli import main

SMALL = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=4",
         "--train.seq_len=32", "--train.warmup_steps=2", "--no-progress", "--comm.transport=local",
         "--checkpoint.enabled=false"]
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
PACKAGE = str(Path(__file__).resolve().parents[2] / "meshtrain")


@pytest.fixture
def meshtrain_reads(monkeypatch):
    """A counter of host reads whose caller is a meshtrain module (file:line -> calls)."""
    counts: collections.Counter = collections.Counter()

    def counting(name: str, real):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE):
                counts[f"{name} at {caller[len(PACKAGE) + 1:]}:{sys._getframe(1).f_lineno}"] += 1
            return real(self, *args, **kwargs)
        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    return counts


@pytest.mark.parametrize("ranks, layout", [
    (1, ["--parallel.dp=1", "--parallel.tp=1"]),
    (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true"]),
    (2, ["--parallel.dp=2", "--parallel.tp=1", "--parallel.zero_stage=3"]),
    (4, ["--parallel.dp=1", "--parallel.tp=1", "--parallel.pp=2", "--parallel.cp=2", "--parallel.microbatches=2"]),
    # fp16: the overflow verdict rides in the same read as loss and norm
    (2, ["--parallel.dp=2", "--parallel.tp=1", "--parallel.zero_stage=2", "--train.precision=fp16"]),
], ids=["one", "dp2xtp2-sp", "zero3", "pp2xcp2", "zero2-fp16"])
def test_one_host_read_per_rank_per_step(tmp_path, meshtrain_reads, ranks, layout):
    per_run = []
    for steps in (2, 5):
        meshtrain_reads.clear()
        assert main(["train", f"--out={tmp_path / str(steps)}", f"--train.steps={steps}", *SMALL, *layout]) == 0
        per_run.append(dict(meshtrain_reads))
    extra = {k: per_run[1].get(k, 0) - per_run[0].get(k, 0) for k in per_run[1]}
    extra = {k: v for k, v in extra.items() if v}
    # 3 more steps on every rank: exactly one read each, in the trainer's step, before the optimizer step
    assert sum(extra.values()) == 3 * ranks, extra
    assert all("train/step.py" in k for k in extra), extra
