"""``meshtrain bench train --bucket-sweep 1,4,16,64,auto``: DataParallel at each bucket size.

Every size (fixed MiB, or "auto": sized at start-up from the calibrated link,
``parallel/bucket_size.py``) runs in fresh processes, the sizes interleaved over the trials so that
a slow spell of a shared machine falls on all of them alike. A trial's tokens/s come from its
median step time (one burst of another job's load moves a mean over ten steps by tens of
percent), a size's from its median trial, reported as a ratio to the best fixed size's at that
world size: auto's ratio is the figure of merit (1.00: as fast as the best size the sweep found).
"""

from __future__ import annotations

import statistics
from typing import Any

from .train import TRANSPORT, worker

SWEEP_IMPLS = ("meshtrain-dp", "meshtrain-dp-shm")
"""The implementations a sweep can run: DataParallel's buckets (ZeRO-3's units are blocks)."""


def parse_sweep(text: str) -> list[float | str]:
    """'1,4,16,auto' -> [1.0, 4.0, 16.0, "auto"]; ``ValueError`` naming the bad entry."""
    out: list[float | str] = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        if item == "auto":
            out.append("auto")
            continue
        try:
            v = float(item)
        except ValueError:
            raise ValueError(f"--bucket-sweep entry {item!r} is neither a size in MiB nor 'auto'") from None
        if not 0 < v < float("inf"):
            raise ValueError(f"--bucket-sweep entry {item!r} must be a positive size in MiB")
        out.append(v)
    if not any(v != "auto" for v in out):
        raise ValueError(f"--bucket-sweep {text!r} needs at least one fixed size to compare with, e.g. 1,4,16,64,auto")
    return list(dict.fromkeys(out))


def label(size: float | str) -> str:
    """How a size is named in tables and records: "auto", "4", "0.5"."""
    return size if isinstance(size, str) else f"{size:g}"


def run_sweep(worlds: list[int], impl: str, sizes: list[float | str], trials: int,
              **kw: Any) -> list[dict[str, Any]]:
    """``impl`` at every size and world size, sizes interleaved over ``trials``; one record per
    (world, size) with the median tokens/s, every trial's and the ratio to the best fixed size."""
    from ..comm.launch import spawn

    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for world in worlds:
        for _ in range(trials):
            for size in sizes:
                res = spawn(world, worker, impl, kw["preset"], kw["batch"], kw["seq"], kw["steps"], kw["warmup"],
                            size, kw.get("algorithm", "auto"), timeout=kw.get("timeout", 600),
                            transport=TRANSPORT.get(impl, "torch"))
                runs.setdefault((world, label(size)), []).append(res[0])
    records = []
    for (world, name), rs in runs.items():
        # a trial's speed from its median step (the mean over a trial takes every burst of load)
        tps = [world * kw["batch"] * kw["seq"] / r["step_s_median"] for r in rs]
        records.append(dict(rs[0], bucket=name, tokens_per_s=statistics.median(tps), trials_tokens_per_s=tps,
                            bucket_cap_bytes_trials=[r["bucket_cap_bytes"] for r in rs]))
    for world in worlds:
        mine = [r for r in records if r["world_size"] == world]
        best = max((r for r in mine if r["bucket"] != "auto"), key=lambda r: r["tokens_per_s"])
        for r in mine:
            r["best_fixed"] = best["bucket"]
            r["ratio_to_best_fixed"] = r["tokens_per_s"] / best["tokens_per_s"]
    return records


def print_sweep(records: list[dict[str, Any]], preset: str, impl: str, trials: int) -> None:
    """One row per world size and bucket size, auto last with the size it chose."""
    n = records[0]["params"] if records else 0
    print(f"# bucket sweep: {impl}, model {preset} ({n / 1e6:.2f}M params), median of {trials} interleaved trials")
    print(f"# {'world':>5} {'bucket MiB':>10} {'buckets':>7} {'tokens/s':>10} {'vs best fixed':>13}  trials")
    for r in sorted(records, key=lambda r: (r["world_size"], r["bucket"] == "auto",
                                            0.0 if r["bucket"] == "auto" else float(r["bucket"]))):
        name = r["bucket"]
        if name == "auto":
            chosen = sorted({b / 2**20 for b in r["bucket_cap_bytes_trials"] if b})
            name = f"auto={'/'.join(f'{c:.1f}' for c in chosen)}"
        trials_txt = " ".join(f"{t:.0f}" for t in r["trials_tokens_per_s"])
        print(f"  {r['world_size']:>5} {name:>10} {r['buckets']:>7} {r['tokens_per_s']:>10.0f} "
              f"{r['ratio_to_best_fixed']:>13.3f}  {trials_txt}")
