"""Module-level collectives with torch.distributed's names, signatures and in-place semantics.

Each call validates its arguments, picks the algorithm (``auto`` = the communicator's preferred
algorithm where valid, else the cost model; see ``select.choose``), and hands a body to
``runner.run``. Bodies work on a flat buffer: the tensor itself when it is contiguous and already
in the working dtype (half-precision sums accumulate in fp32), else a converted copy written back.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from . import runner, select
from .call import call_meta, check_list, check_tensor, choose_algorithm, finish_avg, resolve_group
from .algorithms import lookup, native, shm_direct
from .algorithms.base import Ctx
from .communicator import Group
from .types import ReduceOp, check_dtype, parse_op, work_dtype
from .work import Work


def _flat(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A flat working buffer for ``t`` in ``dtype``; True if it must be copied back."""
    if t.is_contiguous() and t.dtype == dtype:
        return t.view(-1), False
    return t.detach().reshape(-1).to(dtype, copy=True), True


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Group | None = None,
               async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """Reduce ``tensor`` across the group, in place on every rank."""
    g, rop = resolve_group(group), parse_op(op)
    check_dtype(check_tensor(tensor).dtype, rop)
    nbytes = tensor.numel() * tensor.element_size()
    # A symmetric tensor (comm.symmetric_empty) is reduced in place in the members' shared memory,
    # cheaper than any algorithm the cost model prices, so auto takes it. Every member must pass
    # the same part of its allocation, so where it lies goes into the checked metadata. A preferred
    # algorithm other than shm (comm.algorithm) is the user's explicit choice and wins.
    sym = (shm_direct.symmetric_of(g.comm.transport, g.ranks, tensor)
           if tensor.dtype == work_dtype(tensor.dtype, rop) else None)
    take_sym = sym is not None and algorithm == "auto" and select.preferred(g, "all_reduce") in (None, "shm")
    algo = "shm" if take_sym else choose_algorithm(g, "all_reduce", algorithm, nbytes)
    if algo != "shm":
        sym = None
    extra = {} if sym is None else {"symmetric_offset": sym[1]}

    def body(ctx: Ctx) -> torch.Tensor:
        buf, back = _flat(tensor, work_dtype(tensor.dtype, rop))
        if sym is not None:  # buf is tensor itself (same dtype, contiguous)
            shm_direct.all_reduce_symmetric(ctx, buf, rop, *sym)
        elif algo == "native":
            native.all_reduce(g.torch_group, buf, rop)
        elif algo == "hierarchical":
            lookup("all_reduce", algo)(ctx, buf, rop, g.comm.node_size)
        else:
            lookup("all_reduce", algo)(ctx, buf, rop)
        finish_avg(buf, rop, g.size)
        if back:
            tensor.copy_(buf.view(tensor.shape))
        return tensor

    return runner.run(g, "all_reduce", call_meta([tensor.shape], tensor.dtype, algo, redop=rop.value, **extra),
                      body, async_op, nbytes)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Group | None = None,
           async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """Reduce ``tensor`` across the group into ``tensor`` on global rank ``dst`` (others unchanged)."""
    g, rop = resolve_group(group), parse_op(op)
    check_dtype(check_tensor(tensor).dtype, rop)
    root = g.check_root(dst, "dst")
    nbytes = tensor.numel() * tensor.element_size()
    algo = choose_algorithm(g, "reduce", algorithm, nbytes)

    def body(ctx: Ctx) -> torch.Tensor:
        wd = work_dtype(tensor.dtype, rop)
        if ctx.rank == root:
            buf, back = _flat(tensor, wd)
        else:  # algorithms use non-root buffers as scratch; keep the caller's tensor intact
            buf, back = tensor.detach().reshape(-1).to(wd, copy=True), False
        if algo == "native":
            native.reduce(g.torch_group, buf, rop, dst)
        else:
            lookup("reduce", algo)(ctx, buf, rop, root)
        if ctx.rank == root:
            finish_avg(buf, rop, g.size)
            if back:
                tensor.copy_(buf.view(tensor.shape))
        return tensor

    return runner.run(g, "reduce", call_meta([tensor.shape], tensor.dtype, algo, redop=rop.value, root=dst), body, async_op, nbytes)


def broadcast(tensor: torch.Tensor, src: int, group: Group | None = None, async_op: bool = False,
              algorithm: str = "auto") -> Work | None:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group, in place."""
    g = resolve_group(group)
    check_dtype(check_tensor(tensor).dtype)
    root = g.check_root(src, "src")
    nbytes = tensor.numel() * tensor.element_size()
    algo = choose_algorithm(g, "broadcast", algorithm, nbytes)

    def body(ctx: Ctx) -> torch.Tensor:
        buf, back = _flat(tensor, tensor.dtype)
        if algo == "native":
            native.broadcast(g.torch_group, buf, src)
        else:
            lookup("broadcast", algo)(ctx, buf, root)
        if back:
            tensor.copy_(buf.view(tensor.shape))
        return tensor

    return runner.run(g, "broadcast", call_meta([tensor.shape], tensor.dtype, algo, root=src), body, async_op, nbytes)


def _gathered(g: Group, op: str, algo: str, inp: torch.Tensor, outs: list[torch.Tensor],
              whole: torch.Tensor | None = None) -> Any:
    """Body of the all-gathers: ``outs[i]`` receives rank i's ``inp``. ``whole``, when given, is a
    flat contiguous tensor whose consecutive blocks are ``outs``: the algorithms then gather in it
    in place, with no staging buffer (at 16 MB over 2 hosts the staging copy-out was about half
    of the all-gather's time)."""

    def body(ctx: Ctx) -> list[torch.Tensor]:
        if algo == "native":
            native.all_gather(g.torch_group, g.ranks, outs, inp.contiguous())
            return outs
        if algo == "shm":  # straight from the input into the outputs, no staging buffer
            shm_direct.all_gather_lists(ctx, inp, outs)
            return outs
        n = inp.numel()
        buf = whole if whole is not None else ctx.scratch("all_gather_out", n * g.size, inp.dtype, inp.device)
        mine = buf[ctx.rank * n : (ctx.rank + 1) * n]
        if not (inp.is_contiguous() and mine.data_ptr() == inp.data_ptr()):  # not already in place
            mine.copy_(inp.reshape(-1))
        lookup("all_gather", algo)(ctx, buf)
        if whole is not None:
            return outs
        for i, o in enumerate(outs):
            o.view(-1).copy_(buf[i * n : (i + 1) * n]) if o.is_contiguous() else o.copy_(buf[i * n : (i + 1) * n].view(o.shape))
        return outs

    return body


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group | None = None,
               async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """``tensor_list[i]`` receives rank i's ``tensor`` (group order), on every rank."""
    g = resolve_group(group)
    check_dtype(check_tensor(tensor).dtype)
    check_list(tensor_list, g, tensor, "tensor_list")
    nbytes = tensor.numel() * tensor.element_size() * g.size
    algo = choose_algorithm(g, "all_gather", algorithm, nbytes)
    body = _gathered(g, "all_gather", algo, tensor, tensor_list)
    return runner.run(g, "all_gather", call_meta([tensor.shape], tensor.dtype, algo), body, async_op, nbytes)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group | None = None,
                           async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """Concatenate every rank's ``input_tensor`` along dim 0 (or flat) into ``output_tensor``."""
    g = resolve_group(group)
    check_dtype(check_tensor(input_tensor, "input_tensor").dtype)
    check_tensor(output_tensor, "output_tensor")
    if output_tensor.numel() != input_tensor.numel() * g.size or output_tensor.dtype != input_tensor.dtype:
        raise ValueError(
            f"all_gather_into_tensor: output_tensor has {output_tensor.numel()} elements of "
            f"{output_tensor.dtype}; it needs world size {g.size} x {input_tensor.numel()} = "
            f"{g.size * input_tensor.numel()} elements of {input_tensor.dtype}"
        )
    outs = list(output_tensor.view(-1).chunk(g.size)) if input_tensor.numel() else [output_tensor.view(-1)[:0]] * g.size
    nbytes = output_tensor.numel() * output_tensor.element_size()
    algo = choose_algorithm(g, "all_gather", algorithm, nbytes)
    if not output_tensor.is_contiguous():
        raise ValueError("all_gather_into_tensor: output_tensor must be contiguous (call .contiguous())")
    body = _gathered(g, "all_gather_into_tensor", algo, input_tensor, outs, output_tensor.view(-1))
    return runner.run(g, "all_gather_into_tensor", call_meta([input_tensor.shape], input_tensor.dtype, algo), body, async_op, nbytes)


def _reduce_scattered(g: Group, algo: str, rop: ReduceOp, out: torch.Tensor, ins: list[torch.Tensor]) -> Any:
    def body(ctx: Ctx) -> torch.Tensor:
        wd = work_dtype(out.dtype, rop)
        n = out.numel()
        if algo == "native":
            tmp_out = out if wd == out.dtype else out.to(wd)
            native.reduce_scatter(g.torch_group, g.ranks, tmp_out, [t.reshape(tmp_out.shape).to(wd) for t in ins], rop)
            finish_avg(tmp_out, rop, g.size)
            if tmp_out is not out:
                out.copy_(tmp_out)
            return out
        if algo == "shm" and wd == out.dtype and shm_direct.reduce_scatter_lists(ctx, ins, out, rop):
            finish_avg(out, rop, g.size)  # straight from the inputs, no staging buffer
            return out
        buf = ctx.scratch("rs_in", n * g.size, wd, out.device)
        for i, t in enumerate(ins):
            buf[i * n : (i + 1) * n].copy_(t.reshape(-1))
        lookup("reduce_scatter", algo)(ctx, buf, rop)
        mine = buf[ctx.rank * n : (ctx.rank + 1) * n]
        finish_avg(mine, rop, g.size)
        out.copy_(mine.view(out.shape))
        return out

    return body


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Group | None = None, async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """``output`` on rank i receives the reduction over ranks of ``input_list[i]``."""
    g, rop = resolve_group(group), parse_op(op)
    check_dtype(check_tensor(output, "output").dtype, rop)
    check_list(input_list, g, output, "input_list")
    nbytes = output.numel() * output.element_size() * g.size
    algo = choose_algorithm(g, "reduce_scatter", algorithm, nbytes)
    body = _reduce_scattered(g, algo, rop, output, list(input_list))
    return runner.run(g, "reduce_scatter", call_meta([output.shape], output.dtype, algo, redop=rop.value), body, async_op, nbytes)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Group | None = None, async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """``input`` is world size x ``output`` (dim 0 or flat); rank i gets the reduced i-th part."""
    g, rop = resolve_group(group), parse_op(op)
    check_dtype(check_tensor(output, "output").dtype, rop)
    check_tensor(input, "input")
    if input.numel() != output.numel() * g.size or input.dtype != output.dtype:
        raise ValueError(
            f"reduce_scatter_tensor: input has {input.numel()} elements of {input.dtype}; it needs "
            f"world size {g.size} x {output.numel()} = {g.size * output.numel()} elements of {output.dtype}"
        )
    flat = input.reshape(-1)
    n = output.numel()
    ins = [flat[i * n : (i + 1) * n] for i in range(g.size)]
    nbytes = input.numel() * input.element_size()
    algo = choose_algorithm(g, "reduce_scatter", algorithm, nbytes)
    body = _reduce_scattered(g, algo, rop, output, ins)
    return runner.run(g, "reduce_scatter_tensor", call_meta([output.shape], output.dtype, algo, redop=rop.value), body, async_op, nbytes)


