"""How long `train.plan_check = "profiled"` takes to time a run's blocks (docs/benchmarks.md).

    python benchmarks/profiled_check_cost.py [VOCAB] [ROUNDS]

Prices `make run`'s default layout (``meshtrain train`` on built-in defaults) with its blocks timed,
as ``meshtrain train`` does after a run, ROUNDS times, each in a fresh process whose fork server (the
copies' parent) is already up, as after a run; prints the seconds each took and the step time it
predicted.
"""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys, time
from meshtrain.train.config import load_config
from meshtrain.config.check import model_config
from meshtrain.plan.auto import predict_run
from meshtrain import worker_processes
config = load_config(None, [])
worker_processes.start(int, ()).join()  # the server up and imported, as after a run (its ranks came from it)
start = time.perf_counter()
pred, _ = predict_run(config, model_config(config, int(sys.argv[1])), "cpu", profiled=True)
print(f"{time.perf_counter() - start:.2f} {pred.step_time:.4f}")
"""


def main() -> None:
    vocab = sys.argv[1] if len(sys.argv) > 1 else "8192"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    for _ in range(rounds):
        out = subprocess.run([sys.executable, "-c", CODE, vocab], check=True, capture_output=True, text=True).stdout
        seconds, step = out.split()[-2:]
        print(f"profiled check: {seconds} s, predicted {step} s/step", flush=True)


if __name__ == "__main__":
    main()
