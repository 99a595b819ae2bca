"""auto against the peers it must not lose to, over separate runs (docs/benchmarks.md, issue 33):

* torch transport (gloo): auto's time against torch's own collective (native), same run;
* shm transport: auto's time against the best fixed algorithm (least median over the runs), each run
  against the same run's time of that algorithm.

    python benchmarks/auto_table.py RUNS WORLDS OPS SIZES [OUT.json] [--transports=torch,shm] [--trials=3]
    python benchmarks/auto_table.py 3 2,4 all_reduce,all_gather,reduce_scatter 4K:64M

Each run is one ``meshtrain bench comm`` per transport and op (fresh processes, an empty calibration
cache, so auto explores and then keeps a choice; the bench times only what it keeps), trials
(``--trials``, 3 by default) interleaved inside it; the table gives each cell's median ratio over the runs and its spread (min-max).
A ratio >= 1 means auto was as fast or faster.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

SHM_FIXED = ("shm", "ring", "recursive_doubling", "halving_doubling", "tree", "direct")
OPS_FIXED = {"all_reduce": SHM_FIXED, "all_gather": ("shm", "ring", "recursive_doubling", "direct"),
             "reduce_scatter": ("shm", "ring", "direct")}


def _bench(transport: str, worlds: str, op: str, algos: list[str], sizes: str, out: Path, trials: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, MESHTRAIN_CACHE_DIR=cache)
        cmd = ["meshtrain", "bench", "comm", "--transport", transport, "--world", worlds, "--op", op,
               "--algorithms", ",".join(algos), "--sizes", sizes, "--factor", "4", "--trials", str(trials),
               "--explain", "--json", str(out)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        # what auto kept and why, and each size's ratio line, as each bench ends: a table cut short
        # by a time limit still leaves its finished runs' figures
        # (and each rank's wait for torch's own op, per size: the lines under "# torch's own op")
        keep, waits = [], False
        for line in r.stdout.splitlines():
            waits = line.startswith("# torch's own op") or (waits and line.startswith("  "))
            if waits or line.startswith(("  all_", "  reduce_", "# auto")) or ":auto" in line:
                keep.append(line + "\n")
        sys.stdout.write("".join(keep))
        sys.stdout.flush()
    return json.loads(out.read_text())["records"]


def main(argv: list[str]) -> int:
    """Run the table; returns the exit code."""
    transports = ("torch", "shm")
    trials = 3
    for a in [a for a in argv if a.startswith("--trials=")]:
        argv.remove(a)
        trials = int(a.split("=", 1)[1])
    for a in [a for a in argv if a.startswith("--transports=")]:
        argv.remove(a)
        transports = tuple(a.split("=", 1)[1].split(","))
    runs, worlds, ops, sizes = int(argv[0]), argv[1], argv[2].split(","), argv[3]
    times: dict[tuple, list[float]] = defaultdict(list)  # (transport, op, p, size, algorithm) -> per run
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            for op in ops:
                for tr, algos in (("torch", ["auto", "native"]), ("shm", ["auto", *OPS_FIXED[op]])):
                    if tr not in transports:
                        continue
                    for r in _bench(tr, worlds, op, algos, sizes, Path(tmp) / "b.json", trials):
                        times[tr, op, r["world_size"], r["size"], r["algorithm"]].append(r["time_us"])
            print(f"# run {run + 1} of {runs} done", flush=True)
    # The peer on shm is the fixed algorithm with the least median over the runs: taking each run's
    # fastest instead would pick the luckiest of six noisy numbers against auto's one.
    ratios: dict[tuple, list[float]] = {}
    peers: dict[tuple, str] = {}
    for (tr, op, p, n, a), ts in times.items():
        if a != "auto":
            continue
        fixed = {aa: statistics.median(v) for (t2, o2, p2, n2, aa), v in times.items()
                 if (t2, o2, p2, n2) == (tr, op, p, n) and aa != "auto"}
        peer = min(fixed, key=fixed.get)
        peers[tr, op, p, n] = peer
        ratios[tr, op, p, n] = [x / y for x, y in zip(times[tr, op, p, n, peer], ts)]
    print("| transport | op | p | size | peer | peer time / auto time: median of runs | spread |")
    print("|---|---|---|---|---|---|---|")
    for (tr, op, p, n), xs in sorted(ratios.items()):
        print(f"| {tr} | {op} | {p} | {n >> 10}K | {peers[tr, op, p, n]} | {statistics.median(xs):.2f} | "
              f"{min(xs):.2f}-{max(xs):.2f} |")
    if len(argv) > 4:
        Path(argv[4]).write_text(json.dumps({"times_us": {"|".join(map(str, k)): v for k, v in times.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
