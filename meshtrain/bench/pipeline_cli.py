"""Argument handling and printing for ``meshtrain bench pipeline``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..comm.transport import registry
from ..files import write_json_atomic
from ..models.llama import PRESETS
from .pipeline import COMPUTE


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain bench pipeline``."""
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--schedules", default="afab,1f1b,interleaved", help="comma list of schedules")
    p.add_argument("--virtual", type=int, default=2, help="chunks per rank for interleaved (default 2)")
    p.add_argument("--compute", default="sleep", choices=COMPUTE,
                   help="stage work: 'sleep' (fixed cost, isolates the schedule) or 'model' (the Llama)")
    p.add_argument("--transport", default="local", choices=registry.names(),
                   help="local: ranks as threads; shm / torch: processes")
    p.add_argument("--steps", type=int, default=3, help="timed steps (the median bubble is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--f-ms", type=float, default=20.0, help="sleep compute: forward ms per stage (backward 2x)")
    p.add_argument("--preset", default="test", choices=sorted(PRESETS), help="model compute: model size")
    p.add_argument("--layers", type=int, default=8, help="model compute: decoder layers")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--json", dest="json_path", help="write the records (without traces) here")
    p.add_argument("--trace-dir", help="write each schedule's measured trace (for `meshtrain viz schedule --trace`)")


def _fail(msg: str) -> int:
    print(f"meshtrain bench pipeline: error: {msg}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    """Validate, run, print the table and the bar; 2 on bad input."""
    from ..errors import ConfigError
    from ..parallel.pipeline.schedule import build_schedule
    from .pipeline import run

    schedules = tuple(s for s in args.schedules.split(",") if s)
    for name in ("pp", "microbatches", "virtual", "steps", "layers", "seq"):
        if getattr(args, name) < 1:
            return _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        for s in schedules:
            build_schedule(s, args.pp, args.microbatches, args.virtual if s == "interleaved" else 1)
    except ConfigError as exc:
        return _fail(str(exc))
    if args.compute == "model" and args.layers < args.pp * max(
            [args.virtual if s == "interleaved" else 1 for s in schedules]):
        return _fail(f"--layers {args.layers} cannot fill pp x virtual stages; use --layers >= "
                     f"{args.pp * args.virtual}")
    for path in (args.json_path, args.trace_dir and os.path.join(args.trace_dir, "x")):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            return _fail(f"directory of {path!r} does not exist; create it first")
    records = run(args.pp, args.microbatches, schedules, args.virtual, args.compute, args.transport, args.steps,
                  args.warmup, args.f_ms, args.preset, args.layers, seq=args.seq)
    print_table(records, args)
    if args.trace_dir:
        for r in records:
            path = os.path.join(args.trace_dir, f"pipeline-{r['schedule']}.json")
            write_json_atomic(path, r["trace"])
            print(f"# wrote {path}")
    if args.json_path:
        write_json_atomic(args.json_path, {"config": vars(args), "records": [
            {k: v for k, v in r.items() if k != "trace"} for r in records]})
        print(f"# wrote {args.json_path}")
    return 0


def print_table(records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """One row per schedule, then the two targets of the bar."""
    print(f"# pipeline pp={args.pp}, m={args.microbatches}, compute={args.compute}, transport={args.transport}, "
          f"median of {args.steps} steps")
    print(f"# {'schedule':<12} {'v':>2} {'theory':>7} {'measured':>9} {'diff pp':>8}  peak activation KiB per stage")
    for r in records:
        diff = 100 * (r["measured_bubble"] - r["theoretical_bubble"])
        peaks = " ".join(f"{b / 1024:.0f}" for b in r["peak_activation_bytes"])
        print(f"  {r['schedule']:<12} {r['virtual']:>2} {r['theoretical_bubble']:>7.3f} {r['measured_bubble']:>9.3f} "
              f"{diff:>+8.1f}  {peaks}")
    by = {r["schedule"]: r for r in records}
    worst = max(abs(r["measured_bubble"] - r["theoretical_bubble"]) for r in records)
    print(f"# bar: |measured - theory| <= 5 points: worst {100 * worst:.1f} -> {'met' if worst <= 0.05 else 'NOT met'}")
    if "afab" in by and "1f1b" in by and by["afab"]["peak_activation_bytes"][0]:
        ratio = by["1f1b"]["peak_activation_bytes"][0] / by["afab"]["peak_activation_bytes"][0]
        limit = args.pp / args.microbatches
        print(f"# bar: 1F1B / AFAB peak activations on stage 0 = {ratio:.3f} (<= pp/m = {limit:.3f}: "
              f"{'met' if ratio <= limit + 1e-9 else 'NOT met'})")
