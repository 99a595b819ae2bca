"""Argument handling and printing for ``meshtrain bench train``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..files import write_json_atomic
from ..models.llama import PRESETS
from .train import IMPLS, PEER


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain bench train``."""
    p.add_argument("--compare", action="store_true",
                   help="also run the torch peers (DDP, FSDP2) in the same run and print ratios")
    p.add_argument("--impls", default="meshtrain-dp,meshtrain-zero3",
                   help=f"comma list of {','.join(IMPLS)} (--compare adds the peers)")
    p.add_argument("--world", default="2,4", help="comma list of world sizes (default: 2,4)")
    p.add_argument("--preset", default="5m", choices=sorted(PRESETS), help="model size (default: 5m)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--trials", type=int, default=1, help="interleaved repetitions; the median is reported")
    p.add_argument("--bucket-cap-mb", type=_bucket_cap, default=25.0,
                   help="gradient bucket size in MiB for both DPs (default 25), or auto: meshtrain's sized "
                        "from the calibrated link, DDP's 25")
    p.add_argument("--bucket-sweep", metavar="SIZES",
                   help="comma list of bucket sizes in MiB and auto (e.g. 1,4,16,64,auto): run meshtrain-dp (or "
                        "meshtrain-dp-shm from --impls) at each, interleaved over --trials, and report each as a "
                        "ratio to the best fixed size")
    p.add_argument("--algorithm", default="auto",
                   help="all-reduce algorithm of meshtrain DataParallel's buckets (auto, ring, native, ...)")
    p.add_argument("--json", dest="json_path", help="write one record per implementation and world size")


def _bucket_cap(text: str) -> float | str:
    """--bucket-cap-mb: "auto" or a positive number."""
    if text == "auto":
        return text
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a size in MiB nor 'auto'") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive size in MiB, or 'auto'")
    return v


def _fail(msg: str) -> int:
    print(f"meshtrain bench train: error: {msg}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table; 2 on bad input."""
    from .train import run

    impls = [s for s in args.impls.split(",") if s]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        return _fail(f"unknown implementation(s) {bad}: use {', '.join(IMPLS)}")
    if args.compare:
        impls = list(dict.fromkeys([PEER[i] for i in impls if i in PEER] + impls))
        impls.sort(key=IMPLS.index)
    try:
        worlds = [int(w) for w in args.world.split(",")]
    except ValueError:
        return _fail(f"--world must be a comma list of integers, got {args.world!r}")
    if any(w < 1 for w in worlds):
        return _fail(f"world sizes must be >= 1, got {worlds}")
    for name in ("batch", "seq", "steps", "trials"):
        if getattr(args, name) < 1:
            return _fail(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.seq > PRESETS[args.preset].max_seq_len:
        return _fail(f"--seq {args.seq} exceeds the {args.preset} preset's max_seq_len "
                     f"{PRESETS[args.preset].max_seq_len}")
    if args.json_path and not os.path.isdir(os.path.dirname(os.path.abspath(args.json_path))):
        return _fail(f"--json: directory of {args.json_path!r} does not exist; create it first")
    if args.bucket_sweep is not None:
        return _sweep(args, impls, worlds)
    records = run(worlds, impls, args.trials, preset=args.preset, batch=args.batch, seq=args.seq,
                  steps=args.steps, warmup=args.warmup, bucket_cap_mb=args.bucket_cap_mb,
                  algorithm=args.algorithm)
    print_table(records, args)
    if args.json_path:
        write_json_atomic(args.json_path, {"config": {k: v for k, v in vars(args).items() if k != "func"},
                                           "records": records})
        print(f"# wrote {args.json_path}")
    return 0


def _sweep(args: argparse.Namespace, impls: list[str], worlds: list[int]) -> int:
    """--bucket-sweep: DataParallel at each size (``bucket_sweep.py``)."""
    from .bucket_sweep import SWEEP_IMPLS, parse_sweep, print_sweep, run_sweep

    try:
        sizes = parse_sweep(args.bucket_sweep)
    except ValueError as exc:
        return _fail(str(exc))
    dps = [i for i in impls if i in SWEEP_IMPLS]
    if len(dps) != 1:
        return _fail(f"--bucket-sweep runs one DataParallel implementation; --impls has {dps or impls}: pass "
                     f"--impls {' or --impls '.join(SWEEP_IMPLS)}")
    records = run_sweep(worlds, dps[0], sizes, args.trials, preset=args.preset, batch=args.batch, seq=args.seq,
                        steps=args.steps, warmup=args.warmup, algorithm=args.algorithm)
    print_sweep(records, args.preset, dps[0], args.trials)
    if args.json_path:
        write_json_atomic(args.json_path, {"config": {k: v for k, v in vars(args).items() if k != "func"},
                                           "records": records})
        print(f"# wrote {args.json_path}")
    return 0


def print_table(records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """One row per implementation and world size."""
    n = records[0]["params"] if records else 0
    print(f"# model {args.preset} ({n / 1e6:.2f}M params), batch {args.batch} x {args.seq} tokens per rank, "
          f"{args.steps} timed steps after {args.warmup}, gloo, fp32, AdamW, median of {args.trials}")
    print(f"# {'impl':<16} {'world':>5} {'tokens/s':>10} {'vs peer':>8} {'peak MiB':>9} {'mem vs peer':>11} {'loss':>7}")
    for r in sorted(records, key=lambda r: (r["world_size"], IMPLS.index(r["impl"]))):
        ratio = f"{r['ratio_to_peer']:.2f}" if r["ratio_to_peer"] is not None else "-"
        mem = f"{r['mem_ratio_to_peer']:.2f}" if r["mem_ratio_to_peer"] is not None else "-"
        print(f"  {r['impl']:<16} {r['world_size']:>5} {r['tokens_per_s']:>10.0f} {ratio:>8} "
              f"{r['peak_mem_bytes'] / 2**20:>9.0f} {mem:>11} {r['loss']:>7.3f}")
