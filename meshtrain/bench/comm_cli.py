"""Argument handling and printing for ``meshtrain bench comm``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..comm.transport import registry
from . import report
from .comm import DTYPES, OPS, memcpy_gbps, run_transport

ALGOS = ("ring", "tree", "recursive_doubling", "halving_doubling", "hierarchical", "direct", "native", "shm",
         "shm_symmetric", "auto")


def only_on() -> dict[str, str]:
    """Algorithm -> the one transport it exists on (the registry entries' ``algorithms``)."""
    return {a: spec.name for spec in registry.specs() for a in spec.algorithms}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``meshtrain bench comm``."""
    p.add_argument("--transport", default=None,
                   help=f"comma list of {','.join(registry.names())} (default: torch = gloo processes; shm = shared "
                        "memory; local = threads); not with --hosts")
    p.add_argument("--hosts", type=int, default=None, metavar="N",
                   help="run across N simulated hosts (Linux namespaces, root: each has its own hostname and "
                        "/dev/shm and runs one torchrun) with --world ranks on EACH host, so N x WORLD ranks in all; "
                        "meshtrain uses shared memory inside a host and gloo between hosts "
                        "(init(transport='auto')); times algorithm=auto plus --algorithms against "
                        "torch.distributed's gloo collective in the same processes (interleaved trials) and reports "
                        "the busbw ratio; ops all_reduce, all_gather, reduce_scatter")
    p.add_argument("--world", default="2",
                   help="number of ranks (with --hosts: ranks per host); a comma list runs each (default: 2)")
    p.add_argument("--op", default="all_reduce", choices=OPS, help="collective to time")
    p.add_argument("--algorithms", default=None,
                   help="comma list (default: ring,halving_doubling,shm,native; with --hosts: auto); "
                        "'native' is torch.distributed's own (torch transport only), "
                        "'shm' works on shared buffers (shm transport only); 'shm_symmetric' is shm "
                        "all_reduce of a tensor from comm.symmetric_empty, reduced in place; with --hosts "
                        "auto and gloo's collective always run, and shm/shm_symmetric cannot (they need one host)")
    p.add_argument("--sizes", default="1K:64M", help="LO:HI geometric range or comma list, e.g. 1K:64M or 16M,64M")
    p.add_argument("--factor", type=int, default=4, help="ratio between consecutive sizes of a LO:HI range")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--iters", type=int, default=0, help="timed iterations per size (default: enough for ~0.3 s)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--trials", type=int, default=3, help="interleaved trials per size; the median is reported")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one collective may take")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="turn off meshtrain's cross-rank metadata check (shows its cost; native never has it)")
    p.add_argument("--calibrate", action="store_true", help="fit and print the alpha-beta-gamma model and crossovers")
    p.add_argument("--floor", action="store_true",
                   help="also time WORLD processes each copying SIZE at once: no collective on this host can beat it")
    p.add_argument("--front-end", dest="front_end", action="store_true",
                   help="time what each call costs before its data moves: a one-rank world through meshtrain.comm "
                        "against torch.distributed's own (bench/front_end.py); other options are ignored but --trials")
    p.add_argument("--explain", action="store_true",
                   help="print what auto learned on the world: per size, the algorithm it keeps and each candidate's "
                        "measured time (comm/tune.py)")
    p.add_argument("--json", dest="json_path", help="write one record per transport/op/algorithm/world/size")
    p.add_argument("--plot", dest="plot_path", help="write a PNG of busbw against size")


def _fail(msg: str) -> int:
    print(f"meshtrain bench comm: error: {msg}", file=sys.stderr)
    return 2


def _worlds_and_sizes(args: argparse.Namespace, example: str, world_name: str) -> tuple[list[int], list[int]] | int:
    """--world and --sizes parsed, or the exit code of a one-line error naming them."""
    try:
        worlds = [int(w) for w in args.world.split(",")]
        sizes = report.parse_sizes(args.sizes, args.factor)
    except ValueError as exc:
        return _fail(f"{exc} (e.g. {example})")
    if any(w < 1 for w in worlds) or not sizes:
        return _fail(f"{world_name} must be >= 1 and --sizes must name at least one size")
    return worlds, sizes


def main(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; returns the exit code."""
    if args.front_end:
        from . import front_end

        if args.trials < 1:
            return _fail(f"--trials must be >= 1, got {args.trials}")
        res = front_end.run(trials=args.trials)
        print("\n".join(front_end.report(res)))
        if args.json_path:
            report.write_json([dict(r, call=k) for k, r in res.items()], args.json_path, {"target_us": front_end.TARGET_US})
            print(f"# wrote {args.json_path}")
        return 0
    if args.hosts is not None:
        return _main_hosts(args)
    transports = [t.strip() for t in (args.transport or "torch").split(",") if t.strip()]
    algos = [a.strip() for a in (args.algorithms or "ring,halving_doubling,shm,native").split(",") if a.strip()]
    known = registry.names()
    bad = [t for t in transports if t not in known]
    if bad or not transports:
        return _fail(f"unknown transport {bad or transports}: use {', '.join(known[:-1])} and/or {known[-1]}, "
                     "e.g. --transport shm,torch")
    unknown = [a for a in algos if a not in ALGOS]
    if unknown or not algos:
        return _fail(f"unknown algorithm {unknown or algos}: choose from {', '.join(ALGOS)}")
    if "shm_symmetric" in algos and args.op != "all_reduce":
        return _fail(f"shm_symmetric runs all_reduce only, not {args.op}: drop it or use --op all_reduce")
    parsed = _worlds_and_sizes(args, "--world 2,4 --sizes 1K:64M", "--world")
    if isinstance(parsed, int):
        return parsed
    worlds, sizes = parsed
    mem = memcpy_gbps()
    print(f"# single-core memcpy: {mem:.2f} GB/s (physical anchor)")
    records: list[dict[str, Any]] = []
    calibrations = {}
    exclusive = only_on()
    for world in worlds:
        for tr in transports:
            use = [a for a in algos if exclusive.get(a, tr) == tr]
            if not use:
                continue
            cfg = {"op": args.op, "algorithms": use, "sizes": sizes, "dtype": args.dtype, "iters": args.iters,
                   "warmup": args.warmup, "trials": args.trials, "target_s": 0.2, "calibrate": args.calibrate,
                   "check": args.check}
            out = run_transport(tr, world, cfg, args.timeout)
            for r in out["records"]:
                r["memcpy_fraction"] = r["busbw"] / mem if mem > 0 else 0.0
            if out.get("calibration"):
                calibrations[f"{tr}:{world}"] = out["calibration"]
                _print_calibration(tr, world, out["calibration"])
            for algo in use:
                rs = [r for r in out["records"] if r["algorithm"] == algo]
                backend = f"({rs[0]['backend']})" if rs and rs[0]["backend"] else ""
                chk = "" if algo == "native" or args.check else " check=off"
                print(report.header(f"transport={tr}{backend} world={world} op={args.op} algorithm={algo}{chk}"))
                for r in rs:
                    print(report.row(r))
                print()
            records += out["records"]
            if args.explain:
                print_explain(f"transport={tr} world={world}", out.get("explain", []))
                print_waits(f"transport={tr} world={world}", out.get("native_wait", {}))
    _print_ratios(records)
    if args.floor:
        _print_floor(records, worlds, sizes)
    wrong = sum(r["wrong"] for r in records)
    print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    if args.json_path:
        report.write_json(records, args.json_path, {"memcpy_GBps": mem, "calibration": calibrations})
        print(f"# wrote {args.json_path}")
    if args.plot_path:
        report.plot_busbw(records, args.plot_path, f"{args.op} busbw ({args.dtype})", mem)
        print(f"# wrote {args.plot_path}")
    return 1 if wrong else 0


HOSTS_OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _main_hosts(args: argparse.Namespace) -> int:
    """``--hosts N``: the bench across N simulated hosts, against gloo (see ``comm_hosts``)."""
    from ..comm.algorithms import algorithms_for
    from ..simhosts import namespaces_unavailable
    from . import comm_hosts

    if args.hosts < 1:
        return _fail(f"--hosts must be a whole number of simulated hosts >= 1, got {args.hosts}")
    if args.transport is not None:
        return _fail("--transport does not apply with --hosts: ranks use shared memory inside a simulated "
                     "host and gloo between hosts; drop --transport")
    if args.calibrate or args.floor:
        return _fail("--calibrate and --floor are single-host measurements; drop them with --hosts")
    if args.op not in HOSTS_OPS:
        return _fail(f"--hosts times {', '.join(HOSTS_OPS)}, not {args.op}")
    parsed = _worlds_and_sizes(args, "--hosts 2 --world 2 --sizes 1K:64M", "--world (ranks per host)")
    if isinstance(parsed, int):
        return parsed
    worlds, sizes = parsed
    if any(w * args.hosts < 2 for w in worlds):
        return _fail("--hosts x --world must be at least 2 ranks")
    across = registry.auto_choice("gloo").name  # what the ranks' init(transport="auto") takes over gloo
    valid = [a for a in algorithms_for(args.op, across) if a != "shm"]  # the shm collectives need one host
    named = [a.strip() for a in (args.algorithms or "auto").split(",") if a.strip()]
    bad = [a for a in named if a not in (*valid, "auto", "native")]
    if bad:
        return _fail(f"algorithm {bad} cannot run {args.op} across hosts: choose from {', '.join(valid)} "
                     "(auto and gloo's own collective always run)")
    algos = ["auto"] + [a for a in named if a not in ("auto", "native")] + ["native"]
    reason = namespaces_unavailable()
    if reason:
        return _fail(f"--hosts needs simulated hosts, which this machine cannot run: {reason}")
    records: list[dict[str, Any]] = []
    mem = memcpy_gbps()
    print(f"# single-core memcpy: {mem:.2f} GB/s (physical anchor)")
    for world in worlds:
        cfg = {"op": args.op, "algorithms": algos, "sizes": sizes, "dtype": args.dtype, "iters": args.iters,
               "warmup": args.warmup, "trials": args.trials, "target_s": 0.2, "check": args.check,
               "timeout": args.timeout}
        try:
            out = comm_hosts.run_hosts(args.hosts, world, cfg, timeout=args.timeout * 4 + 300 + 60 * len(sizes))
        except comm_hosts.HostsRunFailed as exc:
            return _fail(f"the run on {args.hosts} simulated hosts x {world} ranks failed: {exc}")
        for algo in algos:
            print(report.header(f"hosts={args.hosts} x {world} ranks (shm in a host, gloo between) op={args.op} "
                                f"algorithm={'gloo (torch.distributed, native)' if algo == 'native' else algo}"))
            for r in out["records"]:
                if r["algorithm"] == algo:
                    print(report.row(r))
            print()
        records += out["records"]
        if args.explain:
            print_explain(f"hosts={args.hosts} x {world} ranks", out.get("explain", []))
    comm_hosts.add_ratios(records)
    comm_hosts.print_ratio_table(records)
    wrong = sum(r["wrong"] for r in records)
    print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    if args.json_path:
        report.write_json(records, args.json_path, {"memcpy_GBps": mem, "hosts": args.hosts,
                                                    "ranks_per_host": worlds})
        print(f"# wrote {args.json_path}")
    if args.plot_path:
        comm_hosts.plot(records, args.plot_path, f"{args.op} across {args.hosts} simulated hosts ({args.dtype})")
        print(f"# wrote {args.plot_path}")
    return 1 if wrong else 0


def print_explain(where: str, rows: list[dict[str, Any]]) -> None:
    """``--explain``: per op and size range, auto's kept algorithm, how (and how often, where a
    drift explored again) it was chosen, and each candidate's time (the mean over ranks of each
    rank's mean but its slowest call, as agreed), or why there is none."""
    print(f"# auto on the world, {where}: size -> algorithm kept (how), candidates' measured times "
          "(the kept one's lowered where a check found it faster back to back)")
    if not rows:
        print("#   nothing learned: auto keeps its static choice here (ranks as threads, NCCL, "
              "MESHTRAIN_AUTO_TUNE=0, or no auto call)")
    for r in rows:
        times = "  ".join(f"{a} {t * 1e6:.0f}us" for a, t in sorted(r["agreed_s"].items(), key=lambda kv: kv[1]))
        how = r["source"] + (f", explored {r['probes']}x" if r.get("probes", 0) > 1 else "")  # drifts re-probed
        print(f"  {r['op']:15s} {r['dtype']:9s} {report_size(r['bytes_from']):>6}-{report_size(r['bytes_below']):<6} "
              f"-> {str(r['choice']):19s} ({how})  {times}")
    print()


def print_waits(where: str, waits: dict[int, list[str]]) -> None:
    """``--explain``: per size, how each rank waits for torch's own op (``native_wait``'s learned
    mode: look, park, ``-`` where it learned none)."""
    learned = {size: modes for size, modes in waits.items() if any(m != "-" for m in modes)}
    if learned:
        print(f"# torch's own op, {where}: size -> each rank's wait (look or park, learned per process)")
        for size, modes in learned.items():
            print(f"  {report_size(size):>6} -> {' '.join(modes)}")
        print()


def _print_floor(records: list[dict[str, Any]], worlds: list[int], sizes: list[int]) -> None:
    """The copy floor per world size and size (>= 1 MB), and every algorithm's time against it."""
    from .comm import copy_floor_us

    print("# floor: WORLD processes each copying SIZE (private to private) at once; time / floor >= 1")
    for world in worlds:
        for size in [s for s in sizes if s >= 1 << 20]:
            floor = copy_floor_us(world, size)
            cells = []
            for r in records:
                if r["world_size"] == world and r["size"] == size:
                    r["floor_us"] = floor
                    cells.append(f"{r['transport']}:{r['algorithm']} {r['time_us'] / floor:.2f}")
            print(f"  world {world} {report_size(size):>5}: floor {floor:9.0f} us   " + "   ".join(cells))
    print()


def _print_calibration(tr: str, world: int, cal: dict[str, Any]) -> None:
    print(f"# calibration transport={tr} world={world}: alpha={cal['alpha_us']:.1f} us  "
          f"beta=1/({cal['beta_GBps']:.2f} GB/s)  gamma=1/({cal['gamma_GBps']:.2f} GB/s)")
    for op, xs in cal["crossovers"].items():
        steps = ", ".join(f"{report_size(n)}: {a}" for n, a in xs)
        print(f"#   {op:15s} cheapest from  {steps}")
    print()


def report_size(n: int) -> str:
    """64 -> '64B', 2048 -> '2K', ..."""
    for unit, k in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k}{unit}"
    return f"{n}B"


def _print_ratios(records: list[dict[str, Any]]) -> None:
    peers = {(r["world_size"], r["size"]): r for r in records if r["algorithm"] == "native"}
    if not peers:
        return
    print("# busbw ratio to torch.distributed's own collective (native, gloo), same run; "
          "equal to native's time / this time. memcpy: busbw / single-core memcpy")
    print(f"# {'world':>5} {'size':>10} {'algorithm':>20} {'ratio':>7} {'memcpy':>7}")
    for r in records:
        peer = peers.get((r["world_size"], r["size"]))
        if r["algorithm"] == "native" or peer is None or peer["busbw"] <= 0:
            continue
        print(f"  {r['world_size']:>5} {report_size(r['size']):>10} {r['transport'] + ':' + r['algorithm']:>20} "
              f"{r['busbw'] / peer['busbw']:>7.2f} {r.get('memcpy_fraction', 0.0):>7.1%}")
    print()
