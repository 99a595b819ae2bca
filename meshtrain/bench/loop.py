"""``meshtrain bench loop``: ``meshtrain train`` on one rank against a plain PyTorch loop of the same
model, in the same run.

The plain loop is what a careful user writes without meshtrain: the same ``Llama`` (SDPA
attention), ``torch.autocast`` for bf16, each block ``torch.compile``-d when asked, AdamW (fused on
a GPU), ``clip_grad_norm_`` and one ``loss.item()`` per step. meshtrain's side is the real trainer
(``train.train``: data loader, metrics, its parallel model on a world of one). Trials alternate
between the two, each in a fresh thread; each reports the median step time of its timed steps (the
first ``warmup`` steps, which compile, are not timed), and the ratio is taken per trial.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from ..comm.device import on_host
from ..models.llama import PRESETS


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain bench loop``."""
    p.add_argument("--preset", default="5m", choices=sorted(PRESETS), help="model size (default: 5m)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="timed steps per trial")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--trials", type=int, default=3, help="interleaved trials; medians and spread are reported")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="compute dtype (autocast)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block, on both sides")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    p.add_argument("--json", dest="json_path", help="write the trials and the summary here")


def _config(args: argparse.Namespace, out: str) -> Any:
    from ..train.config import load_config

    return load_config(None, [
        f"--model.preset={args.preset}", f"--train.global_batch={args.batch}", f"--train.seq_len={args.seq}",
        f"--train.steps={args.warmup + args.steps}", "--train.warmup_steps=1", f"--train.precision={args.precision}",
        f"--train.compile={str(args.compile).lower()}", f"--train.device={args.device}", "--parallel.dp=1",
        "--parallel.tp=1", "--comm.transport=local", "--checkpoint.enabled=false", f"--out={out}"])


def _meshtrain_trial(args: argparse.Namespace) -> tuple[float, dict[str, Any]]:
    """The median timed step of ``meshtrain train``, and its last metrics record."""
    from .. import comm
    from ..train.trainer import train

    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-loop-") as out:
        config = _config(args, out)
        comm.run_local(1, lambda rank: train(config, progress=False), timeout=3600)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    timed = rows[args.warmup:]
    return statistics.median(r["step_s"] for r in timed), timed[-1]


def _plain_trial(args: argparse.Namespace, cfg: Any, device: torch.device) -> float:
    """The median timed step of the plain PyTorch loop."""
    from ..models.llama import Llama, init_weights

    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    init_weights(model, 0)
    if args.compile:
        for block in model.layers.values():
            block.compile()
    fused = {"fused": True} if not on_host(device) else {}  # as the trainer: fused AdamW on a GPU
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    times = []
    for step in range(args.warmup + args.steps):
        data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=args.precision != "fp32"):
            logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the loop's one read (logging), which also waits for the GPU
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _in_a_thread(fn: Any, *args: Any, name: str = "plain-loop") -> Any:
    """``fn(*args)`` in a fresh thread called ``name``, as ``comm.run_local`` runs the trainer: on
    the CPU, torch ops of a fresh thread measured about 10 % slower here than the main thread's
    (each thread has its own OpenMP team), a difference of context, not of the two loops."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    t = threading.Thread(target=target, name=name)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Alternate trials of both sides; per-trial and median tokens/s, MFU and the ratio."""
    from ..train.config import model_config
    from ..hardware import device_peak
    from ..train.tokenizer import prepare_data
    from ..train.trainer import resolve_device

    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-loop-") as out:
        config = _config(args, out)
    device = resolve_device(args.device)
    _, tokenizer, _ = prepare_data(config.data)  # the trainer's vocabulary: both sides build the same model
    cfg = model_config(config, tokenizer.vocab_size)
    peak = device_peak(device)
    tokens = args.batch * args.seq
    trials = []
    for i in range(args.trials):
        mt_s, record = _meshtrain_trial(args)
        plain_s = _in_a_thread(_plain_trial, args, cfg, device)
        flops = record["mfu"] * peak * record["step_s"]  # the trainer's FLOPs per step
        trials.append({"trial": i, "meshtrain_tokens_per_s": tokens / mt_s, "plain_tokens_per_s": tokens / plain_s,
                       "meshtrain_mfu": flops / mt_s / peak, "plain_mfu": flops / plain_s / peak,
                       "ratio": plain_s / mt_s})
        print(f"trial {i}: meshtrain {tokens / mt_s:,.0f} tok/s, plain {tokens / plain_s:,.0f} tok/s, "
              f"ratio {plain_s / mt_s:.3f}", flush=True)
    med = {k: statistics.median(t[k] for t in trials) for k in trials[0] if k != "trial"}
    ratios = [t["ratio"] for t in trials]
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "params": _params(cfg), "peak_flops": peak, "trials": trials, "median": med,
            "ratio_range": [min(ratios), max(ratios)]}


def _params(cfg: Any) -> int:
    from ..models.llama import Llama, num_params

    with torch.device("meta"):
        return num_params(Llama(cfg))


def main(args: argparse.Namespace) -> int:
    """Run and print the summary; 2 on bad input."""
    for name in ("batch", "seq", "steps", "trials"):
        if getattr(args, name) < 1:
            return _fail(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 1:
        return _fail(f"--warmup must be >= 1 (the first step compiles and allocates), got {args.warmup}")
    if args.seq > PRESETS[args.preset].max_seq_len:
        return _fail(f"--seq {args.seq} exceeds the {args.preset} preset's max_seq_len "
                     f"{PRESETS[args.preset].max_seq_len}; use a shorter --seq")
    if args.json_path and not os.path.isdir(os.path.dirname(os.path.abspath(args.json_path))):
        return _fail(f"--json: directory of {args.json_path!r} does not exist; create it first")
    from ..errors import ConfigError

    try:
        result = run(args)
    except ConfigError as e:
        return _fail(str(e))
    m = result["median"]
    print(f"# {args.preset} ({result['params'] / 1e6:.1f}M params), batch {args.batch} x seq {args.seq}, "
          f"{args.precision}{', compiled' if args.compile else ''}, on {result['device']}")
    print(f"meshtrain train : {m['meshtrain_tokens_per_s']:12,.0f} tok/s   MFU {m['meshtrain_mfu']:6.1%}")
    print(f"plain PyTorch   : {m['plain_tokens_per_s']:12,.0f} tok/s   MFU {m['plain_mfu']:6.1%}")
    lo, hi = result["ratio_range"]
    print(f"ratio meshtrain/plain: median {m['ratio']:.3f} over {args.trials} trials (range {lo:.3f}-{hi:.3f})")
    if args.json_path:
        from ..files import write_json_atomic

        write_json_atomic(args.json_path, {"config": {k: v for k, v in vars(args).items() if k != "func"},
                                           **result})
        print(f"# wrote {args.json_path}")
    return 0 if all(math.isfinite(t["ratio"]) for t in result["trials"]) else 1


def _fail(msg: str) -> int:
    print(f"meshtrain bench loop: error: {msg}", file=sys.stderr)
    return 2
