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
        if not key.startswith("tune/"):  # auto's online selection agrees once per slot (comm/tune.py)
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


def _mismatch_apart(rank: int, odd: int, late: str, op: str) -> tuple[str, int]:
    import time

    import meshtrain.comm as mc
    from meshtrain.comm import check_board

    entered = []  # torch ops this rank waited for ahead of a peer's post
    real = check_board.Ahead.wait
    check_board.Ahead.wait = lambda self, work, nbytes=0, future=None: (entered.append(1), real(self, work, nbytes, future))[1]
    p = mc.get_world_size()
    mc.all_reduce(torch.ones(2))  # the board is built
    entered.clear()
    n = 6 if rank == odd else 4
    # the ranks that arrive first post and enter torch's op at once; the late ones find the
    # difference on the board and never enter it, and the early ones stop waiting for it
    if (late == "odd") == (rank == odd):
        time.sleep(0.5)
    try:
        if op == "all_reduce":
            mc.all_reduce(torch.ones(n), algorithm="native")
        else:
            mc.all_gather_into_tensor(torch.empty(n * p), torch.ones(n), algorithm="native")
    except CollectiveMismatch as exc:
        return str(exc), len(entered)
    return "no error", len(entered)


@pytest.mark.parametrize("p, late, op", [(2, "odd", "all_reduce"), (2, "others", "all_gather"),
                                         (3, "odd", "all_gather"), (3, "others", "all_reduce")])
def test_a_mismatch_is_named_on_every_rank_whichever_ranks_entered_torchs_op_first(p, late, op):
    import re

    got = spawn(p, _mismatch_apart, 1, late, op, timeout=120, comm_timeout=20)
    for rank, (msg, entered) in enumerate(got):  # none was aborted inside gloo: spawn would raise
        assert re.search(r"ranks disagree.*ranks \[1\]: \w+ shapes=\[\[6\]\]", msg), msg
        early = (rank == 1) != (late == "odd")
        assert entered == (1 if early else 0), (rank, entered)  # the early ranks were inside torch's op


def _one_never_calls(rank: int) -> str:
    import time

    import meshtrain.comm as mc
    from meshtrain.errors import CollectiveTimeout

    mc.all_reduce(torch.ones(2))
    if rank == 1:
        time.sleep(4)  # alive, but never calls the next collective
        return ""
    t0 = time.monotonic()
    try:
        mc.all_reduce(torch.ones(2))  # torch's own op, entered before rank 1 posted
    except CollectiveTimeout as exc:
        return f"{time.monotonic() - t0:.1f} {exc}"
    return "no error"


def test_a_rank_that_never_calls_is_named_when_the_others_entered_torchs_op():
    got = spawn(2, _one_never_calls, timeout=60, comm_timeout=2)[0]
    took, msg = got.split(" ", 1)
    assert "rank(s) [1] never called it" in msg, msg
    assert float(took) < 4, got
