"""The expert-parallel dispatcher against the one-process one: the same outputs and gradients for
tokens, dropped assignments, experts that get no token and ranks that send or receive none."""

from __future__ import annotations

import pytest
import torch

from meshtrain import comm
from meshtrain.models.moe import GroupedExperts, LocalDispatcher
from meshtrain.parallel.expert import AllToAllDispatcher, expert_major

E, DIM, HIDDEN, K = 8, 6, 5, 2


def test_expert_major_reorders_source_blocks_by_expert():
    matrix = [[2, 0, 1], [0, 3, 1]]  # 2 sources x 3 local experts
    rows, at = [], 0
    for s in range(2):  # received: source-major blocks
        for e in range(3):
            rows += [(e, s, at + i) for i in range(matrix[s][e])]
            at += matrix[s][e]
    want = [r for _, _, r in sorted(rows)]  # expert-major, then source, then arrival
    assert expert_major(matrix).tolist() == want
    assert expert_major([[0, 0], [0, 0]]).tolist() == []


def _inputs(rank: int, tokens: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, DIM, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, K, dtype=torch.long)
    if mode == "drops":
        idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    elif mode == "one-rank":  # every token to experts 0 and 1: rank 0 holds them, the others get nothing
        idx = torch.tensor([[0, 1]] * tokens, dtype=torch.long).view(tokens, K)
    return x, idx


def _experts(seed: int = 7) -> GroupedExperts:
    g = torch.Generator().manual_seed(seed)  # not the global generator: ranks are threads
    ex = GroupedExperts(E, DIM, HIDDEN)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return ex


def _run(dispatcher, experts, x, idx):
    x = x.clone().requires_grad_(True)
    routed, counts, state = dispatcher.dispatch(x, idx)
    y = dispatcher.combine(experts(routed, counts), state)
    w = torch.linspace(0.5, 1.5, y.numel()).view_as(y)
    (y * w).sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("ep, mode", [(2, "random"), (4, "random"), (2, "drops"), (4, "one-rank"), (2, "empty-rank")])
def test_all_to_all_dispatch_equals_the_local_one(ep, mode):
    """Each rank's tokens through the all-to-all dispatcher and its E/ep experts give the outputs
    and input gradients of the local dispatcher with all experts, and the experts' gradients
    summed over the ranks' tokens."""
    sizes = [0 if (mode == "empty-rank" and r == 1) else 5 + r for r in range(ep)]

    def fn(rank):
        full = _experts()
        local = GroupedExperts(E // ep, DIM, HIDDEN)
        n = E // ep
        with torch.no_grad():
            for name, p in local.named_parameters():
                p.copy_(getattr(full, name)[rank * n : (rank + 1) * n])
        x, idx = _inputs(rank, sizes[rank], mode)
        y, gx = _run(AllToAllDispatcher(comm.current().world, E), local, x, idx)
        return y, gx, {n_: p.grad.clone() for n_, p in local.named_parameters()}

    out = comm.run_local(ep, fn, timeout=60)
    ref = _experts()
    for rank in range(ep):
        x, idx = _inputs(rank, sizes[rank], mode)
        y, gx = _run(LocalDispatcher(E), ref, x, idx)
        torch.testing.assert_close(out[rank][0], y, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[rank][1], gx, rtol=1e-6, atol=1e-6)
        if mode in ("drops", "random"):
            assert (idx < 0).any() == (mode == "drops")
    for name, p in ref.named_parameters():  # the experts' gradients: every rank's tokens, summed
        got = torch.cat([g[name] for _, _, g in out])
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(got).all()
