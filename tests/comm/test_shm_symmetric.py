"""Symmetric memory (``comm.symmetric_empty``) on the shm transport, with real processes: the
in-place all-reduce against plain-torch references, bitwise equal on every rank, for whole
tensors, slices and subgroups; mismatches named; a plain tensor elsewhere; DDP's buckets."""

from __future__ import annotations


import pytest
import torch

from meshtrain.comm.launch import spawn
from meshtrain.errors import CollectiveMismatch

from ._outcomes import outcomes
from ._reference import assert_reduced, make_input, reduce_ref

pytestmark = pytest.mark.timeout(120)


def _count_in_place() -> list[int]:
    """Count, in this process, the all-reduces that take the in-place path: [count]."""
    from meshtrain.comm.algorithms import shm_direct

    taken = [0]
    real = shm_direct.all_reduce_symmetric

    def counted(*a):
        taken[0] += 1
        return real(*a)

    shm_direct.all_reduce_symmetric = counted
    return taken


def _in_place(rank: int) -> dict:
    """Every case on every rank; counts the calls that took the in-place path."""
    import meshtrain.comm as mc
    from meshtrain.comm.algorithms import shm_direct

    taken = _count_in_place()
    shm_direct.REDUCE_BLOCK_BYTES = 4108  # many blocks, a ragged last one, at a test's sizes
    p = mc.get_world_size()
    fails, bits, expected_taken = [], {}, 0
    groups = [None] + ([mc.new_group([0, 2]), mc.new_group(list(range(1, p)))] if p >= 3 else [])
    for gi, g in enumerate(groups):
        granks = list(range(p)) if g is None else g.ranks
        if rank not in granks:
            continue
        for ci, (dtype, n, op) in enumerate([(torch.float32, 70_001, "sum"), (torch.float64, 40_000, "avg"),
                                             (torch.int32, 99_999, "max"), (torch.float32, 65_537, "min"),
                                             (torch.int64, 20_000, "prod"), (torch.float32, 1_000, "sum")]):
            t = mc.symmetric_empty(n + 10, dtype, group=g)
            seed = gi * 100 + ci
            for algo in ("shm", "auto"):
                for part in ("whole", "slice"):
                    view = t[:n] if part == "whole" else t[7 : n + 3]  # the same place on every member
                    t.fill_(-5)
                    x = make_input(seed, rank, view.shape, dtype, op)
                    view.copy_(x)
                    want = reduce_ref([make_input(seed, r, view.shape, dtype, op) for r in granks], op)
                    mc.all_reduce(view, op=op, group=g, algorithm=algo)
                    big = view.numel() * view.element_size() > shm_direct.SMALL_BYTES
                    expected_taken += int(big)  # auto takes shm for a symmetric tensor
                    try:
                        assert_reduced(view, want, op, len(granks))
                        rest = torch.cat([t[: 7 if part == "slice" else 0], t[n + 3 if part == "slice" else n :]])
                        assert bool((rest == -5).all()), "bytes outside the reduced part changed"
                    except AssertionError as exc:
                        fails.append(f"rank {rank} group {granks} {dtype} {n} {op} {algo} {part}: {str(exc)[:200]}")
                    bits[f"{gi}/{ci}/{algo}/{part}"] = view.clone()
    return {"fails": fails, "bits": {k: v.numpy().tobytes() for k, v in bits.items()},
            "taken": taken[0], "expected_taken": expected_taken}


@pytest.mark.parametrize("p", [2, 3, 4])
def test_symmetric_all_reduce_is_in_place_and_matches_torch(p):
    res = spawn(p, _in_place, timeout=110, comm_timeout=30, transport="shm")
    assert not [f for r in res for f in r["fails"]]
    for r in res:
        assert r["taken"] == r["expected_taken"] and r["taken"] >= 8, (r["taken"], r["expected_taken"])
    keys = set().union(*(r["bits"] for r in res))
    for key in keys:  # every member holds bitwise the same result
        assert len({r["bits"][key] for r in res if key in r["bits"]}) == 1, key


def _mismatches(rank: int) -> dict:
    import meshtrain.comm as mc

    t = mc.symmetric_empty(50_000)
    cases = {
        "plain-vs-symmetric": lambda: mc.all_reduce(t[:40_000] if rank == 0 else torch.ones(40_000), algorithm="shm"),
        "offsets": lambda: mc.all_reduce(t[:40_000] if rank == 0 else t[8:40_008], algorithm="shm"),
        "sizes": lambda: mc.symmetric_empty(1_000_000 if rank == 0 else 10),
    }
    out = outcomes(cases, (CollectiveMismatch, ValueError))
    t.fill_(rank + 1)
    mc.all_reduce(t, algorithm="shm")  # the group still works
    out["after"] = float(t[0]), float(t[-1])
    return out


@pytest.mark.timeout(60)
def test_symmetric_mismatches_are_named_and_the_group_goes_on():
    res = spawn(2, _mismatches, timeout=50, comm_timeout=20, transport="shm")
    for r in res:
        assert "CollectiveMismatch" in r["plain-vs-symmetric"] and "symmetric_offset=0" in r["plain-vs-symmetric"]
        assert "symmetric_offset=0" in r["offsets"] and "symmetric_offset=32" in r["offsets"], r["offsets"]
        assert r["sizes"].startswith("ValueError") and "same numel and dtype" in r["sizes"], r["sizes"]
        assert all(r[k + "_s"] < 5 for k in ("plain-vs-symmetric", "offsets", "sizes"))
        assert r["after"] == (3.0, 3.0)


def test_symmetric_empty_is_a_plain_tensor_off_shm_and_for_bad_sizes():
    import meshtrain.comm as mc

    def fn(rank: int):
        t = mc.symmetric_empty((3, 4), torch.float64)
        t.fill_(rank + 1)
        mc.all_reduce(t)
        try:
            mc.symmetric_empty(-1)
            bad = "no error"
        except ValueError as exc:
            bad = str(exc)
        return t.shape, t.dtype, float(t.sum()), bad

    for shape, dtype, total, bad in mc.run_local(2, fn):
        assert shape == (3, 4) and dtype == torch.float64 and total == 36.0
        assert "invalid size -1" in bad


def _ddp(rank: int) -> dict:
    import meshtrain.comm as mc
    from meshtrain.parallel.data import DataParallel

    taken = _count_in_place()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 8))
    ddp = DataParallel(model, bucket_cap_mb=0.05, first_bucket_mb=0.05)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    ddp(x).square().mean().backward()
    t = mc.current().transport
    symmetric = [t.symmetric.find(b.buffer, list(range(mc.get_world_size()))) is not None for b in ddp.buckets]
    return {"symmetric": symmetric, "in_place": taken[0], "grads": [p.grad.clone() for p in model.parameters()]}


def test_ddp_buckets_are_symmetric_on_shm_and_gradients_match_the_global_batch():
    res = spawn(2, _ddp, timeout=60, comm_timeout=30, transport="shm")
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 8))
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    (sum(ref(x).square().mean() for x in xs) / 2).backward()
    for r in res:
        assert len(r["symmetric"]) >= 2 and all(r["symmetric"])
        assert r["in_place"] >= 1  # the 76.8 KB bucket of the first weight (above SMALL_BYTES)
        for g, p in zip(r["grads"], ref.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def _short_of_space(rank: int) -> dict:
    import warnings

    import meshtrain.comm as mc
    from meshtrain.comm.transport import shm_memory

    if rank == 1:  # one member sees a nearly full /dev/shm: every member must fall back
        shm_memory.free_bytes = lambda: 1 << 20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = mc.symmetric_empty(100_000)
    t.fill_(rank + 1)
    mc.all_reduce(t)
    found = mc.current().transport.symmetric.find(t, [0, 1])
    return {"found": found is not None, "warned": [str(w.message) for w in caught], "sum": float(t[0])}


def test_symmetric_empty_falls_back_together_when_dev_shm_is_short():
    for r in spawn(2, _short_of_space, timeout=60, comm_timeout=20, transport="shm"):
        assert not r["found"] and r["sum"] == 3.0
        assert any("1048576 bytes free" in w and "--shm-size" in w for w in r["warned"]), r["warned"]


def test_a_full_dev_shm_fails_at_creation_with_a_message_and_no_file(monkeypatch, tmp_path):
    import errno
    import os

    from meshtrain.comm.transport import shm_memory

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm_memory, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    with pytest.raises(OSError, match="is full: no room for the 65536 bytes") as info:
        shm_memory.Segment.create("meshtrain.1.test", 1 << 16)
    assert "--shm-size" in str(info.value)
    assert os.listdir(tmp_path) == []
