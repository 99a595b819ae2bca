"""Expert parallelism where users run it: ranks as processes, over shared memory (shm, the
default inside a host) and over torch.distributed's gloo, against one process (the same
reference as test_moe_parity, computed here). Every MoE layout class runs on processes: ep with
dp, with tp, with pp, with cp and activation checkpointing, with HSDP + ZeRO-3; small buckets
keep the data-parallel reductions running all through backward, beside the experts'
all-to-all. Each run also checks that every group's calls were issued in one order on every
rank (``comm.call_order``). Across simulated hosts: tests/hosts/test_training_across_hosts.py."""

from __future__ import annotations

import pytest
import torch

from meshtrain.comm import call_order
from meshtrain.comm.launch import spawn

from .test_moe_parity import reference, train_rank

pytestmark = pytest.mark.timeout(240)
SMALL = 4 / 1024  # MB
# (id, layout, parallel config, variant, transports)
LAYOUTS = [
    ("dp2-ep2", dict(dp=2, ep=2), dict(bucket_cap_mb=SMALL), "seq-aux", ("shm", "torch")),
    ("dp4-ep4", dict(dp=4, ep=4), dict(bucket_cap_mb=SMALL), "seq-aux", ("shm",)),
    ("dp2xtp2-ep2", dict(dp=2, tp=2, ep=2), dict(bucket_cap_mb=SMALL), "seq-aux", ("shm",)),
    ("dp2xpp2-ep2-1f1b", dict(dp=2, pp=2, ep=2), dict(microbatches=2, bucket_cap_mb=SMALL), "seq-aux", ("shm",)),
    ("dp2xpp2-ep2-interleaved", dict(dp=2, pp=2, ep=2),
     dict(microbatches=2, schedule="interleaved", virtual_stages=2, bucket_cap_mb=SMALL), "seq-aux", ("torch",)),
    ("dp2xcp2-ep2-ac", dict(dp=2, cp=2, ep=2), dict(activation_checkpointing="full", bucket_cap_mb=SMALL), "seq-aux",
     ("shm",)),
    ("hsdp2x2-ep2-zero3", dict(dp=4, dp_replicate=2, ep=2), dict(zero_stage=3), "seq-aux", ("shm",)),
    ("dp2xtp2-ep2-zero3", dict(dp=2, tp=2, ep=2), dict(zero_stage=3), "sigmoid-batch", ("torch",)),
]
CASES = [(name, layout, config, variant, t) for name, layout, config, variant, ts in LAYOUTS for t in ts]


def recorded(rank: int, variant: str, layout: dict, config: dict, clip: float) -> tuple[list, list]:
    """``train_rank`` in a process, with its collectives noted: (losses, notes)."""
    call_order.start()
    losses, _, _ = train_rank(rank, variant, layout, config, clip)
    return losses, call_order.stop()


@pytest.mark.parametrize("name, layout, config, variant, transport", CASES,
                         ids=[f"{c[0]}-{c[4]}" for c in CASES])
def test_moe_layout_on_processes_matches_one_process(name, layout, config, variant, transport):
    clip = 1.0 if config.get("zero_stage") else 0.0
    want, _, _ = reference(variant, clip)
    world = layout["dp"] * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    out = spawn(world, recorded, variant, layout, config, clip, timeout=200, transport=transport)
    assert call_order.check([notes for _, notes in out]) > 0
    for losses, _ in out:
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)
