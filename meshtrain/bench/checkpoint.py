"""``meshtrain bench checkpoint``: peak resident memory of a rank while it saves and loads a ZeRO
checkpoint, against its peak during training steps.

Each rank runs in its own process (shm transport). The peak is the kernel's high-water mark of the
process's resident set (``VmHWM`` in ``/proc/self/status``), reset to the current RSS by writing
``5`` to ``/proc/self/clear_refs`` just before each phase and read just after it, so every figure
is the true peak of that phase alone (anonymous and file-backed pages alike), not a sample.

Two runs of fresh processes: (1) build, train ``steps`` steps [train peak], save [save peak], load
into the same model [load peak]; (2) a resume: build, load the checkpoint [load peak], then train
``steps`` steps [train peak].
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

import torch

MODEL = dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=256)


def _status(field: str) -> int:
    """A ``kB`` field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Make VmHWM the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _phase(out: dict[str, Any], name: str, fn: Any) -> None:
    """Run ``fn`` and record its peak RSS, the RSS it started from, and its time."""
    import gc

    gc.collect()
    _reset_peak()
    out[f"{name}_start"] = _status("VmRSS")
    t0 = time.perf_counter()
    fn()
    out[f"{name}_s"] = time.perf_counter() - t0
    out[f"{name}_peak"] = _status("VmHWM")


def worker(rank: int, model_kw: dict[str, int], zero_stage: int, steps: int, batch: int, seq: int, root: str,
           resume: bool) -> dict[str, Any]:
    """One rank (see the module docstring); returns its peaks (bytes) and times (s) per phase."""
    from .. import comm
    from ..mesh import Mesh
    from ..models.llama import LlamaConfig
    from ..parallel.parallel_model import ParallelModel
    from ..parallel.parallelize import ParallelConfig
    from ..train.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)  # the ranks share the cores
    cfg = LlamaConfig(**model_kw)
    world = comm.current().world.size
    out: dict[str, Any] = {"rank": rank}
    model = ParallelModel(cfg, Mesh(dp=world), ParallelConfig(zero_stage=zero_stage), seed=0)
    opt = model.build_optimizer(torch.optim.AdamW, lr=3e-4)
    out["build_peak"] = _status("VmHWM")
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (steps, batch, seq + 1), generator=g)

    def train() -> None:
        for d in data:
            model.forward_backward(d[:, :-1], d[:, 1:])
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()

    if resume:
        _phase(out, "load", lambda: load_checkpoint(root, model, opt))
        _phase(out, "train", train)
    else:
        _phase(out, "train", train)
        _phase(out, "save", lambda: save_checkpoint(root, steps, model, opt, {}))
        _phase(out, "load", lambda: load_checkpoint(root, model, opt))
    return out


def run(world: int, model_kw: dict[str, int], zero_stage: int, steps: int, batch: int, seq: int,
        directory: str | None, timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Both runs (train-save-load, then resume) on ``world`` processes; per-rank records of each."""
    from ..comm.launch import spawn

    root = tempfile.mkdtemp(prefix="meshtrain-bench-ckpt-", dir=directory)
    try:
        first = spawn(world, worker, model_kw, zero_stage, steps, batch, seq, root, False, timeout=timeout,
                      transport="shm", comm_timeout=timeout)
        size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs)
        resumed = spawn(world, worker, model_kw, zero_stage, steps, batch, seq, root, True, timeout=timeout,
                        transport="shm", comm_timeout=timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"train_save_load": first, "resume": resumed, "checkpoint_bytes": size}


def _table(title: str, recs: list[dict[str, Any]], phases: list[str]) -> str:
    mb = 1 << 20
    head = f"{'rank':>4} " + " ".join(f"{p + ' peak MiB':>16}" for p in phases) + \
        " " + " ".join(f"{p + '/train':>12}" for p in phases if p != "train")
    lines = [title, head]
    for r in recs:
        cells = " ".join(f"{r[p + '_peak'] / mb:16.0f}" for p in phases)
        ratios = " ".join(f"{r[p + '_peak'] / r['train_peak']:12.3f}" for p in phases if p != "train")
        lines.append(f"{r['rank']:>4} {cells} {ratios}")
    worst = {p: max(r[p + "_peak"] / r["train_peak"] for r in recs) for p in phases if p != "train"}
    lines.append("max ratio over ranks: " + ", ".join(f"{p}/train = {v:.3f}" for p, v in worst.items()))
    secs = {p: max(r[p + "_s"] for r in recs) for p in phases}
    lines.append("slowest rank, seconds: " + ", ".join(f"{p} {v:.1f}" for p, v in secs.items()))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``meshtrain bench checkpoint``."""
    p.add_argument("--world", type=int, default=4, help="processes (dp degree)")
    p.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--dim", type=int, default=MODEL["dim"])
    p.add_argument("--layers", type=int, default=MODEL["n_layers"])
    p.add_argument("--vocab", type=int, default=MODEL["vocab_size"])
    p.add_argument("--steps", type=int, default=2, help="training steps per run")
    p.add_argument("--batch", type=int, default=4, help="global batch (a multiple of --world)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: the temp dir)")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--json", default=None, help="also write the records here")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark and print per-rank peaks and the ratios to the training peak."""
    import sys

    from ..models.llama import Llama, LlamaConfig

    kw = dict(MODEL, dim=args.dim, n_layers=args.layers, vocab_size=args.vocab)
    problem = ("--world must be >= 2" if args.world < 2 else "--steps must be >= 1" if args.steps < 1 else
               f"--batch {args.batch} is not a multiple of --world {args.world}" if args.batch % args.world else
               f"--seq {args.seq} exceeds the model's max_seq_len {kw['max_seq_len']}" if args.seq > kw["max_seq_len"]
               else None)
    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in Llama(LlamaConfig(**kw)).parameters())
    except ValueError as exc:
        problem = problem or f"model: {exc} (set --dim to a multiple of {MODEL['n_heads']} heads)"
    if problem:
        print(f"meshtrain bench checkpoint: error: {problem}", file=sys.stderr)
        return 2
    print(f"Llama {n / 1e6:.0f}M parameters ({kw}), dp{args.world} ZeRO-{args.zero_stage}, {args.world} "
          f"processes over shm, {args.steps} steps of batch {args.batch} x {args.seq}; peak = VmHWM per phase")
    res = run(args.world, kw, args.zero_stage, args.steps, args.batch, args.seq, args.dir, args.timeout)
    print(f"checkpoint: {res['checkpoint_bytes'] / (1 << 20):.0f} MiB on disk")
    print(_table("run 1: train, save, load in place", res["train_save_load"], ["train", "save", "load"]))
    print(_table("run 2: resume in fresh processes (load, then train)", res["resume"], ["train", "load"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "model": kw, **vars(args), **res}, f, indent=1)
    return 0


if __name__ == "__main__":  # python -m meshtrain.bench.checkpoint (same options)
    _parser = argparse.ArgumentParser(prog="python -m meshtrain.bench.checkpoint")
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
