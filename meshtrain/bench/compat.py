"""``meshtrain bench compat``: one torch.distributed-style training loop, run with
``import torch.distributed as dist`` (gloo) and with ``import meshtrain.comm as dist`` (on the torch
transport, and on the shm transport), in the same run.

The loop is what a torch.distributed user writes by hand: the config arrives from rank 0 by
``broadcast_object_list``; dp2 x pp2 over 4 processes, stage 0 (even ranks) sends its activations to
stage 1 and gets their gradients back with ``batch_isend_irecv``; each stage all-reduces its weight
gradient over its data-parallel pair (``new_subgroups_by_enumeration``) and steps SGD. The weights
are ``width`` x ``width`` fp32, so the all-reduce moves ``4 * width**2`` bytes and each p2p message
``4 * batch * width``. Trials alternate between the three; each reports the median step time.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from typing import Any

import torch

WORLD = 4
MODES = {"torch-gloo": ("torch.distributed", "torch"), "meshtrain-torch": ("meshtrain.comm", "torch"),
         "meshtrain-shm": ("meshtrain.comm", "shm")}
PEER = "torch-gloo"


def initial_weight(seed: int, stage: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stage ``stage``'s starting weight (width x width)."""
    g = torch.Generator().manual_seed(seed + stage)
    return torch.randn(width, width, generator=g, dtype=dtype) / width ** 0.5


def next_batch(gen: torch.Generator, batch: int, width: int, dtype: torch.dtype = torch.float32
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The next (input, target) of a data-parallel replica's stream (``gen`` seeded 100 + replica)."""
    return (torch.randn(batch, width, generator=gen, dtype=dtype),
            torch.randn(batch, width, generator=gen, dtype=dtype))


def loop(dist: Any, rank: int, width: int, batch: int, steps: int, warmup: int = 0, lr: float = 1e-3,
         seed: int = 0, dtype: torch.dtype = torch.float32, dp_group: Any = None) -> dict[str, Any]:
    """The training loop, written against ``dist`` (either module): loss = mean((x W0 W1 - y)^2)
    with W0 on stage 0 and W1 on stage 1. Returns the timed step times, the final weight and the
    losses (stage 1). ``dp_group``: this rank's data-parallel pair, made here if not given."""
    cfg = [{"width": width, "batch": batch, "steps": steps + warmup, "lr": lr, "seed": seed}] if rank == 0 else [None]
    dist.broadcast_object_list(cfg, src=0)
    c = cfg[0]
    if dp_group is None:
        dp_group, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    stage, replica = rank % 2, rank // 2
    w = initial_weight(c["seed"], stage, c["width"], dtype).requires_grad_()
    data = torch.Generator().manual_seed(100 + replica)
    times, losses = [], []
    for step in range(c["steps"]):
        x, y = next_batch(data, c["batch"], c["width"], dtype)
        t0 = time.perf_counter()
        if stage == 0:
            h = x @ w
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, h.detach().contiguous(), rank + 1)]):
                work.wait()
            dh = torch.empty_like(h)
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, dh, rank + 1)]):
                work.wait()
            h.backward(dh)
        else:
            h = torch.empty(c["batch"], c["width"], dtype=dtype)
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, h, rank - 1)]):
                work.wait()
            h.requires_grad_()
            loss = ((h @ w - y) ** 2).mean()
            loss.backward()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, h.grad.contiguous(), rank - 1)]):
                work.wait()
            losses.append(loss.item())
        dist.all_reduce(w.grad, op=dist.ReduceOp.SUM, group=dp_group)
        with torch.no_grad():
            w -= c["lr"] * w.grad / dist.get_world_size(dp_group)
        w.grad = None
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return {"times": times, "w": w.detach(), "losses": losses}


def _worker(rank: int, module: str, width: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # four processes share the cores, for every mode alike
    out = loop(importlib.import_module(module), rank, width, batch, steps, warmup)
    return {**out, "step_s": statistics.median(out["times"])}


def run(width: int, batch: int, steps: int, warmup: int, trials: int) -> dict[str, Any]:
    """Alternate trials of every mode; per mode the median over trials of the slowest rank's median step."""
    from ..comm.launch import spawn

    per: dict[str, list[float]] = {m: [] for m in MODES}
    final: dict[str, Any] = {}
    for _ in range(trials):
        for mode, (module, transport) in MODES.items():
            res = spawn(WORLD, _worker, module, width, batch, steps, warmup, timeout=600, transport=transport)
            per[mode].append(max(r["step_s"] for r in res))
            final[mode] = res
    med = {m: statistics.median(v) for m, v in per.items()}
    same = all(torch.equal(final[m][r]["w"], final[PEER][r]["w"]) for m in MODES for r in range(WORLD))
    return {"step_s": med, "trials_step_s": per, "ratio": {m: med[PEER] / med[m] for m in MODES},
            "same_weights": same, "losses": {m: final[m][1]["losses"][-1:] for m in MODES}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain bench compat``."""
    p.add_argument("--width", type=int, default=1024, help="weights are width x width fp32 (default 1024: 4 MB)")
    p.add_argument("--batch", type=int, default=64, help="rows per micro-batch (p2p messages: 4 x batch x width B)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--trials", type=int, default=3, help="interleaved trials; the median is reported")
    p.add_argument("--json", dest="json_path", help="write the result here")


def main(args: argparse.Namespace) -> int:
    """Run and print the table; 2 on bad input, 1 if the three runs' weights differ."""
    for name in ("width", "batch", "steps", "trials"):
        if getattr(args, name) < 1:
            print(f"meshtrain bench compat: error: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.json_path and not os.path.isdir(os.path.dirname(os.path.abspath(args.json_path))):
        print(f"meshtrain bench compat: error: --json: directory of {args.json_path!r} does not exist; create it "
              f"first", file=sys.stderr)
        return 2
    res = run(args.width, args.batch, args.steps, args.warmup, args.trials)
    print(f"# dp2 x pp2 torch.distributed-style loop, 4 processes, weights {args.width}x{args.width} fp32, "
          f"batch {args.batch}, {args.steps} timed steps, median of {args.trials} trials")
    print("# mode              step ms   vs torch-gloo   trials ms")
    for m in MODES:
        trials = " ".join(f"{t * 1e3:.1f}" for t in res["trials_step_s"][m])
        print(f"  {m:16s} {res['step_s'][m] * 1e3:9.2f}   {res['ratio'][m]:12.2f}   {trials}")
    print(f"# final weights equal in all three: {res['same_weights']}")
    if args.json_path:
        from .report import write_json_atomic

        write_json_atomic(args.json_path, {"config": {k: v for k, v in vars(args).items() if k != "func"},
                                           "step_s": res["step_s"], "trials_step_s": res["trials_step_s"],
                                           "ratio": res["ratio"], "same_weights": res["same_weights"]})
        print(f"# wrote {args.json_path}")
    return 0 if res["same_weights"] else 1
