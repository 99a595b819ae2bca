"""In-memory replicas of the step state (``meshtrain/train/memory_replica.py``): who sends its copy
to whom, which step a restart takes (the newest one every shard of which survived on some host,
newer than the disk checkpoint), and a restore over ranks as threads whose "hosts" are directories:
the chosen step is committed as an ordinary checkpoint, and with nothing complete (or a newer disk
checkpoint) nothing is written. The end-to-end runs: ``tests/train/test_elastic.py`` (a crash on
threads) and ``tests/hosts/test_elastic_hosts.py`` (a frozen worker and a lost host)."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch

from meshtrain import comm
from meshtrain.train import memory_replica as mr
from meshtrain.train.checkpoint import latest_checkpoint
from meshtrain.train.checkpoint_io import CheckpointReader, FORMAT, VERSION, write_rank_shard

GEN = "g1-w4"


def _report(*holdings: tuple[str, int, list[int]], disk: int = 0) -> dict:
    """One new rank's report: (gen, step, ranks) per holding."""
    return {"disk": disk, "holdings": [{"gen": g, "world": int(g.rsplit("-w", 1)[1]), "step": s, "ranks": r}
                                       for g, s, r in holdings]}


def test_each_host_sends_to_the_next_one_and_one_host_has_no_peer():
    assert mr.ring_partners(["a", "a", "b", "b", "c", "c"]) == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    assert mr.ring_partners(["a", "b", "a", "b"]) == {0: 1, 2: 3, 1: 0, 3: 2}  # hosts by their first rank
    assert mr.ring_partners(["a", "a", "b"]) == {0: 2, 1: 2, 2: 0}  # a host with fewer ranks takes more copies
    assert mr.ring_partners(["a", "a"]) == {}


def test_the_newest_complete_step_is_chosen_and_one_with_a_missing_shard_skipped():
    # host0 kept its ranks 0, 1 and host1's copies of 2, 3; of step 6 only its own (the copies in flight)
    host0 = _report((GEN, 4, [0, 1, 2, 3]), (GEN, 5, [0, 1, 2, 3]), (GEN, 6, [0, 1]), disk=2)
    host2 = _report((GEN, 6, [2]))  # rank 3's shard of step 6 survived nowhere
    assert mr.choose([host0, host0, host2, host2], disk_step=2) == {"gen": GEN, "world": 4, "step": 5}
    # the shards of one step on different hosts add up
    assert mr.choose([host0, _report((GEN, 6, [2, 3]))], 2)["step"] == 6
    # a newer generation wins a tie; an older world's ranks do not complete a newer one's step
    assert mr.choose([_report(("g2-w2", 5, [0, 1]), (GEN, 5, [0, 1, 2, 3]))], 0)["gen"] == "g2-w2"
    assert mr.choose([_report(("g2-w2", 7, [0]), (GEN, 7, [1, 2, 3]))], 0) is None


def test_disk_when_no_replica_is_complete_or_newer_than_the_disk_checkpoint():
    assert mr.choose([_report((GEN, 5, [0, 1, 3]))], 2) is None  # rank 2 lost everywhere
    assert mr.choose([_report((GEN, 5, [0, 1, 2, 3]))], 5) is None  # the disk has it already
    assert mr.choose([_report()], 0) is None  # a fresh host (its /dev/shm went with it)


def test_the_holders_of_a_step_share_the_copying():
    reports = [_report((GEN, 5, [0, 1, 2, 3]))] * 2 + [_report((GEN, 5, [2, 3]))] * 2
    assert mr.holders(reports, {"gen": GEN, "world": 4, "step": 5}) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert mr.holders(reports[:2], {"gen": GEN, "world": 4, "step": 5}) == {0: 0, 1: 1, 2: 0, 3: 1}


def test_a_replica_travels_as_one_buffer_and_only_replica_files_are_accepted(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    write_rank_shard(str(src), 3, [("model/w", torch.arange(4.0), [8], ((4, 8),))], {})
    (src / mr.META).write_text("{}")
    mr.unpack_dir(mr.pack_dir(src), dst)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == {p.name: p.read_bytes() for p in src.iterdir()}
    (src / "evil.pt").write_bytes(b"x")
    with pytest.raises(mr.CheckpointError, match="evil.pt"):
        mr.unpack_dir(mr.pack_dir(src), tmp_path)


def _old_world_replica(host: Path, step: int, rank: int) -> None:
    """What old rank ``rank`` of a 4-rank world kept of ``step``: rows rank of a [4, 2] tensor whose
    values are 10 x step + rank (and rank 0 the metadata)."""
    d = host / mr.replica_dir("run1").name / GEN / f"step-{step:08d}" / f"rank-{rank:05d}"
    d.mkdir(parents=True)
    write_rank_shard(str(d), rank, [("model/w", torch.full((1, 2), 10.0 * step + rank), [4, 2],
                                     ((rank, rank + 1), (0, 2)))], {})
    if rank == 0:
        meta = {"format": FORMAT, "version": VERSION, "step": step, "layout": {"dp": 4}, "axes": {}, "world_size": 4,
                "parallel": {}, "files": {}, "entries": [], "optimizer": None, "extra": {"step": step}}
        (d / mr.META).write_text(json.dumps(meta))


def _restore(tmp_path: Path, disk_step: int = 0) -> list:
    """A new world of 4 threads on 2 "hosts" (base directories host0, host1) restores ``run``."""
    run = tmp_path / "run"
    (run / "elastic").mkdir(parents=True, exist_ok=True)
    (run / mr.ID_FILE).write_text("run1")
    if disk_step:
        (run / "checkpoints" / f"step-{disk_step:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{disk_step:08d}" / "metadata.json").write_text("{}")

    def rank_fn(rank: int) -> tuple:
        model = types.SimpleNamespace(mesh=types.SimpleNamespace(comm=comm.current()))
        keeper = mr.MemoryReplicas(run, run / "checkpoints", 1, model, base=str(tmp_path / f"host{rank // 2}"))
        got = keeper.restore(run / "checkpoints", keep=3)
        return got, keeper.dir.name

    return comm.run_local(4, rank_fn, ranks_per_node=2, timeout=30)


def test_a_restore_commits_the_newest_complete_step_as_a_checkpoint(tmp_path):
    # host0 survived with step 5 of every rank (its own 0, 1 and host1's copies of 2, 3) and its
    # own part of step 6; host1 is a fresh host (its memory was lost); the disk has step 2
    for step, ranks in ((5, [0, 1, 2, 3]), (6, [0, 1])):
        for r in ranks:
            _old_world_replica(tmp_path / "host0", step, r)
    results = _restore(tmp_path, disk_step=2)
    assert [got for got, _ in results] == [5] * 4
    path = latest_checkpoint(str(tmp_path / "run" / "checkpoints"))
    assert path.endswith("step-00000005")
    with CheckpointReader(path) as reader:  # every old rank's shard, through the usual reader
        assert reader.read("model/w", [(0, 4), (0, 2)]).tolist() == [[50.0 + r] * 2 for r in range(4)]
        assert reader.meta["extra"] == {"step": 5}
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))
    # the old generation is gone from every host once restored
    assert not list((tmp_path / "host0").glob(f"*/{GEN}"))


@pytest.mark.parametrize("case", ["shard-lost", "disk-newer", "damaged"])
def test_a_restore_falls_back_to_disk_and_writes_nothing(tmp_path, case, capsys):
    for r in ([0, 1, 2] if case == "shard-lost" else [0, 1, 2, 3]):  # shard-lost: rank 3's copy survived nowhere
        _old_world_replica(tmp_path / "host0", 5, r)
    if case == "damaged":  # rank 3's sidecar names rank 2's rows: the shards do not tile the tensor
        side = next((tmp_path / "host0").glob("*/*/step-00000005/rank-00003/rank-00003.json"))
        side.write_text(side.read_text().replace("[[3, 4]", "[[2, 3]"))
    results = _restore(tmp_path, disk_step=5 if case == "disk-newer" else 2)
    if case == "damaged":
        assert "in-memory replicas of step 5 could not be used" in capsys.readouterr().err
    assert [got for got, _ in results] == [None] * 4
    names = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    assert names == ["step-00000005" if case == "disk-newer" else "step-00000002"]
    assert not list((tmp_path / "host0").glob(f"*/{GEN}"))
