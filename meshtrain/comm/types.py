"""Reduce operations, dtype rules and element-wise combine functions shared by all algorithms."""

from __future__ import annotations

import enum
from typing import Any

import torch

# Every dtype torch.distributed's gloo moves (int16 too, which gloo itself refuses).
SUPPORTED_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
HALF_DTYPES = (torch.float16, torch.bfloat16)


class ReduceOp(enum.Enum):
    """Reduction applied element-wise across ranks (mirrors ``torch.distributed.ReduceOp``).

    ``PRODUCT`` is torch's name for ``PROD`` (the same member). BAND, BOR and BXOR are bitwise
    and take integer or bool tensors only."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    PRODUCT = "prod"  # an alias of PROD: torch.distributed's spelling


BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
_ALIASES = {"mean": ReduceOp.AVG, "average": ReduceOp.AVG, "product": ReduceOp.PROD}


class UnsupportedReduction(ValueError, RuntimeError):
    """A reduce op that is not defined for the tensor's dtype (bitwise ops on floats, avg on
    integers, anything but sum/avg on complex). Both a ValueError (meshtrain's bad-argument type)
    and a RuntimeError (what torch.distributed's gloo raises for most of these)."""


def parse_op(op: Any) -> ReduceOp:
    """Turn a string ("sum", "avg", "mean", "band", ...), a ``ReduceOp`` or a torch ReduceOp into a ReduceOp."""
    if isinstance(op, ReduceOp):
        return op
    try:
        return _PARSED[op]
    except (KeyError, TypeError):  # not seen yet, or unhashable
        pass
    parsed = _parse_op(op)
    try:
        _PARSED[op] = parsed
    except TypeError:
        pass
    return parsed


_PARSED: dict[Any, "ReduceOp"] = {}  # the names and torch ops seen: parsing a string cost ~2 us a call


def _parse_op(op: Any) -> ReduceOp:
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
        name = _ALIASES[name].value if name in _ALIASES else name
        for member in ReduceOp:
            if member.value == name:
                return member
    valid = ", ".join(repr(m.value) for m in ReduceOp)
    raise ValueError(f"unknown reduce op {op!r}: use one of {valid} (or meshtrain.comm.ReduceOp)")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_dtype(dtype: torch.dtype, op: ReduceOp | None = None) -> None:
    """Reject dtypes meshtrain does not move, and reduce ops the dtype has no meaning for."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(_name(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"dtype {dtype} is not supported by meshtrain.comm: use one of {names}")
    if op is None:
        return
    if op in BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise UnsupportedReduction(
            f"op='{op.value}' (ReduceOp.{op.name}) is bitwise and not defined for {_name(dtype)}: "
            "use it on an integer or bool tensor (or .view() the bits as an integer dtype of the same size)")
    if dtype.is_complex and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise UnsupportedReduction(
            f"op='{op.value}' is not defined on complex tensors ({_name(dtype)}), as in torch.distributed: "
            "use 'sum' or 'avg', or reduce torch.view_as_real(tensor) with a real op")
    if op is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise UnsupportedReduction(
            f"op='avg' is not defined for integer or bool dtype {dtype}: use op='sum' and divide, "
            "or convert the tensor to a floating dtype"
        )


def work_dtype(dtype: torch.dtype, op: ReduceOp | None) -> torch.dtype:
    """The dtype a reduction runs in: half-precision sums/averages/products accumulate in fp32."""
    if dtype in HALF_DTYPES and op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD):
        return torch.float32
    return dtype


def combine_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """acc <- acc (op) other, in place. AVG combines as SUM; the caller divides once at the end.
    On bool, SUM is logical or and PROD logical and (torch's bool arithmetic)."""
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        return acc.add_(other)
    if op is ReduceOp.MAX:
        return torch.maximum(acc, other, out=acc)
    if op is ReduceOp.MIN:
        return torch.minimum(acc, other, out=acc)
    if op is ReduceOp.PROD:
        return acc.mul_(other)
    if op is ReduceOp.BAND:
        return acc.bitwise_and_(other)
    if op is ReduceOp.BOR:
        return acc.bitwise_or_(other)
    if op is ReduceOp.BXOR:
        return acc.bitwise_xor_(other)
    raise AssertionError(op)
