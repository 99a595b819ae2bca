"""``meshtrain bench comm --hosts N``: time collectives across N simulated hosts against gloo.

Each simulated host (``meshtrain/simhosts.py``: its own hostname and /dev/shm, one torchrun) runs
``--world`` ranks of ``meshtrain.bench.hosts_worker``. In the same processes every size times
meshtrain's collective (``auto`` and any named algorithms) and torch.distributed's own gloo
collective (``native``), interleaved over trials; the ratio meshtrain busbw / gloo busbw (equal to
gloo's time / meshtrain's) goes into each record as ``ratio_to_gloo``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import report

WORKER = "meshtrain.bench.hosts_worker"
ROOT = Path(__file__).resolve().parents[2]  # the workers import meshtrain from here, as this process does


class HostsRunFailed(RuntimeError):
    """A simulated host's workers failed or ran out of time; the message holds their logs' tails."""


def run_hosts(n_hosts: int, per_host: int, cfg: dict[str, Any], timeout: float, worker: str = WORKER
              ) -> dict[str, Any]:
    """Run ``python -m worker CONFIG.json OUT.json`` (default: the timing workers) on ``n_hosts``
    simulated hosts of ``per_host`` ranks each; returns rank 0's OUT.json (for the timing workers
    ``records``, ``host_of_rank``). Raises ``HostsRunFailed`` with the hosts' log tails if any host
    exits non-zero or overruns ``timeout`` seconds."""
    from ..simhosts import SimulatedHosts

    work = Path(tempfile.mkdtemp(prefix="meshtrain-bench-hosts-"))
    try:
        cfg_path, out_path = work / "config.json", work / "out.json"
        cfg_path.write_text(json.dumps(dict(cfg, hosts=n_hosts, ranks_per_host=per_host)))
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with SimulatedHosts(n_hosts, per_host, ["-m", worker, str(cfg_path), str(out_path)], work / "hosts",
                            env=env, cwd=ROOT) as hosts:
            try:
                codes = hosts.wait(timeout)
            except TimeoutError as exc:
                raise HostsRunFailed(str(exc)) from None
            if codes != [0] * n_hosts or not out_path.exists():
                raise HostsRunFailed(f"simulated hosts exited with {codes}:\n{hosts.tails(2000)}")
        return json.loads(out_path.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Set ``ratio_to_gloo`` (busbw / gloo's busbw at the same world size and size) on every record."""
    peers = {(r["world_size"], r["size"]): r for r in records if r["algorithm"] == "native"}
    for r in records:
        peer = peers.get((r["world_size"], r["size"]))
        r["ratio_to_gloo"] = r["busbw"] / peer["busbw"] if peer and peer["busbw"] > 0 else None


def size_name(n: int) -> str:
    """64 -> '64B', 2048 -> '2K', ..."""
    for unit, k in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k}{unit}"
    return f"{n}B"


def print_ratio_table(records: list[dict[str, Any]], file: Any = None) -> None:
    """Per size: gloo's time, each meshtrain algorithm's time and ratio, and what auto ran."""
    file = file or sys.stdout
    algos = [a for a in dict.fromkeys(r["algorithm"] for r in records) if a != "native"]
    for world in sorted({r["world_size"] for r in records}):
        rs = [r for r in records if r["world_size"] == world]
        one = rs[0]
        print(f"# {one['hosts']} hosts x {one['ranks_per_host']} ranks, op={one['op']}: time (us) and "
              f"busbw ratio to gloo (= gloo time / time), median of interleaved trials", file=file)
        cols = "".join(f"{a + ' us':>22}{'ratio':>7}" for a in algos)
        print(f"# {'size':>6}{'gloo us':>11}{cols}  auto ran", file=file)
        by = {(r["algorithm"], r["size"]): r for r in rs}
        for size in sorted({r["size"] for r in rs}):
            gloo = by.get(("native", size))
            line = f"  {size_name(size):>6}{gloo['time_us'] if gloo else float('nan'):>11.0f}"
            for a in algos:
                r = by.get((a, size))
                ratio = r.get("ratio_to_gloo") if r else None
                line += f"{r['time_us'] if r else float('nan'):>22.0f}" + (f"{ratio:>7.2f}" if ratio else f"{'-':>7}")
            auto = by.get(("auto", size))
            print(line + f"  {auto.get('auto_choice', '') if auto else ''}", file=file)
        print(file=file)


def plot(records: list[dict[str, Any]], path: str, title: str) -> None:
    """PNG: busbw against size (every algorithm and gloo) over the ratio to gloo against size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    lines: dict[tuple, list] = {}
    for r in records:
        lines.setdefault((r["algorithm"], r["world_size"]), []).append(r)
    for (algo, world), rs in sorted(lines.items()):
        rs = sorted(rs, key=lambda r: r["size"])
        label = f"{'gloo' if algo == 'native' else 'meshtrain ' + algo} (p={world})"
        top.plot([r["size"] for r in rs], [r["busbw"] for r in rs], marker="o", label=label)
        if algo != "native":
            bottom.plot([r["size"] for r in rs], [r["ratio_to_gloo"] or 0 for r in rs], marker="o", label=label)
    bottom.axhline(1.0, color="gray", linestyle="--")
    top.set_ylabel("bus bandwidth (GB/s)")
    bottom.set_ylabel("busbw / gloo busbw")
    bottom.set_xlabel("message size (bytes)")
    bottom.set_xscale("log", base=2)
    top.set_title(title)
    report.save_figure(fig, [top, bottom], path)

