"""A published training run the planner is validated against, and how one is checked.

Each ``PublishedRun`` carries its source (file and commit, or URL), its layout as the source states
it, what the source leaves unstated (``unstated``: listed, with the value priced), and its ``role``:
"fit" rows informed a constant (named in docs/plan.md), "check" rows did not and are the validation.
Nothing is fitted per row: every prediction uses the cluster presets' one set of constants.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .architectures import Arch, resolve_model
from .clusters import resolve_cluster
from .layout import parse_layout
from .search import search
from .step import Prediction, predict

BAR_MEDIAN = 0.10
"""The step-time bar over the check rows: median absolute error at most 10 %."""
BAR_WORST = 0.25
"""... and the worst at most 25 %."""
BAR_MEMORY = 0.10
"""The memory bar: the median absolute peak-memory error over the check rows that publish memory."""


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement and the setup it was taken under."""

    name: str
    model: str
    cluster: str
    gpus: int
    layout: str
    global_batch: int
    seq: int
    metric: str
    """"tokens_per_s_per_gpu", "mfu" or "megatron_tflops" (``METRICS``)."""
    value: float
    source: str
    """Where the number is: repository, file and commit, or a URL."""
    role: str = "check"
    """"fit": a constant was set with this row in view; "check": held out, the validation."""
    compile: bool = False
    memory_gib: float | None = None
    """Published peak memory per GPU (GiB), where given (torchtitan: the allocator's reserved peak)."""
    assumed: str = ""
    """What the source leaves unstated, with the value priced (or "not modelled")."""
    memory_comparable: bool = True
    """False where the framework keeps a different set of states than meshtrain (Megatron's bf16
    weights and gradients with a sharded fp32 optimizer, its sequence-parallel shards re-gathered in
    backward, FP8-saved activations), so a "does not fit" of meshtrain's memory model says nothing
    about the published run."""


METRICS = ("tokens_per_s_per_gpu", "mfu", "megatron_tflops")
"""What a published row may report (``metric_of`` predicts each)."""


def megatron_flops_per_token(arch: Arch, seq: int) -> float:
    """FLOPs a token costs as Megatron-LM counts them with full activation recomputation (Narayanan et al.,
    arXiv 2104.04473, equation 3: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) an iteration, divided by B·s):
    a GPT block's forward counted four times (forward, recomputation, backward twice), all s keys of
    every query, the logits' three."""
    l, h, v = arch.n_layers, arch.dim, arch.vocab_size
    return 96.0 * l * h * h * (1.0 + seq / (6.0 * h) + v / (16.0 * l * h))


def metric_of(pred: Prediction, metric: str, arch: Arch | None = None, seq: int = 0) -> float:
    """The predicted value of a published metric ("megatron_tflops": TFLOP/s a GPU by Megatron's count,
    which needs the run's ``arch`` and ``seq``; a fixed count a token, whatever the layout recomputes, so
    a throughput)."""
    if metric == "megatron_tflops":
        assert arch is not None and seq, "megatron_tflops needs the run's arch and seq"
        return pred.tokens_per_s_per_gpu * megatron_flops_per_token(arch, seq) / 1e12
    return pred.tokens_per_s_per_gpu if metric == "tokens_per_s_per_gpu" else pred.mfu


def check(run: PublishedRun, with_search: bool = False) -> dict:
    """Predict ``run`` as published, and (``with_search``) the layout ``--search`` ranks first on the
    same model, cluster, GPUs, batch and precision (with the peer's settings the layout names fixed)."""
    arch, cluster = resolve_model(run.model), resolve_cluster(run.cluster)
    layout = parse_layout(run.layout, compile=run.compile)
    pred = predict(arch, cluster, layout, run.global_batch, run.seq)
    value = metric_of(pred, run.metric, arch, run.seq)
    mem = pred.memory.total / 2**30
    row = {"run": run.name, "metric": run.metric, "published": run.value, "predicted": value,
           "error": value / run.value - 1.0, "layout": layout.label(), "memory_gib": mem,
           "published_memory_gib": run.memory_gib, "role": run.role,
           "memory_error": mem / run.memory_gib - 1.0 if run.memory_gib and run.memory_comparable else None,
           "memory_comparable": run.memory_comparable, "fits": pred.fits, "step_time_s": pred.step_time,
           "parts_s": pred.parts, "source": run.source, "assumed": run.assumed}
    if with_search:
        fixed = {"precision": layout.precision, "compile": run.compile, "attn_kernel": layout.attn_kernel,
                 "overlap_param_gather": layout.overlap_param_gather, "ep_overlap": layout.ep_overlap,
                 "rank_order": layout.rank_order, "uneven": layout.uneven, "cp_allgather": layout.cp_allgather,
                 "fsdp_pp": layout.fsdp_pp, "async_tp": layout.async_tp,
                 "async_tp_backward": layout.async_tp_backward, "kv_repeat": layout.kv_repeat,
                 "p2p_overlap": layout.p2p_overlap}
        best = search(arch, cluster, run.gpus, run.global_batch, run.seq, fixed=fixed, top=1)[0]
        row.update(search_layout=best.layout.label(), search_value=metric_of(best, run.metric, arch, run.seq),
                   search_fits=best.fits, search_at_least_published=best.step_time <= pred.step_time * (1 + 1e-9))
    return row


def summary(rows: list[dict]) -> dict:
    """Median and worst absolute step-time error of the check rows and of the fit rows, the check rows'
    memory errors, the counts, and whether the check rows meet the bar (``BAR_*``)."""
    def stats(errors: list[float]) -> dict:
        a = sorted(abs(e) for e in errors)
        return {"n": len(a), "median": statistics.median(a) if a else None, "worst": a[-1] if a else None}

    check_rows = [r for r in rows if r["role"] == "check"]
    out = {"check": stats([r["error"] for r in check_rows]),
           "fit": stats([r["error"] for r in rows if r["role"] == "fit"]),
           "memory_check": stats([r["memory_error"] for r in check_rows if r["memory_error"] is not None]),
           "memory_fit": stats([r["memory_error"] for r in rows
                                if r["role"] == "fit" and r["memory_error"] is not None]),
           "within_20": sum(abs(r["error"]) <= 0.20 for r in check_rows)}
    c, m = out["check"], out["memory_check"]
    out["meets_step_bar"] = bool(c["n"]) and c["median"] <= BAR_MEDIAN and c["worst"] <= BAR_WORST
    out["meets_memory_bar"] = bool(m["n"]) and m["median"] <= BAR_MEMORY
    return out
