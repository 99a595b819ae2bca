"""The metadata check on a shared board (comm/check_board.py) for torch-transport groups whose
ranks share a host: no store round trip per call, slots reused safely past SLOTS calls (also when
calls with the check off leave gaps), and mismatches still named, for torch's own collectives
and meshtrain's algorithms alike."""

from __future__ import annotations

import pytest
import torch

from meshtrain.comm.check_board import SLOTS
from meshtrain.comm.launch import spawn
from meshtrain.errors import CollectiveMismatch

pytestmark = pytest.mark.timeout(180)


def _many_calls(rank: int) -> dict:
    import meshtrain.comm as mc

    comm = mc.current()
    t = comm.transport
    exchanges = []
    real = t.exchange

    def counting(key, *a, **kw):
        exchanges.append(key)
        return real(key, *a, **kw)

    mc.all_reduce(torch.ones(1))  # builds the board (two store exchanges, once)
    t.exchange = counting
    p = mc.get_world_size()
    wrong = 0
    for i in range(3 * SLOTS):
        x = torch.full((5,), float(rank + i))
        mc.all_reduce(x)  # torch's own all_reduce on two ranks (auto), checked on the board
        wrong += not torch.equal(x, torch.full((5,), float(sum(range(p)) + p * i)))
        out = torch.empty(2 * p)
        mc.all_gather_into_tensor(out, torch.full((2,), float(rank)), algorithm="ring")  # meshtrain's own
        wrong += not torch.equal(out, torch.arange(p, dtype=torch.float32).repeat_interleave(2))
        if i % SLOTS == 7:  # a stretch of more than SLOTS calls with the check off posts nothing
            comm.check = False
            for _ in range(SLOTS + 3):
                mc.all_reduce(torch.ones(3))
            comm.check = True
    return {"wrong": wrong, "exchanges": exchanges, "board": comm.groups[0].board is not None}


def test_board_checks_every_call_without_the_store():
    for r in spawn(2, _many_calls, timeout=150):
        assert r["board"], "a torch-transport group on one host checks on a board"
        assert r["wrong"] == 0
        assert r["exchanges"] == [], f"store exchanges during checked calls: {r['exchanges'][:5]}"


def _mismatch_late(rank: int, algo: str) -> None:
    import meshtrain.comm as mc

    for _ in range(SLOTS + 5):  # past the first use of every slot
        mc.all_reduce(torch.ones(4), algorithm=algo)
    mc.all_reduce(torch.ones(4 if rank != 1 else 6), algorithm=algo)


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_mismatch_past_the_slots_is_named_on_the_board(algo):
    with pytest.raises(CollectiveMismatch, match=rf"all_reduce #{SLOTS + 6} .*ranks \[1\]: all_reduce shapes=\[\[6\]\]"):
        spawn(2, _mismatch_late, algo, timeout=120, comm_timeout=20)


def _board_off(rank: int) -> bool:
    import meshtrain.comm as mc

    mc.all_reduce(torch.ones(2))
    return mc.current().groups[0].board is None


def test_board_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CHECK_BOARD", "0")
    assert spawn(2, _board_off, timeout=60) == [True, True]


def _separate_shm(rank: int, tmp: str) -> tuple:
    import meshtrain.comm as mc
    from meshtrain.comm.transport import shm_memory as mem

    if rank == 1:  # one host id, but another /dev/shm (containers sharing a kernel)
        mem.SHM_DIR = tmp
    x = torch.ones(3)
    mc.all_reduce(x)
    board = mc.current().groups[0].board
    try:
        mc.all_reduce(torch.ones(4 if rank != 1 else 6))  # without a board auto keeps the check first
        named = ""
    except CollectiveMismatch as exc:
        named = str(exc)
    return board is None, x.tolist(), named


def test_unmappable_board_falls_back_to_the_store(tmp_path):
    for none, x, named in spawn(2, _separate_shm, str(tmp_path), timeout=60, comm_timeout=20):
        assert none, "no member keeps a board that a peer could not map"
        assert x == [2.0, 2.0, 2.0]
        assert "ranks [1]: all_reduce shapes=[[6]]" in named
