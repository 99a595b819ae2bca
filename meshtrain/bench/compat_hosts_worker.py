"""One rank of ``meshtrain bench compat --layouts ... --hosts N``, run by torchrun on a simulated host.

The program a torch.distributed user writes: ``init_process_group("gloo")`` of the module under
test (``torch.distributed`` itself, or ``meshtrain.comm`` with only the import switched), then the
4D Llama loop of ``compat_llama``. Rank 0 writes the slowest rank's median step and the losses to
OUT.json (``python -m meshtrain.bench.compat_hosts_worker CONFIG.json OUT.json``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from typing import Any

import torch

from ..files import write_json_atomic
from . import compat_llama
from .comm_clock import CommClock


def main(argv: list[str] | None = None) -> int:
    """Run one rank: ``argv`` is [config path, output path]."""
    cfg_path, out_path = argv if argv is not None else sys.argv[1:3]
    with open(cfg_path) as f:
        cfg: dict[str, Any] = json.load(f)
    torch.set_num_threads(1)  # the processes share the cores, for every mode alike
    if cfg["mode"] == "meshtrain":
        import meshtrain.comm as dist
    else:
        import torch.distributed as dist  # type: ignore[no-redef]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = compat_llama.LlamaConfig(**cfg["model"])
    clock = CommClock(dist)
    out = compat_llama.loop(clock, rank, cfg["sizes"], model, cfg["steps"], cfg["warmup"], on_timed=clock.reset)
    mine = (statistics.median(out["times"]), clock.seconds / cfg["steps"])
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)  # after the timed steps
    links = dist.describe(None)["links"] if cfg["mode"] == "meshtrain" else {}
    if rank == 0:
        write_json_atomic(out_path, {"step_s": max(s for s, _ in every), "comm_s": statistics.mean(c for _, c in every),
                                     "losses": out["losses"], "links": links})
    dist.destroy_process_group()
    return 0


def config(mode: str, sizes: dict[str, int], model: compat_llama.LlamaConfig, steps: int, warmup: int
           ) -> dict[str, Any]:
    """The CONFIG.json of one run."""
    return {"mode": mode, "sizes": sizes, "model": dataclasses.asdict(model), "steps": steps, "warmup": warmup}


if __name__ == "__main__":
    sys.exit(main())
