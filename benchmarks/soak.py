"""Soak test (not in CI): a long `meshtrain train` run with periodic checkpoints and injected
`kill -9`s of random workers must end with exactly the final loss of the same run undisturbed.

    python benchmarks/soak.py --steps 1200 --kills 3 --every 50 --out runs/soak   # ~30 min on 2 cores

Both runs use the default model and layout (dp2 x tp2, 4 processes over shm); the disturbed one
has --max-restarts equal to the number of kills. After each kill the elastic agent restarts the
workers, which resume from the last checkpoint and replay the lost steps. The script checks that
every step ran, that replayed steps repeat their losses bitwise, that the sample ids of the two
runs agree, and that the final losses are equal; it prints a JSON summary and exits 1 if not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshtrain.train.metrics import read_rows


def _workers(pid: int) -> list[int]:
    """The launcher's child processes that have no children of their own (the training ranks)."""
    def kids(p: int) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout.split()
        return [int(x) for x in out]

    return [k for k in kids(pid) if not kids(k)]


def run(out: Path, steps: int, every: int, kills: int, extra: list[str], seed: int) -> dict:
    """One run; with ``kills`` > 0, kill a random worker that many times at random steps."""
    cmd = [sys.executable, "-m", "meshtrain.cli", "train", f"--out={out}", f"--train.steps={steps}",
           f"--checkpoint.every={every}", "--no-progress", *extra]
    if kills:
        cmd.append(f"--max-restarts={kills}")
    rng = random.Random(seed)
    # kill after distinct random steps, spread over the run
    targets = sorted(rng.sample(range(every + 1, steps), kills)) if kills else []
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = []
    while proc.poll() is None:
        rows = read_rows(out / "metrics.jsonl") if targets else []
        if rows:
            last = rows[-1]["step"]
            if last >= targets[0]:  # the run has logged the target step: kill a worker now
                workers = _workers(proc.pid)
                if workers:
                    victim = rng.choice(workers)
                    os.kill(victim, signal.SIGKILL)
                    killed.append({"at_step": last, "pid": victim, "t": round(time.monotonic() - start, 1)})
                    targets.pop(0)
        time.sleep(0.2)
    log = proc.communicate()[0]
    return {"rc": proc.returncode, "seconds": round(time.monotonic() - start, 1), "kills": killed,
            "rows": read_rows(out / "metrics.jsonl"), "log_tail": log[-2000:]}


def main() -> int:
    """Run the undisturbed and the disturbed run, compare, print the summary."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--every", type=int, default=50, help="checkpoint every this many steps")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/soak")
    args, extra = ap.parse_known_args()
    out = Path(args.out)
    ref = run(out / "undisturbed", args.steps, args.every, 0, extra, args.seed)
    dis = run(out / "disturbed", args.steps, args.every, args.kills, extra, args.seed)
    last: dict[int, dict] = {}
    replay_ok = True
    for r in dis["rows"]:
        if r["step"] in last:
            replay_ok &= r["loss"] == last[r["step"]]["loss"] and r["samples"] == last[r["step"]]["samples"]
        last[r["step"]] = r
    want = {r["step"]: r for r in ref["rows"]}
    summary = {
        "steps": args.steps, "kills": dis["kills"], "rc": [ref["rc"], dis["rc"]],
        "seconds": [ref["seconds"], dis["seconds"]],
        "all_steps_ran": sorted(last) == list(range(1, args.steps + 1)),
        "replayed_steps": len(dis["rows"]) - len(last), "replays_bitwise": replay_ok,
        "same_samples": all(last.get(s, {}).get("samples") == r["samples"] for s, r in want.items()),
        "final_loss": [ref["rows"][-1]["loss"] if ref["rows"] else None,
                       last[max(last)]["loss"] if last else None],
    }
    summary["final_loss_equal"] = summary["final_loss"][0] == summary["final_loss"][1]
    ok = (summary["rc"] == [0, 0] and summary["all_steps_ran"] and summary["replays_bitwise"]
          and summary["same_samples"] and summary["final_loss_equal"] and len(dis["kills"]) == args.kills)
    summary["ok"] = ok
    print(json.dumps(summary, indent=1))
    if not ok:
        print(dis["log_tail"], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
