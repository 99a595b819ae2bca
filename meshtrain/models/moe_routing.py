"""Routing for the MoE layer (``moe.py``): the router, capacity dropping, and the load-balancing
auxiliary loss with the autograd function that trains it without being added to the loss.

The router runs in fp32 whatever the autocast: routing decisions and the auxiliary loss are
sensitive to rounding, and the gate is a small matmul. The choice of experts uses the scores plus
``expert_bias`` (DeepSeek-V3's auxiliary-loss-free balancing), the weights use the scores alone.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config.model import LlamaConfig


class Routing(NamedTuple):
    """What the router decides for T tokens (k = top_k, E = experts)."""

    scores: Tensor
    """(T, E) float32: softmax or sigmoid of the logits, unbiased, with gradient."""
    expert_idx: Tensor
    """(T, k) long: the chosen experts, best first (chosen by scores + expert_bias)."""
    weights: Tensor
    """(T, k) float32: the chosen experts' scores, normalised and scaled as configured."""


class Router(nn.Module):
    """Token -> top-k experts and their weights. ``gate`` is the [E, dim] projection;
    ``expert_bias`` (float32 [E], zeros at init) shifts only which experts are chosen."""

    compute_fp32 = True
    """Its parameters compute in fp32 whatever the model's precision (mixed-precision wrappers such
    as ZeRO keep their compute copy in fp32): a rounded gate changes which experts win."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.score = cfg.router_score
        self.norm = cfg.route_norm
        self.scale = cfg.route_scale
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> Routing:
        """x: (T, dim) tokens."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
            scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
            # the bias may be held in a lower precision by mixed precision: add it in fp32
            biased = scores.detach() + self.expert_bias.float()
            expert_idx = torch.topk(biased, self.top_k, dim=-1).indices
            weights = scores.gather(1, expert_idx)
            if self.norm:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            if self.scale != 1.0:
                weights = weights * self.scale
        return Routing(scores, expert_idx, weights)


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Assignments one expert takes of a call routing ``tokens`` tokens: ceil(cf * T * k / E)."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def drop_over_capacity(expert_idx: Tensor, n_experts: int, capacity: int) -> Tensor:
    """``expert_idx`` (T, k) with every assignment past its expert's first ``capacity`` set to -1.
    Assignments are taken in order t * k + j: earlier tokens first, and a token's choices in
    order. A stable sort by expert gives each assignment its place in its expert's queue."""
    flat = expert_idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    per_expert = torch.bincount(flat, minlength=n_experts)
    starts = per_expert.cumsum(0) - per_expert
    place = torch.empty_like(flat)
    place[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return torch.where(place < capacity, flat, -1).view_as(expert_idx)


def balance_probs(scores: Tensor, score: str) -> Tensor:
    """The scores normalised per token to sum to one (softmax scores already do)."""
    return scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)


def sequence_aux_loss(probs: Tensor, expert_idx: Tensor, rows: int, coef: float, global_rows: int,
                      reduce: Callable[[Tensor], Tensor]) -> Tensor:
    """This rank's part of DeepSeek-V3's sequence-wise balance loss.

    ``probs`` (T, E) and ``expert_idx`` (T, k, before dropping) are this rank's tokens of ``rows``
    sequences, T = rows * S_local. The expert counts and token counts of each sequence are summed
    over the ranks holding its other tokens by ``reduce`` (one call, detached), so f and S_b are the
    whole sequence's, while the gradient flows only through this rank's probabilities: summed over
    those ranks the parts are coef / global_rows * sum_b sum_i f_bi * P_bi.
    """
    t, e = probs.shape
    k = expert_idx.shape[1]
    row = torch.arange(t, device=probs.device) // (t // rows)
    counts = torch.bincount((row[:, None] * e + expert_idx).reshape(-1), minlength=rows * e).view(rows, e)
    tokens = torch.full((rows, 1), t // rows, dtype=probs.dtype, device=probs.device)
    stats = reduce(torch.cat([counts.to(probs.dtype), tokens], 1).detach())
    counts, tokens = stats[:, :e], stats[:, e:]
    f = counts * (e / k) / tokens
    p = probs.view(rows, t // rows, e).sum(1) / tokens
    return (f * p).sum() * (coef / global_rows)


def batch_aux_loss(probs: Tensor, counts: Tensor, top_k: int, coef: float, microbatches: int,
                   reduce: Callable[[Tensor], Tensor]) -> Tensor:
    """This rank's part of the Switch/GShard balance loss over the global micro-batch: ``counts``
    (E,) are this rank's expert choices (before dropping); with the token count they are summed
    over the micro-batch's ranks by ``reduce``; divided by ``microbatches`` so a step averages."""
    t, e = probs.shape
    stats = reduce(torch.cat([counts.to(probs.dtype), probs.new_full((1,), t)]).detach())
    counts, tokens = stats[:e], stats[e]
    f = counts * (e / top_k) / tokens
    p = probs.sum(0) / tokens
    return (f * p).sum() * (coef / microbatches)


class AuxLossInjector(torch.autograd.Function):
    """Identity on the layer output; in backward it also gives the auxiliary loss the constant
    gradient ``scale`` (Megatron's MoEAuxLossAutoScaler). The loss is trained without being added
    to the training loss, so it passes pipeline stages and activation checkpointing unchanged."""

    @staticmethod
    def forward(ctx, out: Tensor, aux: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        """Returns ``out``; remembers the auxiliary loss's shape and the gradient to give it."""
        ctx.aux_like = (aux.dtype, aux.device)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        """The output's gradient passes; the auxiliary loss gets ``scale``."""
        dtype, device = ctx.aux_like
        return grad, torch.full((), float(ctx.scale), dtype=dtype, device=device), None


__all__ = ["Routing", "Router", "expert_capacity", "drop_over_capacity", "balance_probs",
           "sequence_aux_loss", "batch_aux_loss", "AuxLossInjector"]
