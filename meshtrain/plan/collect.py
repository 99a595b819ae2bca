"""``meshtrain bench plan --collect DIR ...``: every ``meshtrain train`` run is a validation row.

A run writes the planner's prediction for its own layout beside what it measured into its
summary.json (``plan.run_check.plan_check``). This gathers those files under the given directories
into one table (run, cluster, layout, predicted and measured step time and peak memory, their
ratios) and the error over the runs that have a prediction: the median and worst absolute
relative error of step time and of memory. Runs without a prediction are listed with the reason.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..errors import ConfigError


def collect(dirs: list[str]) -> list[dict[str, Any]]:
    """The planner-check rows of every summary.json under ``dirs`` (searched recursively), sorted
    by path. ConfigError naming the directory if one does not exist or none holds a summary."""
    rows = []
    for d in dirs:
        root = Path(d)
        if not root.is_dir():
            raise ConfigError(f"--collect {d}: no such directory; pass run directories of `meshtrain train` "
                              "(or a folder above them)")
        for path in sorted(root.rglob("summary.json")):
            try:
                s = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # a file being written, or not ours
            if "measured_step_s" not in s:
                continue  # a summary from before runs checked the planner
            pred = s.get("prediction") or {}
            # compute: "profiled" (a CPU run's blocks timed, train.plan_check) or "roofline" (a preset,
            # or a CPU host's cached peak only: far off for small models)
            rows.append({"run": str(path.parent), "cluster": pred.get("cluster"), "layout": pred.get("layout"),
                         "compute": pred.get("compute"),
                         "predicted_step_s": s.get("predicted_step_s"), "measured_step_s": s["measured_step_s"],
                         "predicted_mem_bytes": s.get("predicted_peak_mem_bytes"),
                         "measured_mem_bytes": s.get("measured_peak_mem_bytes"),
                         "reason": s.get("prediction_reason")})
    if not rows:
        raise ConfigError(f"--collect {' '.join(dirs)}: no summary.json with a planner check found; runs of "
                          "`meshtrain train` write one when they finish")
    return rows


def errors(rows: list[dict[str, Any]]) -> dict[str, float | int]:
    """Median and worst |predicted / measured - 1| of step time and memory over the rows that have a
    prediction (``n`` of them)."""
    priced = [r for r in rows if r["predicted_step_s"] is not None and r["measured_step_s"]]
    step = [abs(r["predicted_step_s"] / r["measured_step_s"] - 1) for r in priced]
    mem = [abs(r["predicted_mem_bytes"] / r["measured_mem_bytes"] - 1) for r in priced if r["measured_mem_bytes"]]
    out: dict[str, float | int] = {"n": len(priced)}
    if step:
        out.update(step_median=statistics.median(step), step_worst=max(step))
    if mem:
        out.update(mem_median=statistics.median(mem), mem_worst=max(mem))
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows and the error summary, one line a run."""
    print(f"{'run':<40} {'cluster':<10} {'compute':<8} {'layout':<36} {'pred s':>8} {'meas s':>8} {'ratio':>6} "
          f"{'pred MiB':>9} {'meas MiB':>9}")
    for r in rows:
        if r["predicted_step_s"] is None:
            print(f"{r['run'][-40:]:<40} no prediction ({r['reason']}); measured {r['measured_step_s']:.4f} s")
            continue
        print(f"{r['run'][-40:]:<40} {r['cluster']:<10} {r['compute'] or '-':<8} {r['layout']:<36} "
              f"{r['predicted_step_s']:>8.4f} "
              f"{r['measured_step_s']:>8.4f} {r['predicted_step_s'] / r['measured_step_s']:>6.2f} "
              f"{r['predicted_mem_bytes'] / 2**20:>9.0f} {r['measured_mem_bytes'] / 2**20:>9.0f}")
    e = errors(rows)
    if e["n"]:
        print(f"# {e['n']} runs priced: step time error median {100 * e['step_median']:.0f} %, worst "
              f"{100 * e['step_worst']:.0f} %" + (f"; memory median {100 * e['mem_median']:.0f} %, worst "
                                                 f"{100 * e['mem_worst']:.0f} %" if "mem_median" in e else ""))
    else:
        print("# no run had a prediction")
