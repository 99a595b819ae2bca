"""Online selection for algorithm="auto" (comm/tune.py): every member keeps the same choice even
when their own timings disagree, exploring calls return correct results, a drifted choice is
probed again, choices persist per host fingerprint, and bad settings are named."""

from __future__ import annotations

import pytest
import torch

import meshtrain.comm as mc
from meshtrain.comm import select, tune
from meshtrain.comm.launch import spawn

pytestmark = pytest.mark.timeout(120)

NBYTES = 1 << 16


def _skewed_record(monkeypatch, factor, fixed: float | None = None):
    """Scale each recorded time by ``factor(rank, algorithm)``: the rank is this thread's. With
    ``fixed``, the time recorded is ``fixed`` seconds times the factor, whatever the call took: the
    choice then follows the skew alone, not the algorithms' real times on a loaded host."""
    real = tune.Tuner.record

    def record(pending, algorithm, seconds):
        real(pending, algorithm, (seconds if fixed is None else fixed) * factor(mc.get_rank(), algorithm))

    monkeypatch.setattr(tune.Tuner, "record", staticmethod(record))


def _calls(rank: int, n: int, p: int, numel: int = NBYTES // 4) -> list[str]:
    """``n`` auto all-reduces of random data, each checked against the sum computed here; the
    algorithm each ran (from the flight recorder)."""
    comm = mc.current()
    comm.tune = True
    for i in range(n):
        gen = [torch.Generator().manual_seed(1000 * i + r) for r in range(p)]
        xs = [torch.randn(numel, generator=g_) for g_ in gen]
        x = xs[rank].clone()
        mc.all_reduce(x)
        torch.testing.assert_close(x, torch.stack(xs).sum(0), rtol=1e-5, atol=1e-5)
    return [r["algorithm"] for r in comm.monitor.records() if r["op"] == "all_reduce"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """A calibration cache of the test's own: choices kept here must not reach other tests, nor
    other tests' choices this one (a cached choice is kept without exploring)."""
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))


def test_members_keep_one_choice_when_their_own_timings_disagree(monkeypatch):
    """Rank r's clock makes candidate r mod 3 fastest (the static choice on ranks 0 and 3), so a
    member deciding from its own timings alone would differ from the others; they must all keep the
    same one, the least mean over members, computed here from what each recorded. (The static
    choice wins by a margin: a win over it would be verified in a second pass, whose times would
    replace these.)"""
    p = 4
    cands: dict[int, list[str]] = {}

    def factor(rank, algo):
        order = cands.get(rank)
        return 0.05 if order and order[rank % 3] == algo else 1.0

    # fixed times: with real ones, a candidate whose own calls ran a third faster on a busy host beat
    # the static choice's margin, and its verification pass left two candidates timed
    _skewed_record(monkeypatch, factor, fixed=1e-3)

    def fn(rank):
        g = mc.current().world
        cands[rank] = select.candidates(g, "all_reduce", NBYTES, True, select.choose(g, "all_reduce", NBYTES))
        algos = _calls(rank, 64, p)
        (slot,) = g.tuner.slots.values()
        return algos, slot.choice, dict(slot.agreed), {c: list(t) for c, t in slot.times.items()}, cands[rank][0]

    out = mc.run_local(p, fn, timeout=60)
    k = len(out[0][3])
    assert k >= 3, f"expected several candidates on {p} thread ranks, got {list(out[0][3])}"
    choices = {o[1] for o in out}
    assert len(choices) == 1, f"members kept different algorithms: {choices}"
    assert len({tuple(o[0]) for o in out}) == 1, "members ran different algorithms on the same call"
    def typical(ts):  # the mean without the slowest call, computed here
        ts = sorted(ts)[:-1]
        return sum(ts) / len(ts)

    mean = {c: sum(typical(o[3][c]) for o in out) / p for c in out[0][3]}
    best = min(mean, key=mean.get)
    static = out[0][4]
    kept = next((k for k in (static, "native") if k in mean and mean[k] <= mean[best] * (1 + tune.PRIOR)), best)
    assert out[0][1] == kept
    assert out[0][2] == pytest.approx(mean)
    locals_best = {min(o[3], key=lambda c, o=o: typical(o[3][c])) for o in out}
    assert len(locals_best) > 1, "the skew should have made members' own picks differ"
    rounds = tune.ROUNDS_SMALL if NBYTES < tune.SMALL else tune.ROUNDS
    explored = out[0][0][: rounds * k * tune.BLOCK]
    assert [explored.count(c) for c in out[0][3]] == [rounds * tune.BLOCK] * k, "each candidate ran its blocks"
    assert set(out[0][0][rounds * k * tune.BLOCK:]) == {out[0][1]}, "after exploring, only the choice runs"


@pytest.fixture
def saved(monkeypatch):
    """The tuner's cache off disk, for tests of a bare Tuner: nothing is loaded; the list of the
    algorithms it saves, in order."""
    entries: list[str] = []
    monkeypatch.setattr(tune, "_table_key", lambda group: "test")
    monkeypatch.setattr(tune, "_save_entry", lambda key, name, entry: entries.append(entry["algorithm"]))
    monkeypatch.setattr(tune, "_load_table", lambda key: None)
    return entries


class _OneMember:
    """The group a Tuner reads, of one member: its exchange returns the member's own post."""

    gid, ranks, rank, size, timeout = 0, [0], 0, 1, 5.0

    class comm:
        preferred_algorithm = None

        class transport:
            @staticmethod
            def exchange(key, ranks, payload, timeout):
                return [payload]


def test_a_tail_the_median_hides_decides_and_native_wins_ties(saved):
    """``typical`` is the mean of a candidate's calls but the slowest: a candidate fast on most calls
    and stalled on a third of them loses to a steady one (its median would have won); a candidate
    within PRIOR of torch's own does not replace it, and one beyond it must win a second pass."""
    fast_median = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 9.0, 9.0]
    steady = [2.0] * 9
    assert sorted(fast_median)[4] < sorted(steady)[4] and tune.typical(fast_median) > tune.typical(steady)
    assert tune.typical([1.0, 1.0, 100.0]) == 1.0 and tune.typical([3.0, 5.0]) == 4.0

    key = ("all_reduce", "float32", 12, None)
    t = tune.Tuner(_OneMember())
    t.cached = {}
    slot = tune.Slot(["tree", "native", "ring"])  # static choice first
    slot.times = {"tree": [2.0] * 3, "native": [1.04] * 3, "ring": [1.0] * 3}
    t._decide(key, slot)
    assert slot.choice == "native" and slot.period == tune.CHECK_EVERY  # within PRIOR of the best: kept
    # ring beats native by more than PRIOR: verified by a second pass of the two before it is kept
    for second, kept in (([1.0] * 3, "native"), ([0.9] * 3, "ring")):
        slot = tune.Slot(["tree", "native", "ring"])
        slot.times = {"tree": [2.0] * 3, "native": [1.10] * 3, "ring": [1.0] * 3}
        t._decide(key, slot)
        assert slot.choice is None and slot.candidates == ["native", "ring"] and slot.calls == 0
        slot.times = {"native": [1.0] * 3, "ring": second}
        t._decide(key, slot)
        assert slot.choice == kept and slot.candidates == ["tree", "native", "ring"]
        assert slot.period == (tune.CHECK_EVERY if kept == "native" else tune.CHECK_FIRST)  # own: checked soon
    assert saved == ["native", "native", "ring"]
    # without torch's own among the candidates (shm), the static choice is the peer: a win over it is
    # verified too, and then on probation against it
    slot = tune.Slot(["shm", "ring", "direct"])
    assert slot.peer == "shm"
    slot.times = {"shm": [2.0] * 3, "ring": [1.0] * 3, "direct": [3.0] * 3}
    t._decide(key, slot)
    assert slot.choice is None and slot.candidates == ["shm", "ring"]
    slot.times = {"shm": [2.0] * 3, "ring": [1.0] * 3}
    t._decide(key, slot)
    assert slot.choice == "ring" and slot.on_probation() and slot.period == tune.CHECK_FIRST


def test_the_call_path_verifies_a_win_over_native_then_keeps_it(saved):
    """pick(): torch's own untimed first (its wait mode learned before it is timed), the candidates'
    blocks, then blocks of torch's own and the winner only, then the winner alone (one member; times
    recorded as the runner would)."""
    t = tune.Tuner(_OneMember())
    seconds = {"tree": 3.0, "native": 2.0, "ring": 1.0}
    ran, timed = [], []
    for _ in range(150 + tune.WARM):
        algo = t.pick("all_reduce", 4096, torch.float32, lambda: ["tree", "native", "ring"])
        pending = t.take()
        if pending is not None:
            tune.Tuner.record(pending, algo, seconds[algo])
        ran.append(algo)
        timed.append(pending is not None)
    warm = tune.WARM
    assert warm >= 2 * 2 * 8 and ran[:warm] == ["native"] * warm and not any(timed[:warm])
    explore = tune.ROUNDS_SMALL * 3 * tune.BLOCK
    verify = tune.VERIFY_ROUNDS * 2 * tune.VERIFY_BLOCK
    assert ran[warm:warm + explore] == (["tree"] * tune.BLOCK + ["native"] * tune.BLOCK + ["ring"] * tune.BLOCK) * \
        tune.ROUNDS_SMALL and all(timed[warm:warm + explore])
    assert ran[warm + explore:warm + explore + verify] == \
        (["native"] * tune.VERIFY_BLOCK + ["ring"] * tune.VERIFY_BLOCK) * tune.VERIFY_ROUNDS  # no warm-up again
    assert set(ran[warm + explore + verify:]) == {"ring"}
    (slot,) = t.slots.values()
    assert slot.candidates == ["tree", "native", "ring"] and slot.source == "measured" and slot.probes == 1


def test_torch_own_warms_up_only_where_its_wait_mode_matters_and_only_once(saved):
    """The untimed calls of torch's own come before a slot's first exploration only: not without it
    among the candidates, not from WARM_MAX_BYTES up, not when a drifted choice is explored again."""

    def first(t, nbytes, cands, n):
        out = []
        for _ in range(n):
            algo = t.pick("all_gather", nbytes, torch.float32, lambda: list(cands))
            pending = t.take()
            if pending is not None:
                tune.Tuner.record(pending, algo, 1.0)
            out.append((algo, pending is not None))
        return out

    t = tune.Tuner(_OneMember())
    assert first(t, 4096, ["ring", "direct"], 2) == [("ring", True), ("ring", True)]  # no torch's own
    assert first(t, tune.WARM_MAX_BYTES, ["native", "ring"], 1) == [("native", True)]  # large: timed at once
    assert first(t, tune.WARM_MAX_BYTES - 4, ["native", "ring"], tune.WARM + 1)[-2:] == [("native", False),
                                                                                        ("native", True)]
    slot = t.slots[("all_gather", torch.float32, (tune.WARM_MAX_BYTES - 4).bit_length(), None)]
    first(t, tune.WARM_MAX_BYTES - 4, ["native", "ring"], 2 * tune.ROUNDS * tune.BLOCK)
    assert slot.choice == "native" and slot.probes == 1
    slot.explore()  # as after a drift: explored again at once, timed
    assert first(t, tune.WARM_MAX_BYTES - 4, ["native", "ring"], 1) == [("native", True)]


def test_a_drifted_choice_is_probed_again(monkeypatch):
    """After the choice is kept, its calls slow down 4x on every member: the next two drift checks
    see it and the slot explores again, this time keeping another candidate."""
    monkeypatch.setattr(tune, "CHECK_EVERY", 30)
    monkeypatch.setattr(tune, "RECENT", 6)
    first: dict[str, str] = {}

    def factor(rank, algo):
        return 4.0 if first.get("choice") == algo else (0.5 if algo == first.get("runner_up") else 1.0)

    _skewed_record(monkeypatch, factor)

    def fn(rank):
        g = mc.current().world
        mc.current().tune = True
        x = torch.ones(NBYTES // 4)
        n = 0
        while g.tuner is None or g.tuner.slots == {} or next(iter(g.tuner.slots.values())).choice is None:
            mc.all_reduce(x)
            n += 1
        slot = next(iter(g.tuner.slots.values()))
        mc.barrier()
        if rank == 0:
            first["choice"] = slot.choice
            first["runner_up"] = sorted(slot.agreed, key=slot.agreed.get)[1]
        mc.barrier()
        probes = [slot.probes]
        for _ in range(8 * tune.CHECK_EVERY):  # the slowdown is seen at two checks, explored, verified
            y = torch.full((NBYTES // 4,), float(rank))
            mc.all_reduce(y)
            assert torch.all(y == 1.0)  # 0 + 1
            probes.append(slot.probes)
        return slot.choice, max(probes), slot.source

    out = mc.run_local(2, fn, timeout=60)
    assert {o[0] for o in out} == {out[0][0]}
    assert all(o[1] >= 2 for o in out), f"no re-probe after the drift: {out}"
    assert out[0][0] != first["choice"], "the slowed choice was kept again"


def _kept(t, choice, agreed):
    """A slot of ``t`` that has just kept ``choice``, measured, at the ``agreed`` times."""
    key = ("all_gather", torch.float32, 17, None)
    slot = t.slots[key] = tune.Slot(["ring", "native", "direct"])
    slot.keep(choice, dict(agreed), "measured")
    return slot


def _run_kept(t, slot, calls, seconds):
    """``calls`` calls through pick(), each timed one recorded at ``seconds[algorithm]`` (or
    ``seconds`` for every algorithm); the algorithms run."""
    ran = []
    for _ in range(calls):
        algo = t.pick("all_gather", 1 << 16, torch.float32, lambda: ["ring", "native", "direct"])
        pending = t.take()
        if pending is not None:
            tune.Tuner.record(pending, algo, seconds[algo] if isinstance(seconds, dict) else seconds)
        ran.append(algo)
    return ran


RACE = tune.VERIFY_SKIP + tune.RECENT  # the peer's calls that race a choice on probation at each check


def test_a_kept_win_over_native_races_it_at_doubling_intervals_and_falls_back_when_it_loses(saved):
    """A measured choice over torch's own is checked CHECK_FIRST calls after it is kept, then after
    twice as many calls each time it holds, up to CHECK_EVERY. Each check races it: RACE calls of
    torch's own back to back, the last RECENT timed. Once the choice runs slower than torch's own
    just ran (beyond PRIOR) -- even where torch's own was measured slower while exploring -- torch's
    own is kept without exploring, the loser leaves the candidates, and the fallback is saved."""
    t = tune.Tuner(_OneMember())
    t.cached = {}
    slot = _kept(t, "ring", {"ring": 1.0, "native": 2.0, "direct": 3.0})
    assert slot.period == tune.CHECK_FIRST
    periods = []
    for _ in range(6):  # holds against torch's own: each check doubles the interval, up to CHECK_EVERY
        period = slot.period
        ran = _run_kept(t, slot, period + RACE + 1, {"ring": 1.0, "native": 1.0})
        assert ran[period:period + RACE] == ["native"] * RACE and ran[-1] == "ring"
        periods.append(slot.period)
    assert periods == [min(tune.CHECK_FIRST * 2 ** (i + 1), tune.CHECK_EVERY) for i in range(6)]
    assert slot.choice == "ring" and slot.probes == 0 and saved == []
    # ring as fast as it was agreed, but torch's own now runs faster than it did while exploring
    ran = _run_kept(t, slot, slot.period + RACE + 1 + 50, {"ring": 1.0, "native": 0.5})
    assert slot.choice == "native" and slot.source == "fallback" and "ring" not in slot.candidates
    assert ran[-50:] == ["native"] * 50 and set(ran) == {"ring", "native"}
    assert slot.agreed["ring"] == pytest.approx(1.0) and slot.agreed["native"] == pytest.approx(0.5)
    assert saved == ["native"] and slot.period == tune.CHECK_EVERY


def test_a_kept_win_over_native_slower_than_agreed_explores_only_once_slower_than_the_next_best(saved):
    """Beyond DRIFT of its own agreed time, but faster than every other candidate was measured: kept.
    Slower than the next best too, at two checks in a row (and not slower than torch's own as it
    races): the usual drift, explored again."""
    t = tune.Tuner(_OneMember())
    t.cached = {}
    slot = _kept(t, "ring", {"ring": 1.0, "native": 4.0, "direct": 3.0})
    for _ in range(3):
        _run_kept(t, slot, slot.period + RACE + 1, {"ring": tune.DRIFT * 1.2, "native": 4.0})
    assert slot.choice == "ring" and not slot.slowed
    for _ in range(2):  # a slowdown is confirmed at the next check
        _run_kept(t, slot, slot.period + RACE + 1, {"ring": 3.5, "native": 4.0})
    assert slot.choice is None and slot.candidates == ["ring", "native", "direct"]  # exploring again


@pytest.mark.parametrize("choice,agreed", [("native", {"ring": 3.0, "native": 2.0}),
                                           ("direct", {"ring": 3.0, "direct": 2.0})])
def test_a_choice_running_faster_than_agreed_lowers_its_time_and_a_slowdown_explores(saved, choice, agreed):
    """A kept choice not on probation (torch's own, or one of meshtrain's where torch's own has no
    measured time) running faster than agreed, even beyond DRIFT, lowers its agreed time and nothing
    explores: its exploring blocks read slower than its calls back to back. Slower beyond DRIFT, but
    not slower than the next best candidate was measured, is kept; slower than both, twice in a row,
    explores."""
    t = tune.Tuner(_OneMember())
    t.cached = {}
    slot = _kept(t, choice, agreed)
    assert slot.period == tune.CHECK_EVERY and not slot.on_probation()
    for _ in range(3):
        ran = _run_kept(t, slot, slot.period + 1, 0.5)
        assert slot.choice == choice and set(ran) == {choice} and slot.agreed[choice] == pytest.approx(0.5)
    assert slot.probes == 0 and slot.agreed["ring"] == 3.0
    _run_kept(t, slot, slot.period + 1, 2.5)  # 5x its time, still faster than ring was measured
    assert slot.choice == choice and not slot.slowed and slot.period == tune.CHECK_EVERY
    slow = 3.5  # beyond DRIFT and beyond ring's 3.0
    _run_kept(t, slot, slot.period + 1, slow)  # one slow window (a spell of the host): confirmed soon
    assert slot.choice == choice and slot.slowed and slot.period == tune.CHECK_FIRST
    _run_kept(t, slot, slot.period + 1, 0.5)  # ... and not confirmed: kept, back to the usual period
    assert slot.choice == choice and not slot.slowed and slot.period == tune.CHECK_EVERY
    _run_kept(t, slot, slot.period + 1, slow)
    ran = _run_kept(t, slot, tune.CHECK_FIRST + 1, slow)  # slower at two checks in a row: explored again
    assert slot.choice is None and ran[:-1] == [choice] * tune.CHECK_FIRST


def _persisted(rank: int) -> tuple[list[str], str, str | None, dict[str, float]]:
    import meshtrain.comm as mc2

    x = torch.ones(NBYTES // 4)
    g = mc2.current().world
    for _ in range(200):  # until a choice is kept (the same call on both ranks), then a few more
        mc2.all_reduce(x, op="avg")
        if tune.settled(g):
            break
    for _ in range(5):
        mc2.all_reduce(x, op="avg")
    assert torch.all(x == 1.0)
    (row,) = g.tuner.explain()
    algos = [r["algorithm"] for r in mc2.current().monitor.records() if r["op"] == "all_reduce"]
    return algos, row["source"], row["choice"], row["agreed_s"]


def test_choices_persist_per_host_and_transport_and_never_lose_to_native(tmp_path, monkeypatch):
    """Two torch-transport processes: the first run explores (torch's own all_reduce among the
    candidates) and keeps a choice no slower than native; a second run loads it from the cache and
    runs only it; on another host (another host id, so another fingerprint) it explores again."""
    monkeypatch.delenv("MESHTRAIN_AUTO_TUNE", raising=False)
    first = spawn(2, _persisted, transport="torch", timeout=90)
    algos, source, choice, agreed = first[0]
    assert source == "measured" and "native" in agreed and len(set(algos)) > 1
    assert agreed[choice] <= agreed["native"]
    again = spawn(2, _persisted, transport="torch", timeout=90)
    for algos2, source2, choice2, _ in again:
        assert (source2, choice2) == ("cache", choice) and set(algos2) == {choice}
    other = spawn(2, _persisted, transport="torch", timeout=90, host_ids=["elsewhere", "elsewhere"])
    assert other[0][1] == "measured", "another host must not take this host's cached choices"


def test_tuning_setting_is_checked_and_off_on_threads_by_default(monkeypatch):
    def fn(rank):
        return tune.enabled(mc.current().world)

    monkeypatch.delenv("MESHTRAIN_AUTO_TUNE", raising=False)
    assert mc.run_local(2, fn) == [False, False]
    monkeypatch.setenv("MESHTRAIN_AUTO_TUNE", "1")
    assert mc.run_local(2, fn) == [True, True]
    monkeypatch.setenv("MESHTRAIN_AUTO_TUNE", "sometimes")
    with pytest.raises(ValueError, match="MESHTRAIN_AUTO_TUNE='sometimes'.*1 .*0"):
        mc.run_local(2, fn)
