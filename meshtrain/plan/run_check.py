"""A training run's check of the planner: the planner's prediction for the run's own layout beside
what the run measured (``plan_check``, written to summary.json), timed again with the run's blocks
profiled once a CPU run has ended (``profiles_after``, ``profiled_plan_check``), and the run's last
log line (``plan_check_line``). ``step_summary`` reads the measured step from the per-step records,
here and in ``meshtrain bench plan``. The trainer imports this lazily: ``train`` is below ``plan``."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config.check import model_config
from ..config.dims import degrees_of
from ..errors import MeshtrainError
from ..files import write_json_atomic

if TYPE_CHECKING:
    from ..config.model import LlamaConfig


def step_summary(records: list[dict[str, Any]]) -> dict[str, float]:
    """A run's measured step from its per-step records: the median and fastest ``step_s`` after the
    first two steps (warm-up: allocators and caches; the last record if there are no more) and the
    highest ``peak_mem_bytes``. ``meshtrain bench plan`` and the run's own planner check use it."""
    timed = records[2:] or records[-1:]
    return {"step_s": statistics.median(r["step_s"] for r in timed),
            # the fastest step: what the machine does when nothing else runs (the cores are shared)
            "best_step_s": min(r["step_s"] for r in timed),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records)}


PROFILE_AFTER_S = 100.0
"""``train.plan_check = "auto"``: a CPU run that trained this long has its blocks timed after it."""


def plan_check(config: Any, model_cfg: LlamaConfig, device: torch.device,
               records: list[dict[str, Any]], profiled: bool = False) -> dict[str, Any]:
    """The planner's prediction for this run's own layout beside what the run measured, for
    summary.json: ``predicted_step_s`` and ``predicted_peak_mem_bytes`` (null with
    ``prediction_reason`` when no prediction could be made: ``train.plan_check = "off"``, a GPU no
    preset prices, a layout the planner cannot price, no cached host calibration) and
    ``measured_step_s`` / ``measured_peak_mem_bytes`` (``step_summary``). It never raises: a
    finished run is not failed over its prediction. Nothing is measured for it (a CPU host's cached
    calibration) unless ``profiled`` (``profiled_plan_check``)."""
    got = step_summary(records)
    out: dict[str, Any] = {"predicted_step_s": None, "measured_step_s": got["step_s"],
                           "predicted_peak_mem_bytes": None, "measured_peak_mem_bytes": got["peak_mem_bytes"],
                           "prediction": None, "prediction_reason": None}
    if config.train.plan_check == "off":
        out["prediction_reason"] = "train.plan_check = 'off'"
        return out
    try:
        # imported here so that a failure to import the planner is the prediction's, not the run's
        from .auto import predict_run

        pred, cluster = predict_run(config, model_cfg, device.type, profiled=profiled)
    except Exception as exc:  # noqa: BLE001 - any failure is the prediction's, never the run's
        out["prediction_reason"] = str(exc) if isinstance(exc, MeshtrainError) else f"{type(exc).__name__}: {exc}"
        return out
    out.update(predicted_step_s=pred.step_time, predicted_peak_mem_bytes=pred.memory.total,
               prediction={"cluster": cluster.name, "layout": pred.layout.label(),
                           "compute": "profiled" if cluster.profile_compute else "roofline",
                           "step_ratio": pred.step_time / got["step_s"] if got["step_s"] else None,
                           "mem_ratio": pred.memory.total / got["peak_mem_bytes"] if got["peak_mem_bytes"] else None})
    return out


def profiles_after(config: Any, summary: dict[str, Any]) -> bool:
    """True if ``meshtrain train`` times the finished run's blocks for its check (``train.plan_check``):
    "profiled", or "auto" for a CPU run that trained ``PROFILE_AFTER_S`` or longer. Only a completed
    CPU run of the layout its config gives (not one an elastic resize left on another world)."""
    mode = config.train.plan_check
    return (summary.get("device") == "cpu" and summary.get("measured_step_s") is not None
            and summary.get("layout") == degrees_of(config.parallel)
            and (mode == "profiled" or (mode == "auto" and summary.get("seconds", 0.0) >= PROFILE_AFTER_S)))


def profiled_plan_check(config: Any, summary: dict[str, Any]) -> dict[str, Any]:
    """After every rank of a CPU run has ended (the cores free): the planner's prediction again, with
    the model's blocks timed at the run's shapes (``plan_check(profiled=True)``, as ``meshtrain bench
    plan`` prices), replacing the cached one in ``summary`` and its summary.json (rewritten
    atomically); the cached one is kept as ``prediction["cached"]``. A failure keeps the cached check,
    with the reason in ``prediction_profiled_reason``."""
    records = [{"step_s": summary["measured_step_s"], "peak_mem_bytes": summary["measured_peak_mem_bytes"]}]
    started = time.perf_counter()
    check = plan_check(config, model_config(config, summary["vocab_size"]), torch.device("cpu"), records,
                       profiled=True)
    if check["predicted_step_s"] is None:
        summary["prediction_profiled_reason"] = check["prediction_reason"]
    else:
        cached = {k: summary.get(k) for k in ("predicted_step_s", "predicted_peak_mem_bytes", "prediction")}
        check["prediction"].update(cached=cached, profile_s=time.perf_counter() - started)
        summary.update({k: check[k] for k in ("predicted_step_s", "predicted_peak_mem_bytes", "prediction",
                                              "prediction_reason")})
    write_json_atomic(Path(summary["run_dir"]) / "summary.json", summary)
    return summary


def plan_check_line(check: dict[str, Any]) -> str:
    """The run's last log line: predicted vs measured step time and peak memory (or why no prediction)."""
    measured = (f"measured {check['measured_step_s']:.4f} s/step, "
                f"{check['measured_peak_mem_bytes'] / 2**20:.0f} MiB peak")
    if check["predicted_step_s"] is None:
        return f"# planner: no prediction ({check['prediction_reason']}); {measured}"
    p = check["prediction"]
    return (f"# planner: predicted {check['predicted_step_s']:.4f} s/step, "
            f"{check['predicted_peak_mem_bytes'] / 2**20:.0f} MiB/rank ({p['cluster']}, {p['compute']}, "
            f"{p['layout']}); {measured}")
