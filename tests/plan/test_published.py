"""The planner's own validation set (meshtrain/plan/published*.py): at least 15 published runs from
at least 3 sources, each cited, with fit rows (used to set a constant) kept apart from check rows, and
the bar computed over the check rows: median absolute step-time error <= 10 %, worst <= 25 %, median
memory error <= 10 %. The worst-error bar is missed (the 8B at 256K tokens, a memory-starved 70B, the
smallest and the widest-data-parallel of Megatron's H100 weak-scaling rows): a
strict xfail that names them, so meeting it one day fails loudly and the docs get updated."""

import pytest

from meshtrain.plan.published import BAR_MEDIAN, BAR_MEMORY, BAR_WORST, LEFT_OUT, RUNS, SOURCES, check, summary
from meshtrain.plan.published_run import METRICS


@pytest.fixture(scope="module")
def rows():
    return [check(run) for run in RUNS]


def test_the_set_has_15_runs_from_3_sources_each_cited_with_a_role():
    assert len(RUNS) >= 15 and len([s for s, runs in SOURCES.items() if runs]) >= 3
    assert all(run.source and run.role in ("fit", "check") and run.metric in METRICS for run in RUNS)
    assert len({run.name for run in RUNS}) == len(RUNS)
    assert {run.role for run in RUNS} == {"fit", "check"} and all(run.role == "left out" for run in LEFT_OUT)


def test_check_rows_meet_the_median_bar_and_memory_bar(rows):
    s = summary(rows)
    assert s["check"]["n"] >= 15
    assert s["check"]["median"] <= BAR_MEDIAN, s["check"]
    assert s["memory_check"]["n"] >= 5 and s["memory_check"]["median"] <= BAR_MEMORY, s["memory_check"]
    # the summary is computed from the rows, not typed in
    errors = sorted(abs(r["error"]) for r in rows if r["role"] == "check")
    assert s["check"]["worst"] == errors[-1]


@pytest.mark.xfail(strict=True, reason="missed: MosaicML MPT-70B on 64 A100-40GB (+40%), torchtitan 8B at 256K "
                   "tokens (CP 8, +31%) and Megatron's GPT 1.7B on 48 H100 (+30%) run slower than priced, Megatron's "
                   "GPT 32B on 384 H100 (-26%) faster; docs/plan.md, 'What the misses are'")
def test_check_rows_meet_the_worst_error_bar(rows):
    assert summary(rows)["check"]["worst"] <= BAR_WORST


MISSES = {"MosaicML MPT-70B, 64 A100-40GB, 2048 tokens", "torchtitan 8B FSDP 1 x CP 8, 256K tokens (T2)",
          "Megatron GPT 1.7B, 48 H100 (model table)", "Megatron GPT 32B, 384 H100 (model table)"}
"""The check rows beyond the worst-error bar, as docs/plan.md names them."""


def test_the_rows_beyond_the_bar_are_the_ones_the_docs_name(rows):
    beyond = {r["run"] for r in rows if r["role"] == "check" and abs(r["error"]) > BAR_WORST}
    assert beyond == MISSES


def test_every_memory_comparable_published_layout_is_predicted_to_fit(rows):
    for r in rows:
        assert r["fits"] or not r["memory_comparable"], f"{r['run']}: {r['memory_gib']:.0f} GiB does not fit"


def test_search_first_is_at_least_as_fast_as_published_and_fits():
    run = next(r for r in RUNS if r.name == "torchtitan 8B FSDP 8 GPUs, compile (T1)")
    row = check(run, with_search=True)
    assert row["search_fits"] and row["search_at_least_published"], row["search_layout"]
