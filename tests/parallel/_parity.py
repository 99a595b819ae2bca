"""Shared pieces of the loss-parity tests: data, the one-process reference in plain PyTorch, and
the per-rank training function (module level, so real processes can run it too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtrain.models.llama import PRESETS, Llama, init_weights

CFG = PRESETS["test"]
BATCH, SEQ, LR = 4, 16, 1e-3


def batches(steps: int) -> list[torch.Tensor]:
    """Global batches of token ids, (BATCH, SEQ + 1): inputs are [:, :-1], targets [:, 1:]."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(steps)]


def reference(steps: int, clip: float = 0.0, autocast: torch.dtype | None = None
              ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain torch: per-step losses and the first step's gradients by name. With
    ``clip`` > 0 gradients are clipped to that global norm and the losses come with the norms;
    with ``autocast`` the forward runs under ``torch.autocast("cpu", autocast)``."""
    model = Llama(CFG)
    init_weights(model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for i, d in enumerate(batches(steps)):
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            logits = model(d[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), d[:, 1:].flatten())
        loss.backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip else None
        opt.step()
        opt.zero_grad()
        losses.append((loss.item(), norm.item()) if clip else loss.item())
    return losses, grads


def train_rank(rank: int, layout: dict, config: dict, steps: int, clip: float = 0.0) -> tuple[list, dict]:
    """Train under ``layout`` for ``steps``; returns the losses and the first step's local gradients
    as {name: (grad, shard)} (gradients only without ZeRO, which moves them into flat shards)."""
    from meshtrain.mesh import Mesh
    from meshtrain.parallel.parallel_model import ParallelModel
    from meshtrain.parallel.parallelize import ParallelConfig

    mesh = Mesh(**layout)
    model = ParallelModel(CFG, mesh, ParallelConfig(**config), seed=0)
    opt = model.build_optimizer(torch.optim.AdamW, lr=LR)
    losses, grads = [], {}
    for i, d in enumerate(batches(steps)):
        losses.append(model.forward_backward(d[:, :-1], d[:, 1:]).item())
        if i == 0 and not config.get("zero_stage"):
            grads = {n: (p.grad.clone(), _split(p)) for n, p in model.named_parameters()}
        if clip:
            losses[-1] = (losses[-1], opt.clip_grad_norm_(clip).item())
        opt.step()
        opt.zero_grad()
    return losses, grads


def _split(p: torch.Tensor) -> tuple[int, int, int]:
    """(dim, index, parts) of a parameter's tensor-parallel split, from its placement."""
    from meshtrain.placement import placement_of

    splits = placement_of(p).splits
    return (splits[0].dim, splits[0].index, splits[0].parts) if splits else (0, 0, 1)


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Full gradients from every rank's {name: (local grad, (dim, index, parts))}: tp slices are
    concatenated in index order; replicas (dp, cp, other tp ranks) must agree exactly enough."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int] = {}
    for grads in per_rank:
        for name, (g, (dim, index, _)) in grads.items():
            have = pieces.setdefault(name, {})
            if index in have:
                torch.testing.assert_close(g, have[index], rtol=1e-5, atol=1e-7)
            else:
                have[index] = g
            dims[name] = dim
    return {n: torch.cat([p[i] for i in sorted(p)], dim=dims[n]) for n, p in pieces.items()}
