"""The planner's own validation set: published training runs from four sources, each predicted with
the cluster presets' one set of constants and compared with what was published.

* ``published_torchtitan``: torchtitan's benchmark files (Grand Teton H100s, H200s);
* ``published_mosaic``: MosaicML's llm-foundry throughput tables (A100s);
* ``published_megatron``: Megatron-LM's GPT-3 strong scaling and H100 model table, Megatron-Bridge's runs;
* ``published_megatron_2021``: Megatron-LM's weak-scaling table of 2021, GPT 1.7B to 1T (A100s).

Each row is a ``PublishedRun`` (``published_run``) with its source, its layout as stated, what was
left unstated, and its role: "fit" rows informed a constant, "check" rows are the validation. The bar,
over the check rows: median absolute step-time error <= 10 %, worst <= 25 %, median memory error <= 10 %
(``published_run.BAR_*``). ``python -m meshtrain.plan.published`` (or ``meshtrain plan --validate``)
prints the table of docs/plan.md and the summary.
"""

from __future__ import annotations

import argparse
import json

from . import published_megatron, published_megatron_2021, published_mosaic, published_torchtitan
from .published_run import BAR_MEDIAN, BAR_MEMORY, BAR_WORST, PublishedRun, check, metric_of, summary

RUNS: tuple[PublishedRun, ...] = (published_torchtitan.RUNS + published_mosaic.RUNS + published_megatron.RUNS
                                  + published_megatron_2021.RUNS)
"""Every counted row (fit and check)."""
LEFT_OUT: tuple[PublishedRun, ...] = published_mosaic.LEFT_OUT
"""Rows shown but not counted, with their reason, ``LEFT_OUT_WHY``."""
LEFT_OUT_WHY = published_mosaic.LEFT_OUT_WHY
SOURCES = {"torchtitan": published_torchtitan.RUNS, "MosaicML": published_mosaic.RUNS,
           "Megatron": published_megatron.RUNS + published_megatron_2021.RUNS}

__all__ = ["BAR_MEDIAN", "BAR_MEMORY", "BAR_WORST", "LEFT_OUT", "LEFT_OUT_WHY", "RUNS", "SOURCES", "PublishedRun",
           "check", "markdown", "metric_of", "summary", "validate"]


def _fmt(metric: str, v: float) -> str:
    """A metric value as the table shows it."""
    if metric == "megatron_tflops":
        return f"{v:.0f} TFLOP/s/GPU"
    return f"{v * 100:.1f}% MFU" if metric == "mfu" else f"{v:,.0f} tok/s/GPU"


def markdown(rows: list[dict]) -> str:
    """The rows as the table in docs/plan.md: run, role, layout, published and predicted value and error,
    published and predicted peak memory and error, and --search's first layout where it was asked."""
    searched = any("search_layout" in r for r in rows)
    out = ["| run | role | layout priced | published | predicted | error | GiB published | GiB predicted | "
           "memory error |" + (" --search first (its prediction) |" if searched else ""),
           "|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---|" if searched else "")]
    for r in rows:
        mem_err = f"{r['memory_error'] * 100:+.0f}%" if r.get("memory_error") is not None else "-"
        pub_mem = f"{r['published_memory_gib']:g}" if r.get("published_memory_gib") else "-"
        note = "" if r.get("memory_comparable", True) else " (not comparable)"
        found = f"`{r['search_layout']}` ({_fmt(r['metric'], r['search_value'])})" if "search_layout" in r else "-"
        out.append(f"| {r['run']} | {r['role']} | `{r['layout']}` | {_fmt(r['metric'], r['published'])} | "
                   f"{_fmt(r['metric'], r['predicted'])} | {r['error'] * 100:+.0f}% | {pub_mem} | "
                   f"{r['memory_gib']:.1f}{note} | {mem_err} |" + (f" {found} |" if searched else ""))
    return "\n".join(out)


def summary_text(s: dict) -> str:
    """The summary as lines: median and worst error of the check and fit rows, memory, the bar."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:.1f}%"

    c, f, m = s["check"], s["fit"], s["memory_check"]
    return "\n".join([
        f"check rows ({c['n']}): median |error| {pct(c['median'])}, worst {pct(c['worst'])}, "
        f"{s['within_20']} of {c['n']} within 20%",
        f"fit rows ({f['n']}): median |error| {pct(f['median'])}, worst {pct(f['worst'])}",
        f"memory, check rows that publish it ({m['n']}): median |error| {pct(m['median'])}, worst {pct(m['worst'])}",
        f"bar (check rows: median <= {BAR_MEDIAN:.0%}, worst <= {BAR_WORST:.0%}; memory median <= {BAR_MEMORY:.0%}): "
        f"step time {'met' if s['meets_step_bar'] else 'MISSED'}, "
        f"memory {'met' if s['meets_memory_bar'] else 'MISSED'}"])


def validate(with_search: bool = False) -> tuple[list[dict], list[dict], dict]:
    """(counted rows, left-out rows, summary of the counted ones)."""
    rows = [check(run, with_search=with_search) for run in RUNS]
    left = [check(run) for run in LEFT_OUT]
    return rows, left, summary(rows)


def main(argv: list[str] | None = None) -> int:
    """Print the validation table (markdown) and summary, or JSON with ``--json``."""
    parser = argparse.ArgumentParser(prog="python -m meshtrain.plan.published", description=__doc__.split("\n")[0])
    parser.add_argument("--search", action="store_true", help="also run --search for each row (minutes)")
    parser.add_argument("--json", action="store_true", help="print JSON: the rows, the left-out rows, the summary")
    args = parser.parse_args(argv)
    rows, left, s = validate(with_search=args.search)
    if args.json:
        print(json.dumps({"rows": rows, "left_out": left, "summary": s}, default=str))
        return 0
    print(markdown(rows))
    print()
    print(summary_text(s))
    print()
    print(f"Left out ({LEFT_OUT_WHY}):")
    print(markdown(left))
    return 0


if __name__ == "__main__":  # python -m meshtrain.plan.published: regenerate the docs table
    raise SystemExit(main())
