"""What the in-memory replicas of an elastic run cost per step (not in CI).

    .venv/bin/python benchmarks/memory_replica_cost.py --steps 60 --repeats 2   # as root

The job of tests/hosts/test_elastic_hosts.py, undisturbed: 3 simulated hosts x 2 ranks
(``meshtrain.simhosts``: own hostname and /dev/shm each, one torchrun agent each), the test model,
dp3 x tp2, a global batch of 6, ``--elastic.enabled=true``, no periodic disk checkpoint. It runs with
``elastic.memory_every = 0`` (off) and ``= 1`` (every step: a local copy in /dev/shm and one sent to
the next host), alternately, ``--repeats`` times each. Reported (JSON on stdout and in
``OUT/summary.json``), per setting, the median over the repeats of:

* ``loop_s_per_step``: rank 0's training loop (summary.json ``seconds``) over the steps: the whole
  cost, the training thread's part and the background thread's contention for the cores;
* ``step_s``: the median ``step_s`` of metrics.jsonl (forward, backward, optimizer: contention only);
* with replicas, rank 0's ``memory_replicas``: seconds per step of the training thread (snapshot
  copy, wait for the previous copy), of the background thread per copy (write to /dev/shm, send and
  receive), and the bytes of its replica.

Needs root and util-linux's unshare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _simhosts_out import output_dir  # benchmarks/, the script's own folder

from meshtrain.simhosts import SimulatedHosts
from meshtrain.train.metrics import read_rows

ROOT = Path(__file__).resolve().parents[1]
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see meshtrain/train/elastic_launch.py
CONFIG = ["--model.preset=test", "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=6",
          "--train.seq_len=32", "--train.warmup_steps=2", "--train.lr=0.001", "--train.min_lr=0.001",
          "--parallel.dp=3", "--parallel.tp=2", "--checkpoint.every=0", "--elastic.enabled=true"]


def run(out: Path, steps: int, every: int) -> dict:
    """One undisturbed run; its figures."""
    worker = ["-m", "meshtrain.train", "--out", str(out), f"--train.steps={steps}",
              f"--elastic.memory_every={every}", *CONFIG]
    start = time.monotonic()
    with SimulatedHosts(3, 2, worker, out.parent / f"{out.name}-hosts", cwd=ROOT, env=ENV) as hosts:
        codes = hosts.wait(1200)
        if codes != [0, 0, 0]:
            raise RuntimeError(f"the run failed: {codes}\n{hosts.tails(2000)}")
        left = [hosts.shm_left(k) for k in range(3)]
    summary = json.loads((out / "summary.json").read_text())
    rows = read_rows(out / "metrics.jsonl")
    got = {"wall_s": time.monotonic() - start, "loop_s_per_step": summary["seconds"] / steps,
           "step_s": statistics.median(r["step_s"] for r in rows if "step_s" in r), "shm_left": left}
    mem = summary.get("memory_replicas")
    if mem:
        got.update(main_s_per_step=mem["main_s"] / steps, background_s_per_copy=mem["background_s"] / mem["snapshots"],
                   copies=mem["snapshots"], replica_bytes=mem["bytes"])
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("runs/memory-replica-cost"))
    args = p.parse_args()
    args.out = output_dir(args.out, "memory_replica_cost")
    from meshtrain.train.config import load_config
    from meshtrain.train.tokenizer import prepare_data

    prepare_data(load_config(None, CONFIG).data)  # the token caches first: no run times their build
    runs: dict[int, list[dict]] = {0: [], 1: []}
    for i in range(args.repeats):
        for every in (0, 1):  # alternately, so a change in the machine's load hits both alike
            runs[every].append(run(args.out / f"every{every}-{i}", args.steps, every))
            print(f"# memory_every={every} #{i}: {json.dumps(runs[every][-1])}", file=sys.stderr, flush=True)
    med = {every: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
           for every, rs in runs.items()}
    summary = {"steps": args.steps, "repeats": args.repeats, "off": med[0], "every_step": med[1],
               "loop_s_per_step_added": med[1]["loop_s_per_step"] - med[0]["loop_s_per_step"],
               "step_s_added": med[1]["step_s"] - med[0]["step_s"],
               "shm_left": [r["shm_left"] for rs in runs.values() for r in rs]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
