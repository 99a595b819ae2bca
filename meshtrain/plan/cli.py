"""``meshtrain plan``: the arguments, and the command that prints the ranked layouts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError
from .architectures import resolve_model
from .clusters import resolve_cluster
from .layout import AC_MODES, OFFLOAD_MODES, PRECISIONS, Layout, parse_layout
from .report import chart, table, to_json
from .search import search
from .step import predict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``meshtrain plan`` options."""
    parser.add_argument("--model", required=True, help="a model preset (meshtrain's or llama3-8b/70b/405b, "
                        "gpt-175b, qwen3-30b-a3b, deepseek-v3) or a JSON file of LlamaConfig fields")
    parser.add_argument("--cluster", required=True, help="h100, h200, a100, h100-gt500, this-host, or a TOML file")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) in all")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--layout", action="append", help="e.g. dp=32,tp=8 or dp=8,tp=8,pp=8,m=16,v=2,interleaved "
                       "or, for a mixture of experts, dp=16,ep=8 (repeat to compare several)")
    group.add_argument("--search", action="store_true", help="enumerate layouts and rank those that fit")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    parser.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--precision", choices=PRECISIONS, default=None, help="compute precision (default bf16)")
    parser.add_argument("--ac", choices=AC_MODES, default=None, help="activation checkpointing (search: least that fits)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage (search: all)")
    parser.add_argument("--schedule", choices=("afab", "1f1b", "interleaved"), default=None, help="pipeline schedule")
    parser.add_argument("--offload", choices=OFFLOAD_MODES, default=None, help="ZeRO CPU offload (parallel.offload): "
                        "optimizer = fp32 masters and AdamW state on the host, stepped by its CPUs; params = also "
                        "ZeRO-3's parameter shards (search: only the ZeRO stages it allows)")
    parser.add_argument("--compile", action="store_true", help="element-wise ops fused (torch.compile)")
    parser.add_argument("--top", type=int, default=10, help="layouts to show with --search")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--chart", type=Path, default=None, help="write a PNG breakdown of step time here")


def run(args: argparse.Namespace) -> str:
    """The command's output (table or JSON); raises ConfigError on bad input."""
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: use 1 or more")
    arch, cluster = resolve_model(args.model), resolve_cluster(args.cluster)
    fixed = {k: v for k, v in (("precision", args.precision), ("ac", args.ac), ("zero_stage", args.zero_stage),
                               ("schedule", args.schedule), ("offload", args.offload)) if v is not None}
    fixed["compile"] = args.compile
    if args.search:
        preds = search(arch, cluster, args.gpus, args.global_batch, args.seq, fixed, top=args.top)
    else:
        preds = [predict(arch, cluster, _with_world(parse_layout(text, **fixed), args.gpus), args.global_batch,
                         args.seq) for text in args.layout]
        preds.sort(key=lambda p: p.step_time)
    context = {"model": arch.name, "params": arch.params(), "cluster": cluster.name, "gpus": args.gpus,
               "global_batch": args.global_batch, "seq": args.seq}
    if args.chart:
        chart(preds, args.chart, f"{arch.name} on {args.gpus} x {cluster.name}")
    return to_json(preds, context) if args.json else table(preds)


def _with_world(layout: Layout, gpus: int) -> Layout:
    """The layout, checked against --gpus before anything else (the most common mistake)."""
    if layout.world != gpus:
        from .layout import _nearest_dp

        raise ConfigError(f"layout {layout.label()} uses {layout.world} GPUs, not --gpus {gpus}; nearest that "
                          f"fills them: {_nearest_dp(layout, gpus)}")
    return layout


def main(args: argparse.Namespace) -> int:
    """Run ``meshtrain plan``; 0 on success, 2 with the error on stderr on bad input."""
    try:
        print(run(args))
    except ConfigError as e:
        print(f"meshtrain plan: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0
