"""Pipeline schedules as data: every builder passes the checker, the checker rejects broken schedules
with the ranks and actions named, and the simulator reproduces the textbook bubble and memory."""

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline import (
    SCHEDULES,
    Action,
    ScheduleError,
    bubble_fraction,
    build_schedule,
    check_schedule,
    peak_in_flight,
    simulate,
    theoretical_bubble,
)


def F(mb: int, s: int) -> Action:
    return Action("F", mb, s)


def B(mb: int, s: int) -> Action:
    return Action("B", mb, s)


def _cases(name: str, pp: int):
    """(m, v) for pp: m in pp..3pp (multiples of pp for interleaved, with v in 2..3)."""
    if name == "interleaved":
        return [(m, v) for m in range(pp, 3 * pp + 1, pp) for v in (2, 3)]
    return [(m, 1) for m in range(pp, 3 * pp + 1)]


# ------------------------------------------------------------------------------ builders pass checks

@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_complete_owned_deadlock_free_and_has_the_textbook_bubble(name, pp):
    for m, v in _cases(name, pp):
        sched = build_schedule(name, pp, m, v)
        check_schedule(sched, pp, m, v)  # raises on any missing/duplicate/foreign/deadlocking action
        assert [len(acts) for acts in sched] == [2 * m * v] * pp
        assert all(a.stage % pp == r for r, acts in enumerate(sched) for a in acts)
        # With F=1, B=2 the fill/drain lasts exactly p-1 slots: the classic formula holds exactly,
        # for interleaved too (Megatron's warmup keeps every chunk fed).
        assert bubble_fraction(simulate(sched, 1.0, 2.0)) == pytest.approx(theoretical_bubble(name, pp, m, v),
                                                                           abs=1e-9)


@given(name=st.sampled_from(SCHEDULES), pp=st.integers(1, 6), groups=st.integers(1, 3), extra=st.integers(0, 5),
       v=st.integers(2, 4), f=st.floats(0.1, 5.0), b=st.floats(0.1, 5.0))
def test_simulated_bubble_matches_theory_for_any_uniform_costs(name, pp, groups, extra, v, f, b):
    m = pp * groups if name == "interleaved" else pp + extra
    v = v if name == "interleaved" else 1
    timeline = simulate(build_schedule(name, pp, m, v), f, b)
    assert bubble_fraction(timeline) == pytest.approx(theoretical_bubble(name, pp, m, v), abs=1e-9)
    # each rank's actions run in list order without overlapping
    for acts in timeline:
        assert all(e0 <= s1 + 1e-12 for (_, _, e0), (_, s1, _) in zip(acts, acts[1:]))


def test_1f1b_warms_up_pp_minus_1_minus_r_forwards_then_alternates():
    pp, m = 4, 6
    for r, acts in enumerate(build_schedule("1f1b", pp, m)):
        kinds = "".join(a.kind for a in acts)
        warm = pp - 1 - r
        assert kinds == "F" * warm + "FB" * (m - warm) + "B" * warm
        assert [a.microbatch for a in acts if a.kind == "F"] == list(range(m))
        assert [a.microbatch for a in acts if a.kind == "B"] == list(range(m))


def test_interleaved_follows_megatron_order():
    # pp=2, m=4, v=2, rank 0 owns stages 0 (chunk 0) and 2 (chunk 1). Warmup = (2-0-1)*2 + (2-1)*2 = 4
    # forwards: micro-batches go through chunk 0 in groups of pp, then the same group through chunk 1.
    # Backwards visit the chunks in reverse (chunk 1 first).
    rank0 = build_schedule("interleaved", 2, 4, 2)[0]
    assert rank0 == [F(0, 0), F(1, 0), F(0, 2), F(1, 2),
                     F(2, 0), B(0, 2), F(3, 0), B(1, 2), F(2, 2), B(0, 0), F(3, 2), B(1, 0),
                     B(2, 2), B(3, 2), B(2, 0), B(3, 0)]


def test_interleaved_with_one_chunk_is_1f1b():
    assert build_schedule("interleaved", 4, 8, 1) == build_schedule("1f1b", 4, 8)


# --------------------------------------------------------------------------------- checker rejects

def test_deadlock_names_each_blocked_rank_and_what_it_waits_on():
    # rank 1 wants micro-batch 1 first, but rank 0 sends it only after B(0, 0), which needs rank 1's B(0, 1).
    sched = [[F(0, 0), B(0, 0), F(1, 0), B(1, 0)],
             [F(1, 1), F(0, 1), B(0, 1), B(1, 1)]]
    with pytest.raises(ScheduleError) as e:
        check_schedule(sched, pp=2, microbatches=2)
    msg = str(e.value)
    assert "deadlock" in msg and "blocked ranks: 0, 1" in msg
    assert "rank 0 blocked at action #1 B(mb=0, stage=0), waiting for B(mb=0, stage=1)" in msg
    assert "rank 1 blocked at action #0 F(mb=1, stage=1), waiting for F(mb=1, stage=0)" in msg


def test_backward_before_its_forward_deadlocks():
    sched = [[F(0, 0), B(0, 0)], [B(0, 1), F(0, 1)]]
    with pytest.raises(ScheduleError, match=r"rank 1 blocked at action #0 B\(mb=0, stage=1\), waiting for "
                                            r"F\(mb=0, stage=1\)"):
        check_schedule(sched, pp=2, microbatches=1)


def test_missing_action_is_named():
    sched = build_schedule("1f1b", 3, 4)
    sched[2].remove(B(3, 2))
    with pytest.raises(ScheduleError, match=r"lacks 1 action\(s\), e\.g\. B\(mb=3, stage=2\)"):
        check_schedule(sched, 3, 4)


def test_duplicated_action_is_named():
    sched = build_schedule("afab", 2, 3)
    sched[1].insert(3, F(1, 1))
    with pytest.raises(ScheduleError, match=r"repeats 1 action\(s\), e\.g\. F\(mb=1, stage=1\)"):
        check_schedule(sched, 2, 3)


def test_action_on_a_stage_the_rank_does_not_own():
    sched = build_schedule("interleaved", 2, 2, 2)
    moved = sched[0].pop(0)  # stage 0 belongs to rank 0
    sched[1].insert(0, moved)
    with pytest.raises(ScheduleError, match=r"rank 1 action #0 F\(mb=0, stage=0\): stage 0 belongs to rank 0"):
        check_schedule(sched, 2, 2, 2)


@pytest.mark.parametrize("sched, pp, m, v, needle", [
    ([[F(0, 0), B(0, 0)]], 2, 1, 1, "1 rank lists but pp=2"),
    ([[F(0, 0), B(5, 0)]], 1, 1, 1, "micro-batch out of range 0..0"),
    ([[F(0, 0), B(0, 4)]], 1, 1, 2, "stage out of range 0..1"),
    ([[Action("W", 0, 0)]], 1, 1, 1, "kind 'W'"),
])
def test_out_of_range_actions_are_rejected(sched, pp, m, v, needle):
    with pytest.raises(ScheduleError, match=needle):
        check_schedule(sched, pp, m, v)


def test_simulate_names_a_dependency_no_rank_schedules():
    with pytest.raises(ScheduleError, match=r"waiting for F\(mb=0, stage=0\) \(which no rank schedules\)"):
        simulate([[B(0, 0)], [F(0, 1), B(0, 1)]])


# ------------------------------------------------------------------------------- memory and bubble

@pytest.mark.parametrize("pp, m", [(1, 1), (2, 2), (4, 4), (4, 9), (8, 16)])
def test_peak_in_flight_1f1b_is_pp_minus_r_and_afab_is_m(pp, m):
    assert [peak_in_flight(acts) for acts in build_schedule("1f1b", pp, m)] == [pp - r for r in range(pp)]
    assert [peak_in_flight(acts) for acts in build_schedule("afab", pp, m)] == [m] * pp


@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 3, 2)])
def test_peak_in_flight_interleaved_is_warmup_plus_one(pp, m, v):
    peaks = [peak_in_flight(acts) for acts in build_schedule("interleaved", pp, m, v)]
    assert peaks == [min((pp - r - 1) * 2 + (v - 1) * pp + 1, m * v) for r in range(pp)]


def test_peak_in_flight_counts_a_hand_made_list():
    assert peak_in_flight([F(0, 0), F(1, 0), B(0, 0), F(2, 0), F(3, 0), B(1, 0), B(2, 0), B(3, 0)]) == 3
    assert peak_in_flight([]) == 0


def test_theoretical_bubble_formulas():
    assert theoretical_bubble("afab", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert theoretical_bubble("1f1b", 1, 5) == 0.0


def test_bubble_fraction_of_a_hand_made_timeline():
    # rank 0 busy 0..3, rank 1 busy 1..2: makespan 3, busy 4 of 6 -> 1/3 idle
    timeline = [[(F(0, 0), 0.0, 1.0), (B(0, 0), 1.0, 3.0)], [(F(0, 1), 1.0, 2.0)]]
    assert bubble_fraction(timeline) == pytest.approx(1 / 3)
    shifted = [[(a, s + 100.0, e + 100.0) for a, s, e in acts] for acts in timeline]
    assert bubble_fraction(shifted) == pytest.approx(1 / 3)  # measured traces start at wall-clock time
    assert bubble_fraction([[], []]) == 0.0


def test_afab_start_times_follow_the_pipeline():
    timeline = simulate(build_schedule("afab", 3, 2), f_time=1.0, b_time=2.0)
    starts = {a: s for acts in timeline for a, s, _ in acts}
    assert [starts[F(0, s)] for s in range(3)] == [0.0, 1.0, 2.0]
    assert starts[B(0, 2)] == 4.0  # after F(1, 2) on the last rank
    assert [starts[B(0, s)] for s in (1, 0)] == [6.0, 8.0]


# --------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, needle", [
    (("gpipe", 4, 8, 1), "unknown pipeline schedule 'gpipe': choose one of afab, 1f1b, interleaved"),
    (("1f1b", 0, 8, 1), "pp (pipeline stages) must be >= 1, got 0"),
    (("afab", 2, 0, 1), "microbatches must be >= 1, got 0"),
    (("1f1b", 4, 3, 1), "fewer micro-batches (m=3) than pipeline stages (pp=4) for 1F1B; "
                        "use at least pp micro-batches (parallel.microbatches >= 4) or the afab schedule"),
    (("interleaved", 4, 6, 2), "needs microbatches divisible by pp (Megatron requires it), got m=6, pp=4; "
                               "use a multiple of 4, e.g. 8"),
    (("afab", 2, 4, 2), "the afab schedule has one model chunk per rank (virtual=1), got virtual=2"),
    (("1f1b", 2, 4, 3), "the 1f1b schedule has one model chunk per rank (virtual=1), got virtual=3"),
    (("interleaved", 2, 4, 0), "virtual (model chunks per rank) must be >= 1, got 0"),
    (("afab", 2.5, 4, 1), "pp must be an integer, got 2.5"),
])
def test_bad_parameters_raise_a_config_error_that_says_the_fix(args, needle):
    for fn in (build_schedule, theoretical_bubble):
        with pytest.raises(ScheduleError) as e:
            fn(*args)
        assert needle in str(e.value)
        assert isinstance(e.value, ConfigError)


def test_afab_accepts_fewer_microbatches_than_stages():
    sched = build_schedule("afab", 4, 2)
    check_schedule(sched, 4, 2)
    assert Counter(a.kind for acts in sched for a in acts) == {"F": 8, "B": 8}
