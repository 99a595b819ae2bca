"""One rank of ``meshtrain bench comm --hosts N``, run by torchrun on a simulated host.

``meshtrain.bench.comm_hosts`` starts N simulated hosts (``meshtrain/simhosts.py``); each host's
torchrun runs ``python -m meshtrain.bench.hosts_worker CONFIG.json OUT.json`` on its ranks. A rank
initialises ``meshtrain.comm`` with ``transport="auto"`` (shared memory inside its host, gloo between
hosts), checks that it really sees N hosts, and runs the same timing loop as the single-host bench
(``bench.comm.rank_main``: one checked call per algorithm, then interleaved trials, median trial),
where ``native`` is torch.distributed's own collective on the default gloo group of the same
processes. Rank 0 writes the records, with what ``auto`` resolved to at each size, to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from ..files import write_json_atomic
from .comm import DTYPES, rank_main


def auto_choices(op: str, sizes: list[int], dtype: str) -> dict[int, str]:
    """What ``algorithm="auto"`` resolves to on the world for each size (bytes, as the bench's
    records count them): the choice online selection keeps (``tune.kept``), else ``select.choose``
    on every rank, so calibration, if still needed, is collective."""
    import meshtrain.comm as mc
    from meshtrain.comm import select, tune

    world, p = mc.current().world, mc.get_world_size()
    elem = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    out = {}
    for size in sizes:
        count = size // elem
        if op in ("all_gather", "reduce_scatter"):
            count -= count % p
        out[count * elem] = (tune.kept(world, op, count * elem, DTYPES[dtype])
                             or select.choose(world, op, count * elem))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one rank: ``argv`` is [config path, output path]."""
    import meshtrain.comm as mc
    from meshtrain.comm.transport.base import capabilities

    cfg_path, out_path = argv if argv is not None else sys.argv[1:3]
    with open(cfg_path) as f:
        cfg: dict[str, Any] = json.load(f)
    t0 = time.monotonic()
    comm = mc.init(transport="auto", timeout=cfg["timeout"], check=cfg.get("check", True), init_timeout=120)
    hosts = list(comm.transport.hosts)
    if not capabilities(comm.transport).shared_memory or len(set(hosts)) != cfg["hosts"]:
        raise RuntimeError(f"expected shm inside a host and gloo between {cfg['hosts']} hosts; transport "
                           f"{comm.transport.kind!r}, the ranks see hosts {sorted(set(hosts))}")
    rank = mc.get_rank()
    try:
        out = rank_main(rank, dict(cfg, transport="hosts", backend="shm+gloo"))
        choices = auto_choices(cfg["op"], cfg["sizes"], cfg["dtype"])
        if rank == 0:
            assert out is not None
            for r in out["records"]:
                r.update(hosts=cfg["hosts"], ranks_per_host=cfg["ranks_per_host"])
                if r["algorithm"] == "auto":
                    r["auto_choice"] = choices.get(r["size"], "")
            write_json_atomic(out_path, {"records": out["records"], "host_of_rank": hosts, "explain": out["explain"],
                                         "seconds": time.monotonic() - t0})
    except BaseException as exc:
        mc.destroy(exc)  # the other hosts' ranks stop at once, naming this one
        raise
    mc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
