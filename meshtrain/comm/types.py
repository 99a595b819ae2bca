"""Reduce operations, dtype rules and element-wise combine functions shared by all algorithms."""

from __future__ import annotations

import enum
from typing import Any

import torch

SUPPORTED_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
)
HALF_DTYPES = (torch.float16, torch.bfloat16)


class ReduceOp(enum.Enum):
    """Reduction applied element-wise across ranks (mirrors ``torch.distributed.ReduceOp``)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"


_ALIASES = {"mean": ReduceOp.AVG, "average": ReduceOp.AVG, "product": ReduceOp.PROD}


def parse_op(op: Any) -> ReduceOp:
    """Turn a string ("sum", "avg", "mean", ...), a ``ReduceOp`` or a torch ReduceOp into a ReduceOp."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        key = op.lower()
        if key in _ALIASES:
            return _ALIASES[key]
        for member in ReduceOp:
            if member.value == key:
                return member
    else:
        # torch.distributed.ReduceOp members (RedOpType) print as e.g. "RedOpType.SUM".
        name = str(op).rsplit(".", 1)[-1].lower()
        for member in ReduceOp:
            if member.value == name:
                return member
    valid = ", ".join(repr(m.value) for m in ReduceOp)
    raise ValueError(f"unknown reduce op {op!r}: use one of {valid} (or meshtrain.comm.ReduceOp)")


def check_dtype(dtype: torch.dtype, op: ReduceOp | None = None) -> None:
    """Reject dtypes meshtrain does not reduce, and 'avg' on integers."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise ValueError(f"dtype {dtype} is not supported by meshtrain.comm: use one of {names}")
    if op is ReduceOp.AVG and not dtype.is_floating_point:
        raise ValueError(
            f"op='avg' is not defined for integer dtype {dtype}: use op='sum' and divide, "
            "or convert the tensor to a floating dtype"
        )


def work_dtype(dtype: torch.dtype, op: ReduceOp | None) -> torch.dtype:
    """The dtype a reduction runs in: half-precision sums/averages/products accumulate in fp32."""
    if dtype in HALF_DTYPES and op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD):
        return torch.float32
    return dtype


def combine_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """acc <- acc (op) other, in place. AVG combines as SUM; the caller divides once at the end."""
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        return acc.add_(other)
    if op is ReduceOp.MAX:
        return torch.maximum(acc, other, out=acc)
    if op is ReduceOp.MIN:
        return torch.minimum(acc, other, out=acc)
    if op is ReduceOp.PROD:
        return acc.mul_(other)
    raise AssertionError(op)
