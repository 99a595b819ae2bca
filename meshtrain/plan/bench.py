"""``meshtrain bench plan``: run ``meshtrain train`` briefly on (model, layout) pairs on this host
and set the planner's predicted step time and peak memory beside the measured ones.

Each pair runs as its own ``meshtrain train`` process tree (CPU ranks on this host), ``--trials``
times, the trials interleaved (every pair once, then again): a trial predicts (profiling this host
as it is then) and measures right after, and the pair reports the median of its trials' ratios, so a
spell of a busier machine slows both sides of one trial rather than one side of the pair. The measured
step time is the median ``step_s`` of rank 0's ``metrics.jsonl`` after the first two steps (warm-up),
the measured memory its ``peak_mem_bytes`` (the resident set's high-water mark, which also holds the
Python interpreter and torch: the prediction holds only what training adds). The prediction uses
the ``this-host`` cluster: the calibrated comm cost model and the measured matmul peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from .architectures import resolve_model
from .clusters import Cluster
from .corun import stop as stop_profiling
from .host import this_host
from .layout import parse_layout
from .profile import block_seconds, head_seconds, optimizer_seconds
from .profile_parallel import collective_latency, parallel_block_seconds
from .run_check import step_summary
from .step import predict

PROFILES = (block_seconds, head_seconds, optimizer_seconds, parallel_block_seconds, collective_latency)
"""The planner's timings of this host, kept per process: forgotten at each trial's start, so that every
trial prices its pairs from timings taken beside its own measurements."""

PAIRS: tuple[tuple[str, str], ...] = (
    ("test", "dp=1"), ("test", "dp=2"), ("test", "dp=2,zero=3"), ("test", "tp=2"), ("test", "dp=2,tp=2"),
    ("test", "pp=2,m=2"), ("test", "cp=2"), ("5m", "dp=1"), ("5m", "dp=2,zero=1"), ("5m", "tp=2"),
    ("5m", "pp=2,m=4,afab"), ("5m", "dp=2,ac=full"), ("10m", "dp=2"), ("10m", "tp=2,pp=2,m=2"),
    ("5m", "dp=4,rep=2,zero=3"),
)
"""Fifteen pairs of meshtrain presets and layouts of at most 4 ranks."""

DATA = ["--data.max_bytes=300000", "--data.vocab_size=512", "--checkpoint.enabled=false", "--no-progress"]
VOCAB = 512  # the trained tokenizer's vocabulary, which sets the model's (see DATA)
GLOBAL_BATCH, SEQ = 8, 64
"""The default step: 8 sequences of 64 tokens."""


def train_args(layout_text: str, model: str, steps: int, global_batch: int, seq: int, out: Path) -> list[str]:
    """The ``meshtrain train`` arguments that run ``layout_text`` (fp32 on the CPU)."""
    lay = parse_layout(layout_text, precision="fp32")
    ac = {"none": "none", "full": "full", "selective": "selective", "op": "selective"}[lay.ac]
    return ["train", f"--out={out}", f"--model.preset={model}", f"--train.steps={steps}", "--train.warmup_steps=1",
            f"--train.global_batch={global_batch}", f"--train.seq_len={seq}", "--train.precision=fp32",
            "--train.device=cpu", f"--parallel.dp={lay.dp}", f"--parallel.dp_replicate={lay.dp_replicate}", f"--parallel.tp={lay.tp}", f"--parallel.pp={lay.pp}",
            f"--parallel.cp={lay.cp}", f"--parallel.zero_stage={lay.zero_stage}",
            f"--parallel.microbatches={lay.microbatches}", f"--parallel.schedule={lay.schedule}",
            f"--parallel.virtual_stages={lay.virtual}", f"--parallel.activation_checkpointing={ac}",
            f"--parallel.sequence_parallel={'true' if lay.tp > 1 else 'false'}", *DATA]


def measure(model: str, layout_text: str, steps: int, global_batch: int, seq: int, out: Path,
            timeout: float = 600) -> dict:
    """Run ``meshtrain train`` and return rank 0's median and fastest step seconds and peak memory bytes."""
    cmd = [sys.executable, "-m", "meshtrain.cli",
           *train_args(layout_text, model, steps, global_batch, seq, out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"meshtrain train failed ({proc.returncode}): {proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return step_summary(records)


def compare(model: str, layout_text: str, cluster: Cluster, steps: int, global_batch: int, seq: int,
            out: Path) -> dict:
    """Predicted and measured step time and memory of one pair, with their ratios."""
    arch = replace(resolve_model(model), vocab_size=VOCAB, tie_embeddings=False)
    pred = predict(arch, cluster, parse_layout(layout_text, precision="fp32"), global_batch, seq)
    stop_profiling()  # the profiling processes (this-host) would share the cores with the run
    got = measure(model, layout_text, steps, global_batch, seq, out)
    return {"model": model, "layout": pred.layout.label(), "predicted_step_s": pred.step_time,
            "measured_step_s": got["step_s"], "step_ratio": pred.step_time / got["step_s"],
            "best_step_s": got["best_step_s"], "best_step_ratio": pred.step_time / got["best_step_s"],
            "predicted_mem_bytes": pred.memory.total, "measured_mem_bytes": got["peak_mem_bytes"],
            "mem_ratio": pred.memory.total / got["peak_mem_bytes"], "predicted_parts": pred.parts}


def combine(trials: list[dict]) -> dict:
    """One pair's row over its interleaved trials: the median of each measure and of each ratio (the
    ratios per trial, a trial's two sides taken minutes apart at most), the trials' step ratios (their
    spread), and the breakdown of the trial whose step ratio is the median."""
    ratios = sorted(t["step_ratio"] for t in trials)
    middle = min(trials, key=lambda t: abs(t["step_ratio"] - statistics.median(ratios)))
    numbers = [k for k, v in trials[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    row = {k: statistics.median(t[k] for t in trials) for k in numbers}
    return {"model": trials[0]["model"], "layout": trials[0]["layout"], **row, "step_ratios": ratios,
            "trials": len(trials), "predicted_parts": middle["predicted_parts"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``meshtrain bench plan`` options."""
    parser.add_argument("--pairs", type=int, default=len(PAIRS), help="run the first N (model, layout) pairs")
    parser.add_argument("--steps", type=int, default=6, help="training steps per pair")
    parser.add_argument("--trials", type=int, default=3,
                        help="interleaved trials per pair (each predicts and measures; the row is their median)")
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH, help="sequences per step")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of the table")
    parser.add_argument("--collect", nargs="+", metavar="DIR",
                        help="run nothing: gather the planner checks that finished `meshtrain train` runs wrote "
                             "into their summary.json under these directories, with the error over them")


def main(args: argparse.Namespace) -> int:
    """Run the pairs and print predicted vs measured (``--collect``: gather finished runs' checks)."""
    if args.collect:
        from ..errors import ConfigError
        from .collect import collect, errors, print_table

        try:
            rows = collect(args.collect)
        except ConfigError as exc:
            print(f"meshtrain bench plan: error: {exc}", file=sys.stderr)
            return 2
        if args.json:
            for row in rows:
                print(json.dumps(row))
            print(json.dumps({"errors": errors(rows)}))
        else:
            print_table(rows)
        return 0
    if args.trials < 1 or args.pairs < 1 or args.steps < 3:
        print(f"meshtrain bench plan: error: --trials {args.trials}, --pairs {args.pairs}, --steps {args.steps}: "
              f"need at least 1 trial, 1 pair and 3 steps (2 are warm-up); use e.g. --trials 3", file=sys.stderr)
        return 2
    cluster = this_host()
    print(f"# this-host: peak {cluster.peak_flops / 1e9:.1f} GFLOP/s over {cluster.cores} cores, {cluster.notes}")
    if not args.json:
        print(f"{'model':<6} {'layout':<40} {'pred s':>8} {'median s':>8} {'ratio':>6} {'best s':>8} {'ratio':>6} "
              f"{'pred MiB':>9} {'RSS MiB':>8}")
    pairs = PAIRS[:args.pairs]
    trials: list[list[dict]] = [[] for _ in pairs]
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-plan-") as tmp:
        for trial in range(args.trials):
            for profile in PROFILES:
                profile.cache_clear()
            for i, (model, layout) in enumerate(pairs):
                trials[i].append(compare(model, layout, cluster, args.steps, args.global_batch, args.seq,
                                         Path(tmp) / f"{trial}-{i}"))
        rows = [combine(t) for t in trials]
        for row in rows:
            if args.json:
                print(json.dumps(row))
            else:
                print(f"{row['model']:<6} {row['layout']:<40} {row['predicted_step_s']:>8.4f} "
                      f"{row['measured_step_s']:>8.4f} {row['step_ratio']:>6.2f} "
                      f"{row['best_step_s']:>8.4f} {row['best_step_ratio']:>6.2f} "
                      f"{row['predicted_mem_bytes'] / 2**20:>9.0f} {row['measured_mem_bytes'] / 2**20:>8.0f}")
    step = sorted(abs(r["step_ratio"] - 1) for r in rows)
    mem = sorted(abs(r["mem_ratio"] - 1) for r in rows)
    print(f"# {len(rows)} pairs, {args.trials} interleaved trials each: step time median |error| "
          f"{statistics.median(step):.1%}, worst {step[-1]:.1%}; memory median {statistics.median(mem):.1%}, "
          f"worst {mem[-1]:.1%}")
    return 0
