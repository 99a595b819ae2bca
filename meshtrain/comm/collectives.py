"""Module-level collectives with torch.distributed's names, signatures and in-place semantics.

Each call validates its arguments, picks the algorithm (``auto`` = the communicator's preferred
algorithm where valid, else the cost model; see ``select.choose``), and hands a body to
``runner.run``. The body runs the algorithm's entry of the dispatch table
(``algorithms.implementation``). Bodies work on a flat buffer: the tensor itself when it is contiguous and already
in the working dtype (half-precision sums accumulate in fp32), else a converted copy written back.
"""

from __future__ import annotations

from typing import Any

import torch

from . import runner, select
from .call import call_meta, check_list, check_tensor, choose_algorithm, finish_avg, resolve_group
from .algorithms import implementation, shm_direct
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
    check_dtype(check_tensor(tensor, g).dtype, rop)
    nbytes = tensor.numel() * tensor.element_size()
    # A symmetric tensor (comm.symmetric_empty) is reduced in place in the members' shared memory,
    # cheaper than any algorithm the cost model prices, so auto takes it. Every member must pass
    # the same part of its allocation, so where it lies goes into the checked metadata. A preferred
    # algorithm other than shm (comm.algorithm) is the user's explicit choice and wins.
    sym = (shm_direct.symmetric_of(g.comm.transport, g.ranks, tensor)
           if tensor.dtype == work_dtype(tensor.dtype, rop) else None)
    take_sym = sym is not None and algorithm == "auto" and select.preferred(g, "all_reduce") in (None, "shm")
    algo = "shm" if take_sym else choose_algorithm(g, "all_reduce", algorithm, nbytes, tensor.dtype)
    if algo != "shm":
        sym = None
    extra = {} if sym is None else {"symmetric_offset": sym[1]}

    run = implementation("all_reduce", algo)

    def body(ctx: Ctx) -> torch.Tensor:
        if ctx.size == 1:  # a group of one (a mesh axis of size 1): its reduction, or average, is its tensor
            return tensor
        buf, back = _flat(tensor, work_dtype(tensor.dtype, rop))
        if sym is not None:  # buf is tensor itself (same dtype, contiguous); averaged slice by slice
            shm_direct.all_reduce_symmetric(ctx, buf, rop, *sym, g.size if rop is ReduceOp.AVG else 1)
        else:
            run(ctx, g, buf, rop)
            finish_avg(buf, rop, g.size)
        if back:
            tensor.copy_(buf.view(tensor.shape))
        return tensor

    # (``_value_``: the member's value without the lookup of the ``value`` property, ~0.4 us a call)
    return runner.run(g, "all_reduce", call_meta([tensor.shape], tensor.dtype, algo, redop=rop._value_, **extra),
                      body, async_op, nbytes)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Group | None = None,
           async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """Reduce ``tensor`` across the group into ``tensor`` on global rank ``dst`` (others unchanged)."""
    g, rop = resolve_group(group), parse_op(op)
    check_dtype(check_tensor(tensor, g).dtype, rop)
    root = g.check_root(dst, "dst")
    nbytes = tensor.numel() * tensor.element_size()
    algo = choose_algorithm(g, "reduce", algorithm, nbytes, tensor.dtype)
    run = implementation("reduce", algo)

    def body(ctx: Ctx) -> torch.Tensor:
        wd = work_dtype(tensor.dtype, rop)
        if ctx.rank == root:
            buf, back = _flat(tensor, wd)
        else:  # algorithms use non-root buffers as scratch; keep the caller's tensor intact
            buf, back = tensor.detach().reshape(-1).to(wd, copy=True), False
        run(ctx, g, buf, rop, root, dst)
        if ctx.rank == root:
            finish_avg(buf, rop, g.size)
            if back:
                tensor.copy_(buf.view(tensor.shape))
        return tensor

    return runner.run(g, "reduce", call_meta([tensor.shape], tensor.dtype, algo, redop=rop._value_, root=dst), body, async_op, nbytes)


def broadcast(tensor: torch.Tensor, src: int, group: Group | None = None, async_op: bool = False,
              algorithm: str = "auto") -> Work | None:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group, in place."""
    g = resolve_group(group)
    check_dtype(check_tensor(tensor, g).dtype)
    root = g.check_root(src, "src")
    nbytes = tensor.numel() * tensor.element_size()
    algo = choose_algorithm(g, "broadcast", algorithm, nbytes, tensor.dtype)
    run = implementation("broadcast", algo)

    def body(ctx: Ctx) -> torch.Tensor:
        if ctx.size == 1:  # a group of one: the root's tensor is already everyone's
            return tensor
        buf, back = _flat(tensor, tensor.dtype)
        run(ctx, g, buf, root, src)
        if back:
            tensor.copy_(buf.view(tensor.shape))
        return tensor

    return runner.run(g, "broadcast", call_meta([tensor.shape], tensor.dtype, algo, root=src), body, async_op, nbytes)


def _gathered(g: Group, algo: str, inp: torch.Tensor, outs: list[torch.Tensor] | None,
              whole: torch.Tensor | None = None, result: list[torch.Tensor] | None = None) -> Any:
    """Body of the all-gathers: ``outs[i]`` receives rank i's ``inp``. ``whole``, when given, is a
    flat contiguous tensor whose consecutive blocks are ``outs``, so algorithms may gather in it
    in place (``native`` takes ``outs=None`` with it). The body returns ``result`` (default: ``outs``)."""
    run = implementation("all_gather", algo)

    def body(ctx: Ctx) -> list[torch.Tensor]:
        if ctx.size == 1:  # a group of one (a mesh axis of size 1): the gather is a copy
            dst = whole if whole is not None else outs[0]  # type: ignore[index]
            if dst.data_ptr() != inp.data_ptr():
                dst.copy_(inp if inp.shape == dst.shape else inp.reshape(dst.shape))
        else:
            run(ctx, g, inp, outs, whole)
        return outs if result is None else result

    return body


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group | None = None,
               async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """``tensor_list[i]`` receives rank i's ``tensor`` (group order), on every rank."""
    g = resolve_group(group)
    check_dtype(check_tensor(tensor, g).dtype)
    check_list(tensor_list, g, tensor, "tensor_list")
    nbytes = tensor.numel() * tensor.element_size() * g.size
    algo = choose_algorithm(g, "all_gather", algorithm, nbytes, tensor.dtype)
    body = _gathered(g, algo, tensor, tensor_list)
    return runner.run(g, "all_gather", call_meta([tensor.shape], tensor.dtype, algo), body, async_op, nbytes)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group | None = None,
                           async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """Concatenate every rank's ``input_tensor`` along dim 0 (or flat) into ``output_tensor``."""
    g = resolve_group(group)
    dtype = check_tensor(input_tensor, g, "input_tensor").dtype
    check_dtype(dtype)
    check_tensor(output_tensor, g, "output_tensor")
    n, total = input_tensor.numel(), output_tensor.numel()
    if total != n * g.size or output_tensor.dtype != dtype:
        raise ValueError(
            f"all_gather_into_tensor: output_tensor has {total} elements of {output_tensor.dtype}; it "
            f"needs world size {g.size} x {n} = {g.size * n} elements of {dtype}"
        )
    nbytes = total * output_tensor.element_size()
    algo = choose_algorithm(g, "all_gather", algorithm, nbytes, dtype)
    if not output_tensor.is_contiguous():
        raise ValueError("all_gather_into_tensor: output_tensor must be contiguous (call .contiguous())")
    whole = output_tensor if output_tensor.dim() == 1 else output_tensor.view(-1)
    # torch's own op gathers straight into the flat output: no per-rank views to make (3 us a call)
    outs = None if algo == "native" or g.size == 1 else [whole[i * n : (i + 1) * n] for i in range(g.size)]
    body = _gathered(g, algo, input_tensor, outs, whole, result=[output_tensor])
    return runner.run(g, "all_gather_into_tensor", call_meta([input_tensor.shape], dtype, algo), body, async_op, nbytes)


def _reduce_scattered(g: Group, algo: str, rop: ReduceOp, out: torch.Tensor, ins: list[torch.Tensor]) -> Any:
    """Body of the reduce-scatters: ``out`` receives the reduction of every rank's ``ins[me]``."""
    run = implementation("reduce_scatter", algo)

    def body(ctx: Ctx) -> torch.Tensor:
        if ctx.size == 1:  # a group of one: its reduction is its input (an average over one, too)
            src = ins[0]
            if out.data_ptr() != src.data_ptr():
                out.copy_(src if src.shape == out.shape else src.reshape(out.shape))
            return out
        mine = run(ctx, g, out, ins, rop)  # in the working dtype: AVG divides before rounding
        finish_avg(mine, rop, g.size)
        if mine is not out:
            out.copy_(mine.view(out.shape))
        return out

    return body


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Group | None = None, async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """``output`` on rank i receives the reduction over ranks of ``input_list[i]``."""
    g, rop = resolve_group(group), parse_op(op)
    check_dtype(check_tensor(output, g, "output").dtype, rop)
    check_list(input_list, g, output, "input_list")
    nbytes = output.numel() * output.element_size() * g.size
    algo = choose_algorithm(g, "reduce_scatter", algorithm, nbytes, output.dtype)
    body = _reduce_scattered(g, algo, rop, output, list(input_list))
    return runner.run(g, "reduce_scatter", call_meta([output.shape], output.dtype, algo, redop=rop._value_), body, async_op, nbytes)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Group | None = None, async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """``input`` is world size x ``output`` (dim 0 or flat); rank i gets the reduced i-th part."""
    g, rop = resolve_group(group), parse_op(op)
    dtype = check_tensor(output, g, "output").dtype
    check_dtype(dtype, rop)
    check_tensor(input, g, "input")
    n, total = output.numel(), input.numel()
    if total != n * g.size or input.dtype != dtype:
        raise ValueError(
            f"reduce_scatter_tensor: input has {total} elements of {input.dtype}; it needs "
            f"world size {g.size} x {n} = {g.size * n} elements of {dtype}"
        )
    if g.size == 1:  # its one part is the whole input (no flat view and slices to make)
        ins = [input]
    else:
        flat = input if input.dim() == 1 else input.reshape(-1)
        ins = [flat[i * n : (i + 1) * n] for i in range(g.size)]
    nbytes = total * input.element_size()
    algo = choose_algorithm(g, "reduce_scatter", algorithm, nbytes, dtype)
    body = _reduce_scattered(g, algo, rop, output, ins)
    return runner.run(g, "reduce_scatter_tensor", call_meta([output.shape], dtype, algo, redop=rop._value_), body, async_op, nbytes)


