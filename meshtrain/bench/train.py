"""``meshtrain bench train --compare``: meshtrain's DataParallel and ZeRO-3 against torch DDP and
FSDP2 (``fully_shard``) on the same decoder, data and optimizer, in real gloo processes.

Every (implementation, world size) runs in fresh processes, so the peak resident memory of a rank
(``ru_maxrss``) belongs to that implementation alone. Implementations are interleaved over
trials and the median tokens/s is reported, with the ratio to the torch peer.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import torch

IMPLS = ("torch-ddp", "meshtrain-dp", "meshtrain-dp-shm", "torch-fsdp2", "meshtrain-zero3")
PEER = {"meshtrain-dp": "torch-ddp", "meshtrain-dp-shm": "torch-ddp", "meshtrain-zero3": "torch-fsdp2"}
# meshtrain-dp runs on the torch transport (gloo, as DDP does); meshtrain-dp-shm on the shm
# transport, which a user on one host gets (comm.transport = auto)
TRANSPORT = {"meshtrain-dp-shm": "shm"}


def _wrap(impl: str, model: torch.nn.Module, bucket_cap_mb: float | str,
          algorithm: str = "auto") -> tuple[torch.nn.Module, Any]:
    """The model wrapped by ``impl`` and its optimizer (``bucket_cap_mb="auto"``: DDP keeps its 25)."""
    import torch.distributed as dist

    opt_kw = dict(lr=3e-4, weight_decay=0.1)
    if impl == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        m = DistributedDataParallel(model, bucket_cap_mb=25.0 if bucket_cap_mb == "auto" else bucket_cap_mb)
        return m, torch.optim.AdamW(model.parameters(), **opt_kw)
    if impl in ("meshtrain-dp", "meshtrain-dp-shm"):
        from ..comm.compress import AllReduceHook
        from ..parallel.data import DataParallel

        m = DataParallel(model, bucket_cap_mb=bucket_cap_mb, broadcast_buffers=False,
                         comm_hook=AllReduceHook(algorithm))
        return m, torch.optim.AdamW(model.parameters(), **opt_kw)
    if impl == "torch-fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), **opt_kw)
    if impl == "meshtrain-zero3":
        from ..parallel.zero import ZeroModel, ZeroOptimizer

        zm = ZeroModel(model, stage=3, units=list(model.layers.values()))
        return zm, ZeroOptimizer(zm, torch.optim.AdamW, **opt_kw)
    raise ValueError(f"unknown implementation {impl!r}: use one of {IMPLS}")


def worker(rank: int, impl: str, preset: str, batch: int, seq: int, steps: int, warmup: int,
           bucket_cap_mb: float | str, algorithm: str = "auto") -> dict[str, Any]:
    """Runs in each spawned rank: train ``steps`` timed steps after ``warmup``; report speed and memory."""
    import torch.distributed as dist

    from ..models.llama import PRESETS, Llama, init_weights, num_params

    torch.set_num_threads(1)  # ranks share the cores; one intra-op thread each, for every impl
    world = dist.get_world_size()
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cfg = PRESETS[preset]
    model = Llama(cfg)
    init_weights(model, seed=0)
    n_params = num_params(model)
    wrapped, opt = _wrap(impl, model, bucket_cap_mb, algorithm)
    g = torch.Generator().manual_seed(1000 + rank)
    data = torch.randint(0, cfg.vocab_size, (warmup + steps, batch, seq + 1), generator=g)
    loss = torch.zeros(())
    t0 = 0.0
    step_s = []  # each timed step's seconds: their median shrugs off a burst of a shared machine's load
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        ts = time.perf_counter()
        x, y = data[i, :, :-1], data[i, :, 1:]
        opt.zero_grad()
        logits = wrapped(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
        loss.backward()
        opt.step()
        if i >= warmup:
            step_s.append(time.perf_counter() - ts)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from .. import comm

    algos = sorted({f"{r['op']}:{r['algorithm']}" for r in comm.flight_recorder()[-50:]}) if impl.startswith("meshtrain") else []
    return {"impl": impl, "world_size": world, "tokens_per_s": world * batch * seq * steps / elapsed,
            "step_s": elapsed / steps, "step_s_median": statistics.median(step_s), "peak_mem_bytes": peak, "start_mem_bytes": start_rss,
            "loss": float(loss.detach()), "params": n_params,
            "collectives": algos, "bucket_cap_bytes": getattr(wrapped, "bucket_cap_bytes", None),
            "buckets": len(getattr(wrapped, "buckets", ()))}


def run(worlds: list[int], impls: list[str], trials: int, **kw: Any) -> list[dict[str, Any]]:
    """Every implementation on every world size, interleaved over ``trials``; median per pair."""
    from ..comm.launch import spawn

    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for world in worlds:
        for _ in range(trials):
            for impl in impls:
                res = spawn(world, worker, impl, kw["preset"], kw["batch"], kw["seq"], kw["steps"],
                            kw["warmup"], kw["bucket_cap_mb"], kw.get("algorithm", "auto"), timeout=kw.get("timeout", 600),
                            transport=TRANSPORT.get(impl, "torch"))  # the metadata check on, as users run it
                runs.setdefault((impl, world), []).append({
                    **res[0],
                    "peak_mem_bytes": max(r["peak_mem_bytes"] for r in res),
                    "start_mem_bytes": max(r["start_mem_bytes"] for r in res),
                })
    records = []
    for (impl, world), rs in runs.items():
        med = statistics.median(r["tokens_per_s"] for r in rs)
        rec = dict(rs[0], tokens_per_s=med, trials_tokens_per_s=[r["tokens_per_s"] for r in rs],
                   peak_mem_bytes=max(r["peak_mem_bytes"] for r in rs), peer=PEER.get(impl))
        records.append(rec)
    by = {(r["impl"], r["world_size"]): r for r in records}
    for r in records:
        peer = by.get((r["peer"], r["world_size"])) if r["peer"] else None
        r["ratio_to_peer"] = r["tokens_per_s"] / peer["tokens_per_s"] if peer else None
        r["mem_ratio_to_peer"] = r["peak_mem_bytes"] / peer["peak_mem_bytes"] if peer else None
    return records
