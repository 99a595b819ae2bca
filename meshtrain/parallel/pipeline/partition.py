"""Split a Llama's layers into pipeline stages, balanced by the parameters a token uses.

The embedding goes with the first stage and the final norm and head with the last; every stage
holds at least one decoder block. A stage is the full model with the other blocks removed, so every
parameter keeps its full-model name (what init-by-name and checkpoints rely on).
"""

from __future__ import annotations

import copy

from torch import nn

from ...errors import ConfigError
from ...models.moe import MoE


def balanced_partition(costs: list[float], n_stages: int, first_extra: float = 0.0,
                       last_extra: float = 0.0) -> list[range]:
    """Contiguous ranges of ``costs`` (one per stage, none empty) that minimise the largest stage's
    cost, where stage 0 also pays ``first_extra`` and the last stage ``last_extra``."""
    n = len(costs)
    if n_stages < 1:
        raise ConfigError(f"the number of pipeline stages must be at least 1, got {n_stages}")
    if n < n_stages:
        raise ConfigError(
            f"{n} layers cannot fill {n_stages} pipeline stages (pp x virtual stages); every stage needs "
            f"at least one layer: use pp*virtual <= n_layers or a deeper model"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == n_stages - 1 else 0.0)

    # best[s][j]: the smallest max-cost for the first j layers in s+1 stages (exact DP; n is small)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                v = max(best[s - 1][i], cost(s, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    bounds = [n]
    for s in range(n_stages - 1, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


def _numel(m: nn.Module | None) -> int:
    return 0 if m is None else sum(p.numel() for p in m.parameters())


def _cost(block: nn.Module) -> float:
    """A block's compute, as the parameters a token uses: a mixture-of-experts layer's routed
    experts count top_k of n_experts (its memory is another matter: every expert is held)."""
    cost = float(_numel(block))
    for m in block.modules():
        if isinstance(m, MoE):
            cost -= _numel(m.experts) * (1 - m.top_k / m.n_experts)
    return cost


def split_stages(model: nn.Module, n_stages: int, stage_ids: list[int]) -> dict[int, nn.Module]:
    """Copies of ``model`` (a ``Llama``, ideally on the meta device) for the given global stage
    ids: each keeps its share of ``model.layers``; only stage 0 keeps ``tok_emb``, only the last
    keeps ``norm`` and ``head``."""
    if n_stages > 1 and model.cfg.tie_embeddings:
        raise ConfigError("tie_embeddings=true needs the embedding and the head on one stage; with pipeline "
                          "parallelism set model.tie_embeddings=false (or pp=1)")
    keys = list(model.layers.keys())
    ranges = balanced_partition([_cost(model.layers[k]) for k in keys], n_stages,
                                first_extra=_numel(model.tok_emb),
                                last_extra=_numel(model.norm) + _numel(model.head))
    out: dict[int, nn.Module] = {}
    for s in stage_ids:
        stage = copy.deepcopy(model)
        for i, k in enumerate(keys):
            if i not in ranges[s]:
                del stage.layers[k]
        if s != 0:
            stage.tok_emb = None
        if s != n_stages - 1:
            stage.norm = None
            stage.head = None
        out[s] = stage
    return out
