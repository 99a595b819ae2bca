"""The planner's shared-memory term against the kernel's count: on the shm transport, a rank's
resident set maps the part of its peers' symmetric gradient buckets that the in-place all-reduce
reads (``memory.peer_read_fraction``), which ``meshtrain train``'s peak memory then includes."""

from __future__ import annotations

import pytest
import torch

from meshtrain.comm.launch import spawn
from meshtrain.plan.memory import peer_read_fraction

pytestmark = pytest.mark.timeout(120)

ELEMENTS = 4 << 20  # 16 MiB of float32: far above the transport's own staging buffers


def _shmem_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def _resident_growth(rank: int) -> int:
    """Bytes of shared memory this rank's resident set gains from one bucket and its all-reduce."""
    import meshtrain.comm as mc

    warm = torch.ones(1024)
    mc.all_reduce(warm)  # the transport's staging areas, touched before the baseline
    before = _shmem_bytes()
    bucket = mc.symmetric_empty(ELEMENTS, torch.float32)
    bucket.fill_(rank + 1.0)
    mc.all_reduce(bucket)
    world = mc.get_world_size()
    assert torch.all(bucket == world * (world + 1) / 2)
    return _shmem_bytes() - before


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_maps_its_own_bucket_and_what_it_reads_of_its_peers(world):
    grown = spawn(world, _resident_growth, timeout=100, comm_timeout=30, transport="shm")
    predicted = ELEMENTS * 4 * (1 + peer_read_fraction(world))
    for rank, got in enumerate(grown):
        assert got == pytest.approx(predicted, rel=0.1), (rank, got, predicted)
