"""``meshtrain bench pipeline``: measured bubble and activation memory of each pipeline schedule.

Every schedule runs on the same engine over pp ranks (threads, or processes with ``--transport``).
Two kinds of stage compute:

- ``model``: the Llama split into pp (x v) stages: real work, but on a machine with fewer cores
  than ranks the stages share cores, which stretches busy time and hides the bubble.
- ``sleep``: each stage sleeps a fixed time in forward and twice that in backward (no CPU used), so
  the measurement isolates what the schedule and the engine do: waiting, ordering, messaging.

The bubble is measured from the engine's per-action timestamps (an action starts once its input
has arrived) as ``1 - busy / (pp * makespan)`` and printed beside the theory; the activation bytes
come from saved-tensor hooks (bytes autograd holds for micro-batches whose backward has not run).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from .. import comm
from ..comm.transport import registry
from ..parallel.pipeline.schedule import Action, bubble_fraction, theoretical_bubble

COMPUTE = ("sleep", "model")


class _Sleep(torch.autograd.Function):
    """Forward sleeps ``f`` seconds, backward ``b`` seconds; values pass through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, b: float) -> torch.Tensor:
        time.sleep(f)
        ctx.b = b
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.b)
        return g, None, None


class SleepStage(nn.Module):
    """A stage of known cost: multiply by a weight (so there is a gradient), then sleep."""

    def __init__(self, width: int, f: float, b: float) -> None:
        super().__init__()
        self.w, self.f, self.b = nn.Parameter(torch.ones(width)), f, b

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: (rows, seq, width)."""
        return _Sleep.apply(x * self.w, self.f, self.b)


def _rank_run(rank: int, schedule: str, pp: int, m: int, v: int, compute: str, opts: dict) -> dict:
    """One rank: warm-up and timed steps; its events per timed step and its peak activation bytes."""
    from ..mesh import Mesh
    from ..parallel.pipeline.engine import PipelineEngine

    torch.set_num_threads(1)
    mesh = Mesh(pp=pp)
    rows, seq = m * opts["rows"], opts["seq"]
    if compute == "model":
        from dataclasses import replace

        from ..models.llama import PRESETS
        from ..parallel.parallel_model import ParallelModel
        from ..parallel.parallelize import ParallelConfig

        cfg = replace(PRESETS[opts["preset"]], n_layers=opts["layers"])
        model = ParallelModel(cfg, mesh, ParallelConfig(schedule=schedule, microbatches=m, virtual_stages=v))
        tokens = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))

        def step() -> Any:
            model.forward_backward(tokens[:, :-1], tokens[:, 1:])
            return model.last_stats
    else:
        width, f = opts["width"], opts["f_ms"] / 1000 / v
        stages = {c * pp + rank: SleepStage(width, f, 2 * f) for c in range(v)}
        from ..parallel.pipeline.schedule import build_schedule

        actions = build_schedule(schedule, pp, m, v)[rank]
        engine = PipelineEngine(stages, pp * v, lambda s: s % pp, mesh.pp_group, lambda out, _: out.mean())
        x = torch.randn(rows, seq, width)

        def step() -> Any:
            return engine.run(actions, list(x.chunk(m)), [None] * m)[1]

    events, peak = [], 0
    for i in range(opts["warmup"] + opts["steps"]):
        comm.barrier()
        stats = step()
        if i >= opts["warmup"]:
            events.append(stats.events)
            peak = max(peak, stats.peak_activation_bytes)
    return {"events": events, "peak": peak}


def run(pp: int = 4, microbatches: int = 8, schedules: tuple[str, ...] = ("afab", "1f1b", "interleaved"),
        virtual: int = 2, compute: str = "sleep", transport: str = "local", steps: int = 3, warmup: int = 1,
        f_ms: float = 20.0, preset: str = "test", layers: int = 8, rows: int = 1, seq: int = 64,
        width: int = 256) -> list[dict[str, Any]]:
    """One record per schedule: theoretical and measured (median over steps) bubble, peak
    activation bytes per stage, and the trace of the last timed step."""
    opts = dict(steps=steps, warmup=warmup, f_ms=f_ms, preset=preset, layers=layers, rows=rows, seq=seq,
                width=width)
    out = []
    for name in schedules:
        v = virtual if name == "interleaved" else 1
        if registry.runs_as_threads(transport):
            res = comm.run_local(pp, _rank_run, name, pp, microbatches, v, compute, opts, timeout=600,
                                 transport=transport)
        else:
            from ..comm.launch import spawn

            res = spawn(pp, _rank_run, name, pp, microbatches, v, compute, opts, timeout=600, transport=transport)
        bubbles = []
        for k in range(steps):
            timeline = [[(Action(e["kind"], e["microbatch"], e["stage"]), e["start"], e["end"])
                         for e in r["events"][k]] for r in res]
            bubbles.append(bubble_fraction(timeline))
        last = [dict(e, rank=rank) for rank, r in enumerate(res) for e in r["events"][-1]]
        t0 = min(e["start"] for e in last)
        out.append({
            "schedule": name, "pp": pp, "microbatches": microbatches, "virtual": v, "compute": compute,
            "transport": transport, "theoretical_bubble": theoretical_bubble(name, pp, microbatches, v),
            "measured_bubble": statistics.median(bubbles), "measured_bubbles": bubbles,
            "peak_activation_bytes": [r["peak"] for r in res],
            "trace": {"pp": pp, "microbatches": microbatches, "schedule": name, "virtual": v,
                      "events": [dict(e, start=e["start"] - t0, end=e["end"] - t0) for e in last]},
        })
    return out
