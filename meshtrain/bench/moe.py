"""``meshtrain bench moe``: mixture-of-experts pieces, each against its peer in the same run.

* ``dispatch``: the token all-to-all of expert parallelism (uneven splits, taken from the routing
  of a real model on random tokens) through ``meshtrain.comm.all_to_all_single`` on the shm
  transport against gloo's own ``torch.distributed.all_to_all_single``, in the same processes.
* ``experts``: ``GroupedExperts`` (every expert in one batched matmul) against a Python loop of
  ``F.linear`` per expert over its tokens, forward + backward, with the same weights; the two
  results are compared.
* ``train``: one training step of a ``ParallelModel`` (the trainer's step: forward/backward, clip,
  AdamW) at ep2 against ep1 on the same ranks and global batch; tokens/s of each, and the share of
  the step spent inside the dispatcher (``TimedDispatcher``: dispatch and combine, forward and
  backward) and in the all-to-alls alone (``comm.stats``).

Trials interleave the two sides of each comparison; the parent takes the median over trials.
Argument handling and printing are in ``moe_cli.py``.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# ------------------------------------------------------------------------------------ shared helpers


def spread(values: list[float]) -> dict[str, float]:
    """The median of ``values`` and their range."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


# ------------------------------------------------------------------------------- 1. dispatch all-to-all


def routing_matrices(preset: str, world: int, batch: int, seq: int, seed: int = 0) -> list[list[list[int]]]:
    """Per MoE layer, the rows rank i sends rank j in the token all-to-all of a training step at
    ep = ``world`` (experts split evenly, rank j holding experts j*E/world ... ), from routing the
    preset's model (``init_weights`` seed ``seed``) on a random global batch (batch, seq) whose
    rows are split over the ranks as data parallelism splits them. One process, no gradient."""
    from ..models.llama import PRESETS, Llama, init_weights
    from ..models.moe import LocalDispatcher, moe_layers

    cfg = PRESETS[preset]
    if not cfg.n_experts or cfg.n_experts % world or batch % world:
        raise ValueError(f"{preset}: need n_experts ({cfg.n_experts}) and batch ({batch}) divisible by {world}")
    model = Llama(cfg)
    init_weights(model, seed=seed)
    seen: list[Tensor] = []

    class Recorder(LocalDispatcher):
        def dispatch(self, x: Tensor, expert_idx: Tensor) -> Any:
            seen.append(expert_idx.detach().clone())
            return super().dispatch(x, expert_idx)

    for _, layer in moe_layers(model):
        layer.dispatcher = Recorder(cfg.n_experts)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        model(tokens)
    per_rank, n_local = batch * seq // world, cfg.n_experts // world
    out = []
    for idx in seen:  # (batch * seq, k), token t of row t // seq
        m = []
        for r in range(world):
            mine = idx[r * per_rank:(r + 1) * per_rank].reshape(-1)
            mine = mine[mine >= 0]
            m.append(torch.bincount(mine // n_local, minlength=world).tolist())
        out.append(m)
    return out


def _a2a_inputs(matrices: list[list[list[int]]], rank: int, dim: int) -> list[tuple]:
    """Per layer: (dispatch input, its send splits, receive splits, the expected output)."""
    world = len(matrices[0])
    cases = []
    for m in matrices:
        send, recv = m[rank], [m[i][rank] for i in range(world)]
        inp = (rank * 100000 + torch.arange(sum(send), dtype=torch.float32))[:, None].expand(-1, dim).contiguous()
        parts = []
        for i in range(world):  # rank i's rows for me: its rows after those for ranks < me
            start = sum(m[i][:rank])
            parts.append(i * 100000 + torch.arange(start, start + m[i][rank], dtype=torch.float32))
        expected = torch.cat(parts)[:, None].expand(-1, dim)
        cases.append((inp, send, recv, expected))
    return cases


def _a2a_round(fn: Any, cases: list[tuple], outs: list[tuple[Tensor, Tensor]]) -> None:
    """Every layer's dispatch all-to-all, then its combine (the reverse splits)."""
    for (inp, send, recv, _), (out, back) in zip(cases, outs):
        fn(out, inp, recv, send)
        fn(back, out, send, recv)


def dispatch_worker(rank: int, matrices: list[list[list[int]]], dim: int, iters: int, warmup: int,
                    trials: int) -> dict[str, Any]:
    """Runs in each rank (torch.distributed on gloo and meshtrain.comm on shm, both initialised):
    per trial, ``iters`` rounds through each implementation, alternating which goes first. Returns
    this rank's seconds per round per trial, and the rows each got wrong."""
    import torch.distributed as dist

    from .. import comm

    impls = {"meshtrain-shm": comm.all_to_all_single, "gloo": dist.all_to_all_single}
    cases = _a2a_inputs(matrices, rank, dim)
    outs = [(torch.empty(sum(recv), dim), torch.empty(sum(send), dim)) for _, send, recv, _ in cases]
    wrong: dict[str, int] = {}
    for name, fn in impls.items():
        for o, b in outs:
            o.fill_(-1.0)
            b.fill_(-1.0)
        _a2a_round(fn, cases, outs)
        wrong[name] = sum(int((o != c[3]).any(1).sum()) + int((b != c[0]).any(1).sum()) for (o, b), c in zip(outs, cases))
        for _ in range(warmup):
            _a2a_round(fn, cases, outs)
    times: dict[str, list[float]] = {n: [] for n in impls}
    names = list(impls)
    for t in range(trials):
        for name in (names if t % 2 == 0 else names[::-1]):
            _barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                _a2a_round(impls[name], cases, outs)
            times[name].append((time.perf_counter() - t0) / iters)
    sent = [sum(c[1]) - c[1][rank] for c in cases]  # rows leaving this rank per dispatch call
    return {"round_s": times, "wrong": wrong, "rows_sent": sent}


def run_dispatch(matrices: list[list[list[int]]], dim: int, iters: int, warmup: int, trials: int,
                 timeout: float) -> dict[str, Any]:
    """Spawn len(matrices[0]) ranks on the shm transport and time both all-to-alls there.
    Per trial, an implementation's round time is the slowest rank's; then the median over trials,
    and the ratio gloo / meshtrain per trial."""
    from ..comm.launch import spawn

    world = len(matrices[0])
    res = spawn(world, dispatch_worker, matrices, dim, iters, warmup, trials, timeout=timeout, transport="shm")
    per = {n: [max(r["round_s"][n][t] for r in res) for t in range(trials)] for n in res[0]["round_s"]}
    calls = 2 * len(matrices)
    ratios = [g / m for g, m in zip(per["gloo"], per["meshtrain-shm"])]
    med = {n: statistics.median(v) for n, v in per.items()}
    rows = [sum(m[i][j] for i in range(world) for j in range(world) if i != j) / world for m in matrices]
    return {
        "world": world, "layers": len(matrices), "dim": dim, "iters": iters, "trials": trials,
        "matrices": matrices, "calls_per_round": calls,
        "bytes_per_rank_per_call": 4 * dim * statistics.mean(rows),
        "round_s": med, "trials_round_s": per,
        "call_us": {n: v / calls * 1e6 for n, v in med.items()},
        "ratio": med["gloo"] / med["meshtrain-shm"], "trials_ratio": ratios,
        "wrong": {n: sum(r["wrong"][n] for r in res) for n in per},
    }


# ----------------------------------------------------------------------- 2. grouped experts vs a loop


class LoopExperts(torch.nn.Module):
    """What a user writes without grouped matmuls (Mixtral's layout in Hugging Face transformers):
    one module per expert with its own w1, w3, w2 ``nn.Linear``, and a Python loop over
    ``torch.split(x, counts)`` (as torchtitan's for-loop experts; slicing instead would make each
    slice's backward a full-size zero tensor) that runs each expert's rows through
    w2(silu(w1 x) * w3 x); the outputs concatenated in the same (expert-major) order. Made from a
    ``GroupedExperts``, with copies of its weights."""

    def __init__(self, grouped: Any) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList()
        for e in range(grouped.n_experts):
            expert = torch.nn.Module()
            for name in ("w1", "w3", "w2"):
                w = getattr(grouped, name)[e]
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                with torch.no_grad():
                    lin.weight.copy_(w)
                setattr(expert, name, lin)
            self.experts.append(expert)

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        outs = [e.w2(F.silu(e.w1(xe)) * e.w3(xe)) for e, xe in zip(self.experts, torch.split(x, counts))]
        return torch.cat(outs)

    def stacked_grads(self) -> list[Tensor]:
        """The weight gradients as GroupedExperts holds them: w1, w3, w2 each [E, out, in]."""
        return [torch.stack([getattr(e, n).weight.grad for e in self.experts]) for n in ("w1", "w3", "w2")]


def routed_counts(n_experts: int, tokens: int, top_k: int, dim: int, seed: int) -> list[int]:
    """Rows per expert of ``tokens`` random tokens routed top-k by a random linear router."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g)
    gate = torch.randn(n_experts, dim, generator=g) / dim ** 0.5
    idx = torch.topk(x @ gate.t(), top_k, dim=1).indices
    return torch.bincount(idx.reshape(-1), minlength=n_experts).tolist()


def _fwd_bwd(module: torch.nn.Module, x: Tensor, counts: list[int], grad: Tensor) -> tuple[Tensor, Tensor]:
    """One forward and backward from fresh gradients; returns the output and x's gradient."""
    for p in module.parameters():
        p.grad = None
    xi = x.detach().requires_grad_()
    out = module(xi, counts)
    out.backward(grad)
    return out.detach(), xi.grad


def run_experts(n_experts: int, dim: int, hidden: int, tokens: int, top_k: int, reps: int, trials: int,
                seed: int = 0) -> dict[str, Any]:
    """Forward + backward of ``GroupedExperts`` and of ``LoopExperts`` (same weights, tokens and
    output gradient), ``reps`` each per trial, alternating which goes first. A first untimed pass
    of each (also the warm-up) compares the outputs, the input's gradient and every weight
    gradient (``same``: allclose at rtol 1e-4; ``max_rel_diff``: the largest difference over the
    largest magnitude, per tensor)."""
    from ..models.moe import GroupedExperts

    torch.manual_seed(seed)
    grouped = GroupedExperts(n_experts, dim, hidden)
    loop = LoopExperts(grouped)
    counts = routed_counts(n_experts, tokens, top_k, dim, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(counts), dim, generator=g)
    grad = torch.randn(sum(counts), dim, generator=g)
    impls: dict[str, torch.nn.Module] = {"grouped": grouped, "loop": loop}
    got = {n: _fwd_bwd(m, x, counts, grad) for n, m in impls.items()}
    pairs = list(zip([*got["grouped"], grouped.w1.grad, grouped.w3.grad, grouped.w2.grad],
                     [*got["loop"], *loop.stacked_grads()]))
    diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in pairs)
    same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max())) for a, b in pairs)
    times: dict[str, list[float]] = {n: [] for n in impls}
    names = list(impls)
    for t in range(trials):
        for name in (names if t % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            for _ in range(reps):
                _fwd_bwd(impls[name], x, counts, grad)
            times[name].append((time.perf_counter() - t0) / reps)
    med = {n: statistics.median(v) for n, v in times.items()}
    return {"experts": n_experts, "dim": dim, "hidden": hidden, "tokens": tokens, "top_k": top_k,
            "rows": sum(counts), "max_rows": max(counts), "min_rows": min(counts), "threads": torch.get_num_threads(),
            "step_s": med, "trials_step_s": times, "ratio": med["loop"] / med["grouped"],
            "trials_ratio": [lp / gr for lp, gr in zip(times["loop"], times["grouped"])],
            "same": same, "max_rel_diff": diff}


# ------------------------------------------------------------------------------------ 3. training step


class DispatchClock:
    """Wall time spent inside the dispatchers of one rank: forward (the calls themselves) and
    backward (from the gradient reaching a call's output to it leaving the call's input)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds = {"dispatch_fwd": 0.0, "dispatch_bwd": 0.0, "combine_fwd": 0.0, "combine_bwd": 0.0}
        self._open: dict[int, float] = {}
        self._next = 0

    def key(self) -> int:
        self._next += 1
        return self._next

    def reset(self) -> None:
        with self.lock:
            self.seconds = dict.fromkeys(self.seconds, 0.0)
            self._open.clear()

    def backward_mark(self, key: int, at_output: bool, what: str) -> None:
        now = time.perf_counter()
        with self.lock:
            if at_output:  # backward enters the call's region
                self._open[key] = now
            elif key in self._open:  # and leaves it
                self.seconds[f"{what}_bwd"] += now - self._open.pop(key)


class _Mark(torch.autograd.Function):
    """Identity; its backward tells the clock that the gradient passed here."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, clock: DispatchClock, key: int, at_output: bool, what: str) -> Tensor:  # type: ignore[override]
        ctx.args = (clock, key, at_output, what)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:  # type: ignore[override]
        clock, key, at_output, what = ctx.args
        clock.backward_mark(key, at_output, what)
        return g, None, None, None, None


class TimedDispatcher:
    """Wraps a MoE layer's dispatcher (``LocalDispatcher`` or ``AllToAllDispatcher``) and adds the
    time inside ``dispatch`` and ``combine`` (forward and backward) to a ``DispatchClock``. The
    experts' matmuls, the router and the weighting of the outputs lie outside both calls."""

    def __init__(self, inner: Any, clock: DispatchClock) -> None:
        self.inner, self.clock = inner, clock

    def _timed(self, what: str, call: Any, x: Tensor, *args: Any) -> tuple:
        clock, key = self.clock, self.clock.key()
        t0 = time.perf_counter()
        out = call(_Mark.apply(x, clock, key, False, what), *args)
        first = out[0] if isinstance(out, tuple) else out
        first = _Mark.apply(first, clock, key, True, what)
        clock.seconds[f"{what}_fwd"] += time.perf_counter() - t0
        return (first, *out[1:]) if isinstance(out, tuple) else (first,)

    def dispatch(self, x: Tensor, expert_idx: Tensor) -> tuple:
        return self._timed("dispatch", self.inner.dispatch, x, expert_idx)

    def combine(self, y: Tensor, state: Any) -> Tensor:
        return self._timed("combine", self.inner.combine, y, state)[0]


def _all_to_all_seconds() -> float:
    from .. import comm

    return sum(g["ops"].get("all_to_all", {}).get("time_s", 0.0) for g in comm.stats().values())


def train_worker(rank: int, preset: str, ep: int, batch: int, seq: int, steps: int, warmup: int,
                 seed: int = 0) -> dict[str, Any]:
    """Runs in each rank: a ``ParallelModel`` of ``preset`` at dp = world with ``ep`` carved out,
    the trainer's step (forward_backward, clip_grad_norm_(1.0), one host read, AdamW step,
    zero_grad) on random global batches; ``warmup`` untimed steps, then ``steps`` timed ones."""
    import torch.distributed as dist

    from .. import comm
    from ..mesh import Mesh
    from ..models.llama import PRESETS
    from ..models.moe import moe_layers
    from ..parallel.parallel_model import ParallelModel, unwrap
    from ..parallel.parallelize import ParallelConfig

    cfg = PRESETS[preset]
    world = dist.get_world_size()
    model = ParallelModel(cfg, Mesh(dp=world, ep=ep), ParallelConfig(), seed=seed)
    clock = DispatchClock()
    for stage in model.stages.values():
        for _, layer in moe_layers(unwrap(stage)):
            layer.dispatcher = TimedDispatcher(layer.dispatcher, clock)
    opt = model.build_optimizer(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    data = torch.randint(0, cfg.vocab_size, (warmup + steps, batch, seq + 1),
                         generator=torch.Generator().manual_seed(seed + 7))
    step_s, losses = [], []
    phases = dict.fromkeys(("forward_backward", "clip", "optimizer"), 0.0)
    a2a, start = 0.0, time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            comm.barrier()
            clock.reset()
            a2a = _all_to_all_seconds()
            start = time.perf_counter()
        t0 = time.perf_counter()
        loss = model.forward_backward(data[i, :, :-1], data[i, :, 1:])
        t1 = time.perf_counter()
        norm = opt.clip_grad_norm_(1.0)
        loss_v, _ = torch.stack([loss.double(), norm.double()]).tolist()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        losses.append(loss_v)
        if i >= warmup:
            step_s.append(time.perf_counter() - t0)
            for k, v in (("forward_backward", t1 - t0), ("clip", t2 - t1), ("optimizer", time.perf_counter() - t2)):
                phases[k] += v
    elapsed = time.perf_counter() - start
    a2a = _all_to_all_seconds() - a2a
    local = sum(p.numel() for _, p in model.named_parameters())
    return {"elapsed_s": elapsed, "step_s": step_s, "dispatch_s": dict(clock.seconds), "all_to_all_s": a2a,
            "phases_s": phases,
            "losses": losses, "local_params": local}


def run_train(preset: str, world: int, eps: list[int], batch: int, seq: int, steps: int, warmup: int,
              trials: int, timeout: float) -> dict[str, Any]:
    """Each ep in ``eps`` on ``world`` fresh ranks (shm transport, as the trainer on one host),
    interleaved over ``trials``. Per trial: tokens/s from the slowest rank's elapsed time, and the
    dispatcher's and all-to-alls' shares of the step (the mean over ranks of each rank's time in
    them over its elapsed time). Medians over trials."""
    from ..comm.launch import spawn

    per: dict[int, list[dict[str, Any]]] = {ep: [] for ep in eps}
    for t in range(trials):
        for ep in (eps if t % 2 == 0 else eps[::-1]):
            res = spawn(world, train_worker, preset, ep, batch, seq, steps, warmup, timeout=timeout,
                        transport="shm", comm_timeout=max(60.0, timeout / 2))
            elapsed = max(r["elapsed_s"] for r in res)
            per[ep].append({
                "tokens_per_s": batch * seq * steps / elapsed,
                "step_s": elapsed / steps,
                "dispatch_share": statistics.mean(sum(r["dispatch_s"].values()) / r["elapsed_s"] for r in res),
                "all_to_all_share": statistics.mean(r["all_to_all_s"] / r["elapsed_s"] for r in res),
                "parts_s": {k: statistics.mean(r["dispatch_s"][k] for r in res) / steps for k in res[0]["dispatch_s"]},
                "phases_s": {k: statistics.mean(r["phases_s"][k] for r in res) / steps for k in res[0]["phases_s"]},
                "losses": res[0]["losses"], "local_params": max(r["local_params"] for r in res),
            })
    out: dict[str, Any] = {"preset": preset, "world": world, "batch": batch, "seq": seq, "steps": steps,
                           "warmup": warmup, "trials": trials, "layouts": {}}
    for ep, rs in per.items():
        out["layouts"][ep] = {
            "label": f"ep{ep} x dp{world // ep}",
            **{k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "step_s", "dispatch_share", "all_to_all_share")},
            "trials_tokens_per_s": [r["tokens_per_s"] for r in rs],
            "trials_dispatch_share": [r["dispatch_share"] for r in rs],
            "parts_s": {k: statistics.median(r["parts_s"][k] for r in rs) for k in rs[0]["parts_s"]},
            "phases_s": {k: statistics.median(r["phases_s"][k] for r in rs) for k in rs[0]["phases_s"]},
            "losses": rs[-1]["losses"], "local_params": rs[-1]["local_params"],
        }
    if len(eps) == 2:
        a, b = eps
        out["ratio"] = out["layouts"][a]["tokens_per_s"] / out["layouts"][b]["tokens_per_s"]
        out["trials_ratio"] = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(per[a], per[b])]
    return out
