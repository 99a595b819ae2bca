"""``meshtrain bench compat``: one torch.distributed-style training loop, run with
``import torch.distributed as dist`` (gloo) and with ``import meshtrain.comm as dist`` (on the torch
transport, and on the shm transport), in the same run.

The loop is what a torch.distributed user writes by hand: the config arrives from rank 0 by
``broadcast_object_list``; dp2 x pp2 over 4 processes, stage 0 (even ranks) sends its activations to
stage 1 and gets their gradients back with ``batch_isend_irecv``; each stage all-reduces its weight
gradient over its data-parallel pair (``new_subgroups_by_enumeration``) and steps SGD. The weights
are ``width`` x ``width`` fp32, so the all-reduce moves ``4 * width**2`` bytes and each p2p message
``4 * batch * width``. Trials alternate between the three; each reports the median step time.

With ``--layouts dp4,pp2xdp2,tp2xdp2,cp2xdp2`` it runs instead a small Llama with 4D parallelism
(``compat_llama``: TP, ring-attention CP, 1F1B PP, DP), written against torch.distributed's API,
under ``torch.distributed`` (gloo) and under ``meshtrain.comm`` (which the worker initialises itself
with ``init_process_group``, as a torchrun script does), and compares their loss sequences bitwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import statistics
import sys
import time
from typing import Any

import torch

from . import compat_llama
from .comm_clock import CommClock

WORLD = 4
MODES = {"torch-gloo": ("torch.distributed", "torch"), "meshtrain-torch": ("meshtrain.comm", "torch"),
         "meshtrain-shm": ("meshtrain.comm", "shm")}
PEER = "torch-gloo"
LLAMA_MODES = ("torch-gloo", "meshtrain")  # --layouts: torch.distributed itself, and meshtrain.comm
FLOOR = "floor"  # --floor: the same loop with communication that costs nothing (null_dist.py)
LLAMA_CONFIG = compat_llama.LlamaConfig()  # the model of --layouts (tests shrink it)
LOSS_RTOL = 1e-5  # the largest relative loss difference allowed between modes where sums have > 2 members


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


def _llama_worker(rank: int, mode: str, sizes: dict[str, int], cfg: Any, steps: int, warmup: int
                  ) -> dict[str, Any]:
    torch.set_num_threads(1)  # the processes share the cores, for every mode alike
    if mode == "meshtrain":
        import meshtrain.comm as dist

        dist.init_process_group("gloo")  # torch.distributed is up (as torchrun + init leave it)
    elif mode == FLOOR:
        from .null_dist import NullDist

        dist = NullDist()
    else:
        import torch.distributed as dist
    clock = CommClock(dist)
    out = compat_llama.loop(clock, rank, sizes, cfg, steps, warmup, on_timed=clock.reset)
    return {"step_s": statistics.median(out["times"]), "losses": out["losses"], "comm_s": clock.seconds / steps}


def _compare(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two loss sequences (0.0: bitwise equal)."""
    return max((abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)), default=0.0) if a != b else 0.0


def losses_agree(rel: float, widest: int) -> bool:
    """Whether two modes' losses, ``rel`` apart (largest relative difference), agree as they must
    for a layout whose widest sum has ``widest`` members: bitwise with at most 2 (a + b == b + a),
    within ``LOSS_RTOL`` beyond (gloo adds more members in its own order)."""
    return rel <= LOSS_RTOL and (rel == 0.0 or widest > 2)


def _run_on_hosts(hosts: int, mode: str, sizes: dict[str, int], cfg: Any, steps: int, warmup: int
                  ) -> dict[str, Any]:
    """One run of ``mode`` on ``hosts`` simulated hosts (their own hostname and /dev/shm, one
    torchrun each): the slowest rank's median step and the losses."""
    from . import compat_hosts_worker
    from .comm_hosts import run_hosts

    world = compat_llama.world_size(sizes)
    return run_hosts(hosts, world // hosts, compat_hosts_worker.config(mode, sizes, cfg, steps, warmup),
                     timeout=600, worker="meshtrain.bench.compat_hosts_worker")


def run_layouts(layouts: dict[str, dict[str, int]], cfg: Any, steps: int, warmup: int, trials: int,
                hosts: int = 1, floor: bool = False) -> dict[str, Any]:
    """Per layout (name: sizes), trials alternate between the modes (their order flips every
    trial); per mode the median over trials of the slowest rank's median step, and every trial's
    loss sequence compared with torch-gloo's first one (``ok``: see ``losses_agree``). ``hosts`` > 1:
    every run spans that many simulated hosts (consecutive ranks share one). ``floor`` (one host):
    a third mode, ``FLOOR``, whose communication costs nothing; its step over torch-gloo's is the
    least ratio any communication library could reach (``floor_ratio``); its losses are not compared."""
    from ..comm.launch import spawn

    out: dict[str, Any] = {}
    for name, sizes in layouts.items():
        world = compat_llama.world_size(sizes)
        modes = LLAMA_MODES + ((FLOOR,) if floor and hosts == 1 else ())
        per: dict[str, list[float]] = {m: [] for m in modes}
        losses: dict[str, list[list[float]]] = {m: [] for m in modes}
        comm: dict[str, list[float]] = {m: [] for m in modes}  # s/step inside communication calls
        rank_comm: dict[str, list[list[float]]] = {m: [] for m in modes}  # per rank (one host)
        for t in range(trials):
            for mode in (modes if t % 2 == 0 else modes[::-1]):
                # transport=None: only torch.distributed is initialised, so the torch-gloo run is
                # pure torch and the meshtrain run builds its communicator itself
                if hosts > 1:
                    one = _run_on_hosts(hosts, mode, sizes, cfg, steps, warmup)
                    per[mode].append(one["step_s"])
                    comm[mode].append(one["comm_s"])
                    losses[mode].append(one["losses"])
                    continue
                res = spawn(world, _llama_worker, mode, sizes, cfg, steps, warmup, timeout=600, transport=None)
                per[mode].append(max(r["step_s"] for r in res))
                comm[mode].append(statistics.mean(r["comm_s"] for r in res))
                rank_comm[mode].append([r["comm_s"] for r in res])
                losses[mode].append(res[0]["losses"])
        med = {m: statistics.median(v) for m, v in per.items()}
        ref = losses[PEER][0]
        rel = max(_compare(seq, ref) for m in LLAMA_MODES for seq in losses[m])
        widest = compat_llama.max_reduction(sizes)
        out[name] = {
            "sizes": sizes, "step_s": med, "trials_step_s": per, "ratio": med["meshtrain"] / med[PEER],
            "comm_s": {m: statistics.median(v) for m, v in comm.items()}, "trials_comm_s": comm,
            "trials_rank_comm_s": rank_comm,
            "losses": {m: losses[m] for m in LLAMA_MODES}, "bitwise_equal": rel == 0.0, "max_rel_diff": rel,
            "max_reduction": widest, "ok": losses_agree(rel, widest)}
        if FLOOR in med:
            out[name]["floor_ratio"] = med[FLOOR] / med[PEER]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain bench compat``."""
    p.add_argument("--width", type=int, default=1024, help="weights are width x width fp32 (default 1024: 4 MB)")
    p.add_argument("--batch", type=int, default=64, help="rows per micro-batch (p2p messages: 4 x batch x width B)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; with --layouts 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; with --layouts 2)")
    p.add_argument("--trials", type=int, default=3, help="interleaved trials; the median is reported")
    p.add_argument("--json", dest="json_path", help="write the result here")
    p.add_argument("--layouts", help="run the 4D-parallel Llama instead, one comma-separated layout after another "
                                     f"({compat_llama.LAYOUT_HELP}), e.g. dp4,pp2xdp2,tp2xdp2,cp2xdp2; "
                                     "--width and --batch do not apply")
    p.add_argument("--world", type=int, default=WORLD, help="processes of each --layouts run (default 4)")
    p.add_argument("--floor", action="store_true", help="--layouts on one host: also run the loop with "
                                                        "communication that costs nothing, the least step time "
                                                        "any library could reach here (its losses are meaningless)")
    p.add_argument("--hosts", type=int, default=1, help="--layouts runs span this many simulated hosts (own "
                                                        "hostname and /dev/shm, one torchrun each; default 1)")


def main(args: argparse.Namespace) -> int:
    """Run and print the table; 2 on bad input, 1 if the three runs' weights differ (with
    ``--layouts``: if losses differ more than allowed, see ``run_layouts``)."""
    llama = args.layouts is not None
    if args.steps is None:
        args.steps = 10 if llama else 20  # a Llama step costs ~10x a --width 1024 step
    if args.warmup is None:
        args.warmup = 2 if llama else 3
    for name in ("width", "batch", "steps", "trials"):
        if getattr(args, name) < 1:
            print(f"meshtrain bench compat: error: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.json_path and not os.path.isdir(os.path.dirname(os.path.abspath(args.json_path))):
        print(f"meshtrain bench compat: error: --json: directory of {args.json_path!r} does not exist; create it "
              f"first", file=sys.stderr)
        return 2
    if llama:
        return _main_layouts(args)
    res = run(args.width, args.batch, args.steps, args.warmup, args.trials)
    print(f"# dp2 x pp2 torch.distributed-style loop, 4 processes, weights {args.width}x{args.width} fp32, "
          f"batch {args.batch}, {args.steps} timed steps, median of {args.trials} trials")
    print("# mode              step ms   vs torch-gloo   trials ms")
    for m in MODES:
        trials = " ".join(f"{t * 1e3:.1f}" for t in res["trials_step_s"][m])
        print(f"  {m:16s} {res['step_s'][m] * 1e3:9.2f}   {res['ratio'][m]:12.2f}   {trials}")
    print(f"# final weights equal in all three: {res['same_weights']}")
    if args.json_path:
        from ..files import write_json_atomic

        write_json_atomic(args.json_path, {"config": {k: v for k, v in vars(args).items() if k != "func"},
                                           "step_s": res["step_s"], "trials_step_s": res["trials_step_s"],
                                           "ratio": res["ratio"], "same_weights": res["same_weights"]})
        print(f"# wrote {args.json_path}")
    return 0 if res["same_weights"] else 1


def _main_layouts(args: argparse.Namespace) -> int:
    """``--layouts``: check them, run, print the table; 1 if losses differ more than allowed."""
    cfg = LLAMA_CONFIG
    layouts: dict[str, dict[str, int]] = {}
    problem = None
    if args.world < 1:
        problem = f"--world must be >= 1, got {args.world}"
    elif args.hosts < 1 or args.world % args.hosts:
        problem = f"--hosts must be >= 1 and divide --world {args.world}, got {args.hosts}"
    elif args.floor and args.hosts > 1:
        problem = "--floor runs on one host only (a floor across hosts would ignore the network); drop --hosts"
    elif args.hosts > 1:
        from ..simhosts import namespaces_unavailable

        why = namespaces_unavailable()
        if why:
            problem = f"--hosts {args.hosts} needs simulated hosts, which cannot run here: {why}; use --hosts 1"
    if problem:
        print(f"meshtrain bench compat: error: {problem}", file=sys.stderr)
        return 2
    try:
        names = [n.strip() for n in args.layouts.split(",") if n.strip()]
        if not names:
            raise ValueError(f"--layouts is empty; give e.g. dp4,pp2xdp2 ({compat_llama.LAYOUT_HELP})")
        for name in names:
            if name in layouts:
                raise ValueError(f"{name} is given twice; give each layout once")
            sizes = compat_llama.parse_layout(name, args.world)
            compat_llama.check_layout(cfg, sizes)
            layouts[name] = sizes
    except ValueError as exc:
        print(f"meshtrain bench compat: error: --layouts: {exc}", file=sys.stderr)
        return 2
    res = run_layouts(layouts, cfg, args.steps, args.warmup, args.trials, args.hosts, args.floor)
    print(f"# Llama dim {cfg.dim}, {cfg.layers} layers, {cfg.heads} heads, ffn {cfg.ffn}, vocab {cfg.vocab}, "
          f"seq {cfg.seq}, fp32; global batch {cfg.global_batch} in {cfg.micro_batches} micro-batches per "
          f"replica; {args.world} processes on {args.hosts} host(s), {args.steps} timed steps (+{args.warmup}), median of {args.trials} trials")
    print("# layout        torch-gloo ms  meshtrain ms  meshtrain/torch  comm ms/step (torch | meshtrain)  "
          "losses (all steps, all trials)          trials ms: torch-gloo | meshtrain")
    for name, r in res.items():
        same = "bitwise equal" if r["bitwise_equal"] else f"max rel diff {r['max_rel_diff']:.1e}"
        same += "" if r["ok"] else " (FAIL)"
        trials = " | ".join(" ".join(f"{t * 1e3:.1f}" for t in r["trials_step_s"][m]) for m in LLAMA_MODES)
        comm = f"{r['comm_s'][PEER] * 1e3:.1f} | {r['comm_s']['meshtrain'] * 1e3:.1f}"
        print(f"  {name:14s} {r['step_s'][PEER] * 1e3:11.1f}  {r['step_s']['meshtrain'] * 1e3:12.1f}  "
              f"{r['ratio']:15.2f}  {comm:33s}  {same:37s}  {trials}")
        if "floor_ratio" in r:
            print(f"  {'':14s} floor (communication free) {r['step_s'][FLOOR] * 1e3:.1f} ms = "
                  f"{r['floor_ratio']:.2f} x torch-gloo; trials ms "
                  + " ".join(f"{t * 1e3:.1f}" for t in r["trials_step_s"][FLOOR]))
    print(f"# losses must be bitwise equal where every sum has <= 2 members (tp, dp x cp <= 2), and within "
          f"{LOSS_RTOL:g} relative elsewhere (gloo adds > 2 members in its own order); comm ms/step: the mean "
          f"rank's time inside collectives and p2p waits per timed step (waits for slower peers included)")
    if args.json_path:
        from ..files import write_json_atomic

        write_json_atomic(args.json_path, {"config": {k: v for k, v in vars(args).items() if k != "func"},
                                           "model": dataclasses.asdict(cfg), "layouts": res})
        print(f"# wrote {args.json_path}")
    return 0 if all(r["ok"] for r in res.values()) else 1
