"""this-host's measured compute: the profiled block has the shapes one rank runs, the copies run
together in separate processes and report errors, and the optimizer's tensors match the model's."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest

from meshtrain.comm.transport import shm_memory
from meshtrain.config.model import PRESETS
from meshtrain.models.llama import Llama
from meshtrain.plan import corun
from meshtrain.plan.architectures import from_llama_config
from meshtrain.plan.profile import block_seconds, head_seconds, optimizer_seconds, stage_tensor_sizes, threads_per_rank


def test_copies_run_in_their_own_processes_and_report_errors():
    pids = corun.together(2, os.getpid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    with pytest.raises(RuntimeError, match="ValueError"):
        corun.together(2, int, "not a number")
    assert corun.together(2, math.sqrt, 16.0) == [4.0, 4.0]  # the set survives an error
    with pytest.raises(RuntimeError, match=r"a profiling process ended \(exit code 3\) before it could finish"):
        corun.together(2, os._exit, 3)  # a copy that dies is named, and the set is stopped ...
    assert corun.together(2, abs, -2) == [2, 2]  # ... and started afresh on the next use
    corun.stop(2)


def test_optimizer_tensors_are_the_models_parameters():
    cfg = replace(PRESETS["test"], vocab_size=512)
    arch = from_llama_config("test", cfg)
    sizes = sorted(p.numel() for p in Llama(cfg).parameters())
    assert sorted(stage_tensor_sizes(arch, 1, cfg.n_layers, 1, 0)) == sizes
    # ZeRO: one flat shard per block and one for the rest, each 1/shard
    assert sum(stage_tensor_sizes(arch, 1, cfg.n_layers, 2, 1)) == pytest.approx(sum(sizes) / 2, abs=4)


def test_profiles_are_positive_and_cached():
    arch = from_llama_config("test", replace(PRESETS["test"], vocab_size=512))
    f, b = block_seconds(arch, 2, 32, 1)
    assert 0 < f < 1 and 0 < b < 1
    assert block_seconds(arch, 2, 32, 1) == (f, b)  # measured once per shape
    assert all(0 < t < 1 for t in head_seconds(arch, 1, 64, 1))
    assert 0 < optimizer_seconds((1000, 10), 1) < 1
    assert threads_per_rank(1) == os.cpu_count() and threads_per_rank(10_000) == 1


def test_parallel_block_runs_meshtrains_tp_block_in_the_layouts_ranks_and_leaves_nothing():
    from meshtrain.plan.profile_parallel import collective_latency, measures_collectives, parallel_block_seconds

    assert measures_collectives(2, 1, 1, 0) and measures_collectives(1, 2, 2, 0) and measures_collectives(1, 1, 2, 3)
    assert not measures_collectives(1, 1, 2, 1) and not measures_collectives(1, 1, 1, 3)
    arch = from_llama_config("test", replace(PRESETS["test"], vocab_size=512))
    # tp=2 with sequence parallelism; then dp=2 ZeRO-3 on the same two copies (one communicator)
    f, b = parallel_block_seconds(arch, (1, 1, 1, 1, 2), True, False, 2, 32, 1)
    assert 0 < f < 1 and 0 < b < 1
    assert all(0 < t < 1 for t in parallel_block_seconds(arch, (2, 1, 1, 1, 1), False, True, 2, 32, 1))
    assert 0 < collective_latency(2, 1) < 0.1
    pids = corun.together(2, os.getpid)  # /dev/shm is shared with other tests: only the copies' segments
    corun.stop(2)
    assert shm_memory.segments_of(pids) == []  # the copies closed their shared memory on the way out


def test_runtime_memory_falls_back_to_the_import_floor_when_its_run_fails(monkeypatch, tmp_path):
    from meshtrain.plan import bench, host

    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path))

    def broken(*args, **kwargs):
        raise RuntimeError("meshtrain train failed (1): no room")

    monkeypatch.setattr(bench, "measure", broken)
    with pytest.warns(RuntimeWarning, match="no room"):
        value = host.measure_runtime_memory()
    # an interpreter that has imported torch holds well over 100 MiB, and nothing was cached
    assert value > 100 * 2**20
    assert not (tmp_path / "runtime_memory.json").exists()
