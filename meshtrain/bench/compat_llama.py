"""A small Llama trained with dp x tp x cp x pp parallelism, written against torch.distributed's
public API only: ``loop(dist, ...)`` runs unmodified with ``dist = torch.distributed`` or
``dist = meshtrain.comm``, and ``meshtrain bench compat --layouts`` compares the two.

The model: token embedding, blocks of (RMSNorm, causal self-attention with RoPE, RMSNorm, SwiGLU
MLP), final RMSNorm, lm head, cross-entropy; fp32. Every layout trains the SAME model on the same
data: each full weight comes from a generator seeded by (seed, name) and a rank slices its shard,
and the loss is the mean over all tokens of the global batch. The parallel pieces (groups, TP
autograd functions, ring attention, 1F1B) are in ``compat_llama_parallel``.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .compat_llama_parallel import (DIMS, Mesh, build_mesh, copy_to_tp, one_f_one_b, reduce_from_tp,
                                    ring_attention)

LAYOUT_HELP = "dpN, tpN, cpN, ppN joined by 'x', e.g. dp4, pp2xdp2, tp2xcp2"


@dataclass
class LlamaConfig:
    """Model, data and optimiser sizes (fp32). ``global_batch`` sequences of ``seq`` tokens per
    step, split over dp, then into ``micro_batches`` per replica (the pipeline's micro-batches)."""

    vocab: int = 512
    dim: int = 128
    heads: int = 4
    layers: int = 4
    ffn: int = 256
    seq: int = 128
    global_batch: int = 16
    micro_batches: int = 4
    lr: float = 0.5
    seed: int = 0
    eps: float = 1e-5
    rope_theta: float = 10000.0


def parse_layout(text: str, world: int | None = None) -> dict[str, int]:
    """'pp2xdp2' -> {'pp': 2, 'dp': 2, 'cp': 1, 'tp': 1}. ValueError (naming the fix) for an unknown
    or repeated dimension, a size < 1, or a product other than ``world`` (when given)."""
    sizes = dict.fromkeys(DIMS, 1)
    seen = set()
    for part in text.strip().lower().split("x"):
        name, num = part[:2], part[2:]
        if name not in sizes or not num.isdigit() or int(num) < 1:
            raise ValueError(f"bad layout {text!r}: {part!r} is not one of {LAYOUT_HELP}")
        if name in seen:
            raise ValueError(f"bad layout {text!r}: {name} appears twice; give each dimension once")
        seen.add(name)
        sizes[name] = int(num)
    n = world_size(sizes)
    if world is not None and n != world:
        raise ValueError(f"bad layout {text!r}: its sizes multiply to {n}, not the world size {world}; "
                         f"make the product {world}")
    return sizes


def world_size(sizes: dict[str, int]) -> int:
    """The number of ranks of a layout."""
    n = 1
    for d in DIMS:
        n *= sizes[d]
    return n


def layout_name(sizes: dict[str, int]) -> str:
    """{'pp': 2, 'dp': 2, ...} -> 'pp2xdp2' (dimensions of size 1 left out; 'dp1' for one rank)."""
    return "x".join(f"{d}{sizes[d]}" for d in DIMS if sizes[d] > 1) or "dp1"


def max_reduction(sizes: dict[str, int]) -> int:
    """The most members of any sum this layout computes: the tp all-reduces of activations and
    their gradients, and the dp x cp all-reduce of gradients and of the loss (1: none at all).
    Sums of at most 2 members are exact in any order (a + b == b + a), larger ones may differ in
    the last bit between implementations that add in different orders."""
    return max(sizes["tp"], sizes["dp"] * sizes["cp"])


def check_layout(cfg: LlamaConfig, sizes: dict[str, int]) -> None:
    """ValueError (naming the fix) if the model or batch does not split evenly over ``sizes``."""
    rules = [(cfg.heads % sizes["tp"], f"heads ({cfg.heads}) must be divisible by tp ({sizes['tp']})"),
             (cfg.ffn % sizes["tp"], f"ffn ({cfg.ffn}) must be divisible by tp ({sizes['tp']})"),
             (cfg.seq % sizes["cp"], f"seq ({cfg.seq}) must be divisible by cp ({sizes['cp']})"),
             (cfg.layers % sizes["pp"], f"layers ({cfg.layers}) must be divisible by pp ({sizes['pp']})"),
             (cfg.global_batch % (sizes["dp"] * cfg.micro_batches),
              f"global batch ({cfg.global_batch}) must be divisible by dp x micro-batches "
              f"({sizes['dp']} x {cfg.micro_batches})"),
             (cfg.dim % cfg.heads or (cfg.dim // cfg.heads) % 2, f"dim ({cfg.dim}) / heads ({cfg.heads}) "
              f"must be an even head size (RoPE rotates pairs)")]
    for bad, why in rules:
        if bad:
            raise ValueError(f"layout {layout_name(sizes)}: {why}")


# ---------------------------------------------------------------------------- weights and data


_COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")  # column-parallel: output rows split over tp
_ROW = ("wo", "w_down")  # row-parallel: input columns split over tp


def full_weight(cfg: LlamaConfig, name: str) -> torch.Tensor:
    """The whole weight ``name`` of the model, the same for every layout: drawn from a generator
    seeded by (seed, name), so a rank makes only the weights of its own stage."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("norm"):
        return torch.ones(cfg.dim)
    shape = {"embed": (cfg.vocab, cfg.dim), "lm_head": (cfg.vocab, cfg.dim), "w_gate": (cfg.ffn, cfg.dim),
             "w_up": (cfg.ffn, cfg.dim), "w_down": (cfg.dim, cfg.ffn)}.get(leaf, (cfg.dim, cfg.dim))
    g = torch.Generator().manual_seed((cfg.seed << 32) + zlib.crc32(name.encode()))
    std = 1.0 if leaf == "embed" else shape[1] ** -0.5  # fan-in scaling keeps activations O(1)
    return torch.randn(shape, generator=g) * std


def shard(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s part of weight ``name`` (whole heads for attention)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _COLUMN:
        return full.chunk(tp, 0)[tp_rank]
    if leaf in _ROW:
        return full.chunk(tp, 1)[tp_rank]
    return full


def stage_names(cfg: LlamaConfig, stage: int, stages: int) -> list[str]:
    """The weights of pipeline stage ``stage`` of ``stages``, in a fixed order."""
    per = cfg.layers // stages
    names = ["embed"] if stage == 0 else []
    for layer in range(stage * per, (stage + 1) * per):
        names += [f"layers.{layer}.{w}" for w in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up",
                                                  "w_down")]
    return names + (["norm", "lm_head"] if stage == stages - 1 else [])


def global_tokens(cfg: LlamaConfig, step: int) -> torch.Tensor:
    """Step ``step``'s global batch of token ids, [global_batch, seq + 1] (inputs and shifted
    targets), from a generator seeded by (seed, step): every rank draws the same and slices it."""
    g = torch.Generator().manual_seed((cfg.seed << 32) + 1_000_003 * (step + 1))
    return torch.randint(0, cfg.vocab, (cfg.global_batch, cfg.seq + 1), generator=g)


def rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim] of RoPE at the global positions 0..seq-1."""
    hd = cfg.dim // cfg.heads
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] by position (rotate-half form); cos/sin [seq, head_dim]."""
    x1, x2 = x.chunk(2, -1)
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# ------------------------------------------------------------------------------------ the model


def block(p: dict[str, torch.Tensor], pre: str, h: torch.Tensor, cfg: LlamaConfig, mesh: Mesh,
          rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One transformer block on this rank's heads / MLP columns and sequence chunk."""
    b, n, _ = h.shape
    hd = cfg.dim // cfg.heads
    heads = cfg.heads // mesh.sizes["tp"]
    a = copy_to_tp(rms_norm(h, p[pre + "attn_norm"], cfg.eps), mesh)
    q, k, v = (F.linear(a, p[pre + w]).view(b, n, heads, hd) for w in ("wq", "wk", "wv"))
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    o = ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mesh)
    o = o.transpose(1, 2).reshape(b, n, heads * hd)
    h = h + reduce_from_tp(F.linear(o, p[pre + "wo"]), mesh)
    m = copy_to_tp(rms_norm(h, p[pre + "mlp_norm"], cfg.eps), mesh)
    mlp = F.linear(F.silu(F.linear(m, p[pre + "w_gate"])) * F.linear(m, p[pre + "w_up"]), p[pre + "w_down"])
    return h + reduce_from_tp(mlp, mesh)


def stage_forward(p: dict[str, torch.Tensor], cfg: LlamaConfig, mesh: Mesh, x: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """This rank's pipeline stage: token ids (first stage) or activations in; activations or
    logits (last stage) out."""
    stages, s = mesh.sizes["pp"], mesh.coord["pp"]
    h = F.embedding(x, p["embed"]) if s == 0 else x
    per = cfg.layers // stages
    for layer in range(s * per, (s + 1) * per):
        h = block(p, f"layers.{layer}.", h, cfg, mesh, rope)
    if s == stages - 1:
        h = F.linear(rms_norm(h, p["norm"], cfg.eps), p["lm_head"])
    return h


# ------------------------------------------------------------------------------------ the loop


def reduce_gradients(mesh: Mesh, params: list[torch.Tensor]) -> None:
    """Sum the gradients over the dp x cp group in one flat bucket (one all-reduce, as DDP's
    buckets do), in place. Each rank's loss is already its share of the global mean, so no division."""
    if mesh.dpcp is None:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    mesh.dist.all_reduce(flat, op=mesh.dist.ReduceOp.SUM, group=mesh.dpcp)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def global_loss(mesh: Mesh, local: torch.Tensor) -> float:
    """The global batch's mean loss on every rank: the last stage sums its shares over dp x cp,
    then broadcasts the total down its pipeline."""
    dist, last = mesh.dist, mesh.coord["pp"] == mesh.sizes["pp"] - 1
    if last and mesh.dpcp is not None:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=mesh.dpcp)
    if mesh.pp is not None:
        dist.broadcast(local, src=mesh.pp_ranks[-1], group=mesh.pp)
    return local.item()


def loop(dist: Any, rank: int, layout: dict[str, int] | None, cfg: LlamaConfig | None, steps: int = 0,
         warmup: int = 0, return_params: bool = False, on_timed: Callable[[], None] | None = None
         ) -> dict[str, Any]:
    """Train for ``warmup + steps`` steps with ``dist`` (torch.distributed or meshtrain.comm,
    initialised). Rank 0's ``layout``, ``cfg``, ``steps`` and ``warmup`` reach every rank by
    ``broadcast_object_list`` (the others may pass None). Returns ``times`` (seconds of each step
    from ``warmup`` on), ``losses`` (every step's global mean loss) and, if asked, ``params``
    (this rank's final weight shards by name). ``on_timed`` is called once, as the timed steps begin."""
    obj: list[Any] = [layout, cfg, steps, warmup] if rank == 0 else [None] * 4
    dist.broadcast_object_list(obj, src=0)
    sizes, cfg, steps, warmup = obj
    check_layout(cfg, sizes)
    mesh = build_mesh(dist, rank, sizes)
    c, s, stages = mesh.coord, mesh.coord["pp"], sizes["pp"]
    params = {n: shard(n, full_weight(cfg, n), c["tp"], sizes["tp"]).clone().requires_grad_()
              for n in stage_names(cfg, s, stages)}
    opt = torch.optim.SGD(list(params.values()), lr=cfg.lr, foreach=False)
    chunk = cfg.seq // sizes["cp"]
    cols = slice(c["cp"] * chunk, (c["cp"] + 1) * chunk)  # this rank's contiguous sequence chunk
    rope = tuple(t[cols] for t in rope_tables(cfg))
    rows = cfg.global_batch // sizes["dp"]
    mb = rows // cfg.micro_batches
    total_tokens = cfg.global_batch * cfg.seq
    times, losses = [], []
    for step in range(warmup + steps):
        if step == warmup and on_timed is not None:
            on_timed()  # the timed steps begin (the bench's communication clock starts here)
        tokens = global_tokens(cfg, step)[c["dp"] * rows:(c["dp"] + 1) * rows]
        inputs, targets = tokens[:, :-1][:, cols], tokens[:, 1:][:, cols]
        t0 = time.perf_counter()
        local = torch.zeros(1)

        def forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
            out = stage_forward(params, cfg, mesh, inputs[i * mb:(i + 1) * mb] if x is None else x, rope)
            if s < stages - 1:
                return out
            loss = F.cross_entropy(out.flatten(0, 1), targets[i * mb:(i + 1) * mb].flatten(),
                                   reduction="sum") / total_tokens  # this micro-batch's share of the mean
            local.add_(loss.detach())
            return loss

        one_f_one_b(mesh, cfg.micro_batches, forward, (mb, chunk, cfg.dim), torch.float32)
        reduce_gradients(mesh, list(params.values()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(global_loss(mesh, local))
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"times": times, "losses": losses}
    if return_params:
        out["params"] = {n: p.detach().clone() for n, p in params.items()}
    return out
