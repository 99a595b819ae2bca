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
from .algorithms import algorithms_for, lookup, native, shm_direct
from .algorithms.base import Ctx
from .transport.base import capabilities
from .communicator import Group, current
from .types import ReduceOp, check_dtype, parse_op, work_dtype
from .work import Work


def _group(group: Group | None) -> Group:
    if group is None:
        return current().world
    if not isinstance(group, Group):  # a torch.distributed ProcessGroup maps to its meshtrain group
        from .compat import from_torch_group

        group = from_torch_group(group)  # ValueError if it has none
    if group.rank < 0:  # checked first: a non-member must not even join the algorithm choice
        raise ValueError(f"rank {group.comm.rank} is not a member of group {group.gid} (ranks {group.ranks}); "
                         "only members may call its collectives")
    return group


def _check_tensor(t: Any, what: str = "tensor") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        _check_device(t, what)
    return t


def _algorithm(g: Group, op: str, algorithm: str, nbytes: int) -> str:
    valid = algorithms_for(op, g.comm.transport.kind)
    if algorithm == "auto":
        return select.choose(g, op, nbytes)
    if algorithm not in valid:
        hint = " ('native' needs the torch transport)" if algorithm == "native" else ""
        raise ValueError(f"unknown algorithm {algorithm!r} for {op}{hint}: use one of {valid} or 'auto'")
    return algorithm


def _check_device(t: torch.Tensor, what: str) -> None:
    """The shm transport moves bytes through host shared memory: a GPU tensor there would cost a
    hidden device-to-host copy per step at best, so it is refused, with the fix."""
    if capabilities(current().transport).cpu_only:
        raise ValueError(
            f"{what} is on {t.device}, but the shm transport moves CPU tensors through shared memory: "
            f"for GPU tensors use init(transport='torch') over an NCCL process group (transport "
            f"'auto' does so when CUDA is available), or pass a CPU tensor (tensor.cpu())")


def _flat(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A flat working buffer for ``t`` in ``dtype``; True if it must be copied back."""
    if t.is_contiguous() and t.dtype == dtype:
        return t.view(-1), False
    return t.detach().reshape(-1).to(dtype, copy=True), True


def _meta(shapes: Sequence[Sequence[int]], dtype: torch.dtype, algorithm: str, **extra: Any) -> dict[str, Any]:
    return dict(shapes=[list(s) for s in shapes], dtype=str(dtype).replace("torch.", ""),
                algorithm=algorithm, **extra)


def _finish_avg(buf: torch.Tensor, op: ReduceOp, p: int) -> None:
    if op is ReduceOp.AVG:
        buf.div_(p)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Group | None = None,
               async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """Reduce ``tensor`` across the group, in place on every rank."""
    g, rop = _group(group), parse_op(op)
    check_dtype(_check_tensor(tensor).dtype, rop)
    nbytes = tensor.numel() * tensor.element_size()
    # A symmetric tensor (comm.symmetric_empty) is reduced in place in the members' shared memory,
    # cheaper than any algorithm the cost model prices, so auto takes it. Every member must pass
    # the same part of its allocation, so where it lies goes into the checked metadata. A preferred
    # algorithm other than shm (comm.algorithm) is the user's explicit choice and wins.
    sym = (shm_direct.symmetric_of(g.comm.transport, g.ranks, tensor)
           if tensor.dtype == work_dtype(tensor.dtype, rop) else None)
    take_sym = sym is not None and algorithm == "auto" and select.preferred(g, "all_reduce") in (None, "shm")
    algo = "shm" if take_sym else _algorithm(g, "all_reduce", algorithm, nbytes)
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
        _finish_avg(buf, rop, g.size)
        if back:
            tensor.copy_(buf.view(tensor.shape))
        return tensor

    return runner.run(g, "all_reduce", _meta([tensor.shape], tensor.dtype, algo, redop=rop.value, **extra),
                      body, async_op, nbytes)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Group | None = None,
           async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """Reduce ``tensor`` across the group into ``tensor`` on global rank ``dst`` (others unchanged)."""
    g, rop = _group(group), parse_op(op)
    check_dtype(_check_tensor(tensor).dtype, rop)
    root = g.check_root(dst, "dst")
    nbytes = tensor.numel() * tensor.element_size()
    algo = _algorithm(g, "reduce", algorithm, nbytes)

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
            _finish_avg(buf, rop, g.size)
            if back:
                tensor.copy_(buf.view(tensor.shape))
        return tensor

    return runner.run(g, "reduce", _meta([tensor.shape], tensor.dtype, algo, redop=rop.value, root=dst), body, async_op, nbytes)


def broadcast(tensor: torch.Tensor, src: int, group: Group | None = None, async_op: bool = False,
              algorithm: str = "auto") -> Work | None:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group, in place."""
    g = _group(group)
    check_dtype(_check_tensor(tensor).dtype)
    root = g.check_root(src, "src")
    nbytes = tensor.numel() * tensor.element_size()
    algo = _algorithm(g, "broadcast", algorithm, nbytes)

    def body(ctx: Ctx) -> torch.Tensor:
        buf, back = _flat(tensor, tensor.dtype)
        if algo == "native":
            native.broadcast(g.torch_group, buf, src)
        else:
            lookup("broadcast", algo)(ctx, buf, root)
        if back:
            tensor.copy_(buf.view(tensor.shape))
        return tensor

    return runner.run(g, "broadcast", _meta([tensor.shape], tensor.dtype, algo, root=src), body, async_op, nbytes)


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
    g = _group(group)
    check_dtype(_check_tensor(tensor).dtype)
    _check_list(tensor_list, g, tensor, "tensor_list")
    nbytes = tensor.numel() * tensor.element_size() * g.size
    algo = _algorithm(g, "all_gather", algorithm, nbytes)
    body = _gathered(g, "all_gather", algo, tensor, tensor_list)
    return runner.run(g, "all_gather", _meta([tensor.shape], tensor.dtype, algo), body, async_op, nbytes)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group | None = None,
                           async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """Concatenate every rank's ``input_tensor`` along dim 0 (or flat) into ``output_tensor``."""
    g = _group(group)
    check_dtype(_check_tensor(input_tensor, "input_tensor").dtype)
    _check_tensor(output_tensor, "output_tensor")
    if output_tensor.numel() != input_tensor.numel() * g.size or output_tensor.dtype != input_tensor.dtype:
        raise ValueError(
            f"all_gather_into_tensor: output_tensor has {output_tensor.numel()} elements of "
            f"{output_tensor.dtype}; it needs world size {g.size} x {input_tensor.numel()} = "
            f"{g.size * input_tensor.numel()} elements of {input_tensor.dtype}"
        )
    outs = list(output_tensor.view(-1).chunk(g.size)) if input_tensor.numel() else [output_tensor.view(-1)[:0]] * g.size
    nbytes = output_tensor.numel() * output_tensor.element_size()
    algo = _algorithm(g, "all_gather", algorithm, nbytes)
    if not output_tensor.is_contiguous():
        raise ValueError("all_gather_into_tensor: output_tensor must be contiguous (call .contiguous())")
    body = _gathered(g, "all_gather_into_tensor", algo, input_tensor, outs, output_tensor.view(-1))
    return runner.run(g, "all_gather_into_tensor", _meta([input_tensor.shape], input_tensor.dtype, algo), body, async_op, nbytes)


def _check_list(lst: Any, g: Group, like: torch.Tensor, name: str) -> None:
    if not isinstance(lst, (list, tuple)) or len(lst) != g.size:
        got = len(lst) if isinstance(lst, (list, tuple)) else type(lst).__name__
        raise ValueError(f"{name} must be a list of {g.size} tensors (the group size), got {got}")
    for i, t in enumerate(lst):
        _check_tensor(t, f"{name}[{i}]")
        if t.numel() != like.numel() or t.dtype != like.dtype:
            raise ValueError(
                f"{name}[{i}] has {t.numel()} elements of {t.dtype}; every entry must match "
                f"the tensor ({like.numel()} elements of {like.dtype})"
            )


def _reduce_scattered(g: Group, algo: str, rop: ReduceOp, out: torch.Tensor, ins: list[torch.Tensor]) -> Any:
    def body(ctx: Ctx) -> torch.Tensor:
        wd = work_dtype(out.dtype, rop)
        n = out.numel()
        if algo == "native":
            tmp_out = out if wd == out.dtype else out.to(wd)
            native.reduce_scatter(g.torch_group, g.ranks, tmp_out, [t.reshape(tmp_out.shape).to(wd) for t in ins], rop)
            _finish_avg(tmp_out, rop, g.size)
            if tmp_out is not out:
                out.copy_(tmp_out)
            return out
        if algo == "shm" and wd == out.dtype and shm_direct.reduce_scatter_lists(ctx, ins, out, rop):
            _finish_avg(out, rop, g.size)  # straight from the inputs, no staging buffer
            return out
        buf = ctx.scratch("rs_in", n * g.size, wd, out.device)
        for i, t in enumerate(ins):
            buf[i * n : (i + 1) * n].copy_(t.reshape(-1))
        lookup("reduce_scatter", algo)(ctx, buf, rop)
        mine = buf[ctx.rank * n : (ctx.rank + 1) * n]
        _finish_avg(mine, rop, g.size)
        out.copy_(mine.view(out.shape))
        return out

    return body


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Group | None = None, async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """``output`` on rank i receives the reduction over ranks of ``input_list[i]``."""
    g, rop = _group(group), parse_op(op)
    check_dtype(_check_tensor(output, "output").dtype, rop)
    _check_list(input_list, g, output, "input_list")
    nbytes = output.numel() * output.element_size() * g.size
    algo = _algorithm(g, "reduce_scatter", algorithm, nbytes)
    body = _reduce_scattered(g, algo, rop, output, list(input_list))
    return runner.run(g, "reduce_scatter", _meta([output.shape], output.dtype, algo, redop=rop.value), body, async_op, nbytes)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Group | None = None, async_op: bool = False, algorithm: str = "auto") -> Work | None:
    """``input`` is world size x ``output`` (dim 0 or flat); rank i gets the reduced i-th part."""
    g, rop = _group(group), parse_op(op)
    check_dtype(_check_tensor(output, "output").dtype, rop)
    _check_tensor(input, "input")
    if input.numel() != output.numel() * g.size or input.dtype != output.dtype:
        raise ValueError(
            f"reduce_scatter_tensor: input has {input.numel()} elements of {input.dtype}; it needs "
            f"world size {g.size} x {output.numel()} = {g.size * output.numel()} elements of {output.dtype}"
        )
    flat = input.reshape(-1)
    n = output.numel()
    ins = [flat[i * n : (i + 1) * n] for i in range(g.size)]
    nbytes = input.numel() * input.element_size()
    algo = _algorithm(g, "reduce_scatter", algorithm, nbytes)
    body = _reduce_scattered(g, algo, rop, output, ins)
    return runner.run(g, "reduce_scatter_tensor", _meta([output.shape], output.dtype, algo, redop=rop.value), body, async_op, nbytes)


