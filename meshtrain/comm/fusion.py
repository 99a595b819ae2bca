"""Tensor fusion: reduce many small tensors as one message through a reused flat buffer."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from . import runner
from .algorithms import implementation
from .algorithms.base import Ctx
from .call import call_meta, check_tensor, choose_algorithm, finish_avg, resolve_group
from .communicator import Group
from .types import ReduceOp, check_dtype, parse_op, work_dtype
from .work import Work


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], op: Any = ReduceOp.SUM, group: Group | None = None,
                         async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """All-reduce ``tensors`` in place as one fused message (one dtype; packed into a pooled buffer)."""
    g, rop = resolve_group(group), parse_op(op)
    tensors = list(tensors)
    if not tensors:
        raise ValueError("all_reduce_coalesced needs at least one tensor")
    dtypes = {check_tensor(t, g, "tensors[i]").dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"all_reduce_coalesced: all tensors must share one dtype, got {sorted(map(str, dtypes))}; "
                         "call it once per dtype")
    dtype = dtypes.pop()
    check_dtype(dtype, rop)
    total = sum(t.numel() for t in tensors)
    nbytes = total * tensors[0].element_size()
    algo = choose_algorithm(g, "all_reduce", algorithm, nbytes, dtype)
    run = implementation("all_reduce", algo)

    def body(ctx: Ctx) -> list[torch.Tensor]:
        wd = work_dtype(dtype, rop)
        # A separate pool name from the algorithms' scratch, so packing never aliases them; on the
        # tensors' device (a CPU buffer would send device tensors through the host, or to NCCL)
        flat = g.pool.get("fusion", total, wd, tensors[0].device)
        off = 0
        for t in tensors:
            flat[off : off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()
        run(ctx, g, flat, rop)
        finish_avg(flat, rop, g.size)
        off = 0
        for t in tensors:
            t.copy_(flat[off : off + t.numel()].view(t.shape))
            off += t.numel()
        return tensors

    meta = call_meta([t.shape for t in tensors], dtype, algo, redop=rop._value_)
    return runner.run(g, "all_reduce_coalesced", meta, body, async_op, nbytes)
