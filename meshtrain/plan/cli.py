"""``meshtrain plan``: the arguments, and the command that prints the ranked layouts."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ..errors import ConfigError
from .architectures import resolve_model
from .clusters import check_whole_nodes, resolve_cluster, tp_warning
from .layout import AC_MODES, OFFLOAD_MODES, PRECISIONS, Layout, check_degrees, check_sizes, parse_layout
from .report import CHART_FORMATS, chart, header, table, to_json
from .search import check_top, search
from .step import DEFAULT_MEMORY_MARGIN, check_memory_margin, predict


def _whole_number(text: str) -> int:
    """argparse type of the integer flags: the type here, the range where the rule lives
    (``check_sizes``, ``check_top``), so --search and --layout share it."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; write e.g. 16") from None


def _number(text: str) -> float:
    """argparse type of --memory-margin (its range: ``check_memory_margin``)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; write e.g. 0.1") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``meshtrain plan`` options."""
    parser.add_argument("--model", help="a model preset (meshtrain's or llama3-8b/70b/405b, gpt-175b, mpt-1b ... "
                        "mpt-70b, qwen3-30b-a3b, deepseek-v3) or a JSON file of LlamaConfig fields (required but for "
                        "--validate)")
    parser.add_argument("--cluster", help="h100, h200, a100, a100-40gb, h100-gt500, this-host, or a TOML file")
    parser.add_argument("--gpus", type=_whole_number, help="GPUs (ranks) in all")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--layout", action="append", help="e.g. dp=32,tp=8 or dp=8,tp=8,pp=8,m=16,v=2,interleaved "
                       "or, for a mixture of experts, dp=16,ep=8 (repeat to compare several)")
    group.add_argument("--search", action="store_true", help="enumerate layouts and rank those that fit")
    group.add_argument("--validate", action="store_true", help="print the planner's validation table: its "
                       "predictions of published runs (docs/plan.md) and the error summary; takes no other flag "
                       "but --json")
    parser.add_argument("--global-batch", type=_whole_number, help="sequences per step")
    parser.add_argument("--seq", type=_whole_number, help="tokens per sequence")
    parser.add_argument("--precision", choices=PRECISIONS, default=None, help="compute precision (default bf16)")
    parser.add_argument("--ac", choices=AC_MODES, default=None, help="activation checkpointing (search: least that fits)")
    parser.add_argument("--zero-stage", type=_whole_number, choices=(0, 1, 2, 3), default=None,
                        help="ZeRO stage (search: all)")
    parser.add_argument("--schedule", choices=("afab", "1f1b", "interleaved"), default=None, help="pipeline schedule")
    parser.add_argument("--offload", choices=OFFLOAD_MODES, default=None, help="ZeRO CPU offload (parallel.offload): "
                        "optimizer = fp32 masters and AdamW state on the host, stepped by its CPUs; params = also "
                        "ZeRO-3's parameter shards (search: only the ZeRO stages it allows)")
    parser.add_argument("--compile", action="store_true", help="element-wise ops fused (torch.compile)")
    parser.add_argument("--async-tp", action="store_true", help="the runtime overlaps tensor-parallel collectives "
                        "with matmuls (torchtitan's async TP, Megatron's --tp-comm-overlap): price tp > 1 layouts "
                        "with it (meshtrain train has none)")
    parser.add_argument("--top", type=_whole_number, default=10, help="layouts to show with --search")
    parser.add_argument("--memory-margin", type=_number, default=DEFAULT_MEMORY_MARGIN,
                        help="fraction of a rank's memory kept free: a layout fits if its predicted peak is at most "
                             "(1 - margin) x the memory a rank may use (0 <= margin < 1; default %(default)s)")
    parser.add_argument("--allow-partial-node", action="store_true", help="price a --gpus that is not a whole "
                        "number of nodes (refused otherwise: launchers start as many ranks on every node)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--chart", type=Path, default=None, help="write a PNG breakdown of step time here "
                        "(.png; .svg and .pdf too)")


def run(args: argparse.Namespace, warn: list[str] | None = None) -> str:
    """The command's output (a header line and the table, or JSON); raises ConfigError on bad input,
    before anything is written. Warnings (tp across nodes, a partial node allowed) go to ``warn``."""
    warn = warn if warn is not None else []
    if getattr(args, "validate", False):
        return _validate(args)
    for flag, value in (("--model", args.model), ("--cluster", args.cluster), ("--gpus", args.gpus),
                        ("--global-batch", args.global_batch), ("--seq", args.seq)):
        if value is None:
            raise ConfigError(f"{flag} is required with --layout or --search (e.g. --model llama3-8b --cluster h100 "
                              f"--gpus 8 --global-batch 16 --seq 8192); only --validate runs without it")
    check_sizes(args.gpus, args.global_batch, args.seq)  # the flags first: then the (slower) files
    margin = check_memory_margin(args.memory_margin)
    check_top(args.top)
    if args.chart is not None and args.chart.suffix.lower() not in CHART_FORMATS:
        raise ConfigError(f"--chart {args.chart}: write a {', '.join(CHART_FORMATS)} file, e.g. --chart plan.png")
    arch, cluster = resolve_model(args.model), resolve_cluster(args.cluster)
    warn += filter(None, [check_whole_nodes(cluster, args.gpus, args.allow_partial_node)])
    fixed = {k: v for k, v in (("precision", args.precision), ("ac", args.ac), ("zero_stage", args.zero_stage),
                               ("schedule", args.schedule), ("offload", args.offload)) if v is not None}
    fixed["compile"] = args.compile
    if getattr(args, "async_tp", False):
        fixed["async_tp"] = True
    if args.search:
        preds = search(arch, cluster, args.gpus, args.global_batch, args.seq, fixed, top=args.top,
                       memory_margin=margin)
    else:
        preds = [replace(predict(arch, cluster, _with_world(_layout(text, fixed), args.gpus),
                                 args.global_batch, args.seq), memory_margin=margin) for text in args.layout]
        preds.sort(key=lambda p: p.step_time)
    for tp in sorted({p.layout.tp for p in preds}):
        warn += filter(None, [tp_warning(cluster, tp)])
    context = {"model": arch.name, "params": arch.params(), "cluster": cluster.name, "gpus": args.gpus,
               "global_batch": args.global_batch, "seq": args.seq, "memory_margin": margin, "search": args.search}
    if args.chart:
        chart(preds, args.chart, f"{arch.name} on {args.gpus} x {cluster.name}")
    if args.json:
        return to_json(preds, context)
    return header(preds, context) + "\n" + table(preds)


def _layout(text: str, fixed: dict) -> Layout:
    """A --layout with the flags' settings; --async-tp applies where the layout can overlap (tp > 1 with
    sequence parallelism), unless the layout says atp itself."""
    async_tp = fixed.get("async_tp", False)
    layout = parse_layout(text, **{k: v for k, v in fixed.items() if k != "async_tp"})
    if async_tp and "atp=" not in text and "async_tp=" not in text and layout.sp:
        layout = replace(layout, async_tp=True)
    return layout


def _validate(args: argparse.Namespace) -> str:
    """``--validate``: the published-run table and its summary (``published.py``), or JSON."""
    import json

    from . import published

    rows, left, s = published.validate()
    if args.json:
        return json.dumps({"rows": rows, "left_out": left, "summary": s}, default=str)
    return "\n\n".join([published.markdown(rows), published.summary_text(s),
                         "Left out: " + published.LEFT_OUT_WHY, published.markdown(left)])


def _with_world(layout: Layout, gpus: int) -> Layout:
    """The layout, checked against --gpus before anything else (the most common mistake)."""
    check_degrees(layout)  # a zero or negative degree first: its world would mislead
    if layout.world != gpus:
        from .layout import _nearest_dp

        raise ConfigError(f"layout {layout.label()} uses {layout.world} GPUs, not --gpus {gpus}; nearest that "
                          f"fills them: {_nearest_dp(layout, gpus)}")
    return layout


def main(args: argparse.Namespace) -> int:
    """Run ``meshtrain plan``; 0 on success, 2 with the error on stderr on bad input."""
    warn: list[str] = []
    try:
        out = run(args, warn)
    except ConfigError as e:
        print(f"meshtrain plan: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for line in warn:
        print(f"meshtrain plan: {line}", file=sys.stderr)
    print(out)
    return 0
