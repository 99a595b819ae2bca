"""Predictions of published runs (torchtitan, Megatron-LM) against the published numbers: the
validation bar is +-20% with the cluster presets' one set of constants. Runs the model misses are
strict xfails naming why, so a fix that brings them in turns the suite red until the mark goes."""

import pytest

from meshtrain.plan.published import RUNS, check

MISSES = {
    "Megatron GPT-3 177B, 4608 H100 (strong scaling)": "predicted -23%: without interleaving (Megatron's "
                                                       "default; the README does not say) 1F1B at m=12, pp=6 "
                                                       "idles (pp-1)/(m+pp-1) = 29% of the step",
}


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_prediction_within_20_percent_of_published(run, request):
    if run.name in MISSES:
        request.applymarker(pytest.mark.xfail(reason=MISSES[run.name], strict=True))
    row = check(run, with_search=False)
    assert row["fits"], f"{run.name}: the published layout is predicted not to fit ({row['memory_gib']:.0f} GiB)"
    assert abs(row["error"]) <= 0.20, f"{run.name}: predicted {row['predicted']:.4g} vs {run.value:.4g}"
