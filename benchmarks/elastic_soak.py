"""Elastic soak (not in CI): a longer run on simulated hosts under ``torchrun --nnodes MIN:MAX``
in which a host is killed (kill -9 of all its processes) and comes back, again and again.

    sudo .venv/bin/python benchmarks/elastic_soak.py --kills 3 --steps 300 --out runs/elastic-soak

Hosts (default 3) x 2 ranks, dp3 x tp2 (the test model, a global batch of 6: dp2 x tp2 with a host
lost), a checkpoint every 4 steps, in-memory replicas every step (``--memory-every``; 0 resumes
every failure from the disk checkpoint), ``--nnodes 2:3``. First the same job undisturbed on the same
simulated hosts; then the disturbed one: after a random 5 to 15 steps of the full world a random
host other than host0 (whose agent holds the rendezvous store, which cannot be lost) is killed, the
survivors go on with 2 hosts for a random 5 to 15 steps, the host starts again (a new agent joining
the rendezvous) and the job grows back, ``--kills`` times. Reported (JSON on stdout and in
``OUT/summary.json``):

* seconds lost per failure and per rejoin, from the ``world_change`` rows (detect, rendezvous,
  setup, reshard, replay, total): median and worst;
* throughput retained: the undisturbed job's wall time over the disturbed one's, the same steps,
  from the agents' start to the last exit (each lost host also runs its share at 2/3 speed);
* samples lost or repeated in the final record of each step (must be 0), and the largest relative
  loss difference against the undisturbed run.

Needs root and util-linux's unshare (meshtrain.simhosts). Exits 1 if a sample is lost, a step
missing, or the job fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

from _simhosts_out import output_dir  # benchmarks/, the script's own folder

from meshtrain.simhosts import SimulatedHosts
from meshtrain.train.metrics import read_rows

ROOT = Path(__file__).resolve().parents[1]
RDZV = {"last_call_timeout": 1, "keep_alive_interval": 1, "keep_alive_max_attempt": 5}
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see meshtrain/train/elastic_launch.py


def _config(args: argparse.Namespace) -> list[str]:
    return [f"--train.steps={args.steps}", f"--checkpoint.every={args.every}", "--model.preset=test",
            "--data.max_bytes=300000", "--data.vocab_size=512", "--train.global_batch=6", "--train.seq_len=32",
            "--train.warmup_steps=2", "--train.lr=0.001", "--train.min_lr=0.001", "--comm.timeout_s=300",
            f"--parallel.dp={args.hosts}", "--parallel.tp=2", "--elastic.enabled=true",
            f"--elastic.memory_every={args.memory_every}"]


def _hosts(args: argparse.Namespace, out: Path, logs: Path, elastic: bool) -> SimulatedHosts:
    worker = ["-m", "meshtrain.train", "--out", str(out), *_config(args)]
    return SimulatedHosts(args.hosts, 2, worker, logs, cwd=ROOT, env=ENV, max_restarts=4 * args.kills + 4,
                          nnodes=f"{args.hosts - 1}:{args.hosts}" if elastic else None, rdzv_conf=RDZV,
                          rdzv_timeout=120)


def _wait(hosts: SimulatedHosts, cond, what: str, timeout: float, up: list[int]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        dead = [k for k in up if hosts._procs[k].poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {'hosts ' + str(dead) + ' exited' if dead else 'timed out'}\n"
                               f"{hosts.tails(2000)}")
        time.sleep(0.05)


def undisturbed(args: argparse.Namespace) -> tuple[float, list[dict]]:
    out = args.out / "undisturbed"
    start = time.monotonic()
    with _hosts(args, out, args.out / "undisturbed-hosts", elastic=False) as hosts:
        codes = hosts.wait(3600)
    took = time.monotonic() - start
    if codes != [0] * args.hosts:
        raise RuntimeError(f"the undisturbed run failed: {codes}\n{hosts.tails(2000)}")
    return took, [r for r in read_rows(out / "metrics.jsonl") if "event" not in r]


def disturbed(args: argparse.Namespace, rng: random.Random) -> tuple[float, list[dict], list[dict]]:
    out = args.out / "elastic"
    metrics = out / "metrics.jsonl"

    def steps_after_events(n: int) -> int:
        rows = read_rows(metrics)
        at = [i for i, r in enumerate(rows) if "event" in r]
        if n > len(at):
            return -1
        return len([r for r in rows[(at[n - 1] + 1 if n else 0):] if "event" not in r])

    kills = []
    start = time.monotonic()
    everyone = list(range(args.hosts))
    with _hosts(args, out, args.out / "elastic-hosts", elastic=True) as hosts:
        for i in range(args.kills):
            events = 2 * i
            run_for = rng.randint(5, 15)
            _wait(hosts, lambda: steps_after_events(events) >= run_for, f"kill {i + 1}: steps", 600, everyone)
            victim = rng.randrange(1, args.hosts)
            hosts.kill_host(victim)
            kills.append({"host": victim, "t": round(time.monotonic() - start, 1)})
            print(f"# kill {i + 1}: host{victim} at {kills[-1]['t']} s", file=sys.stderr, flush=True)
            alive = [k for k in everyone if k != victim]
            away = rng.randint(5, 15)
            _wait(hosts, lambda: steps_after_events(events + 1) >= away, f"kill {i + 1}: the smaller world", 600,
                  alive)
            hosts.start_host(victim)
            _wait(hosts, lambda: steps_after_events(events + 2) >= 0, f"kill {i + 1}: the grow", 600, alive)
        codes = hosts.wait(3600)
    took = time.monotonic() - start
    if codes != [0] * args.hosts:
        raise RuntimeError(f"the elastic run failed: {codes}\n{hosts.tails(2000)}")
    rows = read_rows(metrics)
    return took, rows, kills


def _stats(values: list[float]) -> dict[str, float | None]:
    return {"median": statistics.median(values) if values else None, "worst": max(values) if values else None}


def summarize(args: argparse.Namespace, ref_s: float, ref: list[dict], run_s: float, rows: list[dict],
              kills: list[dict]) -> dict:
    changes = [r for r in rows if r.get("event") == "world_change"]
    shrinks = [r for r in changes if r["new_world"] < r["old_world"]]
    grows = [r for r in changes if r["new_world"] > r["old_world"]]
    final = {r["step"]: r for r in rows if "event" not in r}
    want = {r["step"]: r for r in ref}
    got_ids = [i for s in sorted(final) for i in final[s]["samples"]]
    want_ids = [i for s in sorted(want) for i in want[s]["samples"]]
    lost = len(set(want_ids) - set(got_ids)) + max(len(want_ids) - len(got_ids), 0)
    repeated = len(got_ids) - len(set(got_ids))
    rel = max((abs(final[s]["loss"] - want[s]["loss"]) / abs(want[s]["loss"]) for s in want if s in final),
              default=math.nan)

    def parts(rs: list[dict]) -> dict[str, dict]:
        return {k: _stats([r["seconds"][k] for r in rs if r["seconds"].get(k) is not None])
                for k in ("detect", "rendezvous", "setup", "reshard", "replay", "total")}

    return {"hosts": args.hosts, "ranks_per_host": 2, "steps": args.steps, "checkpoint_every": args.every,
            "memory_every": args.memory_every, "resumed_from": [r.get("from") for r in shrinks],
            "kills": kills, "undisturbed_s": round(ref_s, 1), "elastic_s": round(run_s, 1),
            "throughput_retained": ref_s / run_s,
            "wall_s_lost_per_kill_and_rejoin": (run_s - ref_s) / max(len(kills), 1),
            "per_failure": parts(shrinks), "per_rejoin": parts(grows),
            "replayed_steps": [r["replayed_steps"] for r in shrinks],
            "steps_missing": sorted(set(want) - set(final)), "samples_lost": lost, "samples_repeated": repeated,
            "same_samples_in_order": got_ids == want_ids, "max_rel_loss_diff": rel,
            "changes": [{k: r[k] for k in ("step", "old_world", "new_world", "replayed_steps", "seconds")}
                        for r in changes]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=3, help="host kills, each followed by the host's return")
    p.add_argument("--steps", type=int, default=300, help="training steps of each run")
    p.add_argument("--every", type=int, default=4, help="checkpoint.every")
    p.add_argument("--memory-every", type=int, default=1,
                   help="elastic.memory_every (0: no in-memory replicas, every failure resumes from disk)")
    p.add_argument("--hosts", type=int, default=3, help="simulated hosts of 2 ranks (MIN is one less)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/elastic-soak"))
    args = p.parse_args()
    args.out = output_dir(args.out, "elastic_soak")
    os.environ.setdefault("MESHTRAIN_CACHE_DIR", str(args.out / "cache"))
    from meshtrain.train.config import load_config
    from meshtrain.train.tokenizer import prepare_data

    prepare_data(load_config(None, _config(args)).data)  # the token caches first: neither run times their build
    ref_s, ref = undisturbed(args)
    print(f"# undisturbed: {len(ref)} steps in {ref_s:.1f} s", file=sys.stderr, flush=True)
    run_s, rows, kills = disturbed(args, random.Random(args.seed))
    summary = summarize(args, ref_s, ref, run_s, rows, kills)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    ok = not summary["steps_missing"] and summary["samples_lost"] == 0 and summary["same_samples_in_order"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
