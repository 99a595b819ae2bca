"""Deterministic per-rank inputs and plain-torch references for the collective tests."""

from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)


def make_input(seed: int, rank: int, shape: tuple, dtype: torch.dtype, op: str = "sum") -> torch.Tensor:
    """The tensor rank ``rank`` contributes; every thread can recompute every rank's input."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype in INTS:
        lo, hi = (-2, 3) if op == "prod" else (-50, 50)
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if op == "prod":
        x = 1 + x / 8  # products of values near 1 stay well inside every dtype's range
    return x.to(dtype)


def reduce_ref(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of ``xs`` computed in fp64 (ints: int64), cast to their dtype."""
    dtype = xs[0].dtype
    acc_t = torch.int64 if dtype in INTS else torch.float64
    stack = torch.stack([x.to(acc_t) for x in xs])
    if op == "sum":
        out = stack.sum(0)
    elif op == "avg":
        out = stack.sum(0) / len(xs)
    elif op == "max":
        out = stack.max(0).values
    elif op == "min":
        out = stack.min(0).values
    elif op == "prod":
        out = stack.prod(0)
    else:
        raise AssertionError(op)
    return out.to(dtype)


def assert_reduced(got: torch.Tensor, want: torch.Tensor, op: str, nranks: int) -> None:
    """Exact for integers, max and min; a tolerance of a few ulps of the dtype for float sums."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if got.dtype in INTS or op in ("max", "min"):
        assert torch.equal(got, want), (got, want)
        return
    eps = {torch.float32: 1e-6, torch.float64: 1e-14, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[got.dtype]
    # fp32 accumulation over p terms of size ~|x|: error grows with p; half types round once at the end
    rtol = eps * (4 if got.dtype in (torch.float16, torch.bfloat16) else 4 * nranks)
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * 4)
