"""The dispatch table: (operation, algorithm name) -> the implementation that runs it.

Every implementation of one operation has that operation's signature (below), whatever runs
underneath: meshtrain's own algorithms over a ``Ctx`` (``REGISTRY``), the shm collectives on the
members' shared buffers, or torch.distributed's own collective ("native"). An entry also names the
transport capability it needs, and ``algorithms_for`` reads the same table: what is offered and
what runs cannot disagree. Signatures (``g`` is the call's ``Group``; buffers are flat, contiguous
and in the working dtype; ``root`` is a group rank, ``root_global`` the same rank in the world):

- all_reduce(ctx, g, buf, op)                      buf reduced in place (AVG: summed)
- reduce(ctx, g, buf, op, root, root_global)       into buf on the root; scratch elsewhere
- broadcast(ctx, g, buf, root, root_global)
- all_gather(ctx, g, inp, outs, whole)             outs[i] = rank i's inp; ``whole``, if not None,
                                                   is the flat tensor whose blocks are ``outs``
- reduce_scatter(ctx, g, out, ins, op) -> tensor   the reduced block, summed for AVG, in the
                                                   working dtype: ``out`` or a buffer to copy out
- gather(ctx, g, inp, outs, root, root_global)     outs (root only) in group order
- scatter(ctx, g, out, ins, root, root_global)     ins (root only) in group order
- all_to_all(ctx, g, outs, ins)                    flat outs[j] = rank j's ins[me]
- barrier(ctx, g)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..device import on_host
from ..transport.base import Capabilities
from ..types import ReduceOp, work_dtype
from . import direct, hierarchical, native, recursive, ring, shm_direct, tree
from .base import Ctx

if TYPE_CHECKING:  # communicator imports this package (algorithms.base): no runtime import back
    from ..communicator import Group

# meshtrain's own algorithms, transport-independent: REGISTRY[op][name](ctx, ...).
REGISTRY: dict[str, dict[str, Any]] = {
    "all_reduce": {
        "ring": ring.all_reduce,
        "tree": tree.all_reduce,
        "recursive_doubling": recursive.all_reduce_doubling,
        "halving_doubling": recursive.all_reduce_halving_doubling,
        "hierarchical": hierarchical.all_reduce,
        "direct": direct.all_reduce,
    },
    "reduce": {"tree": tree.reduce, "ring": ring.reduce, "direct": direct.reduce},
    "broadcast": {"tree": tree.broadcast, "ring": ring.broadcast, "direct": direct.broadcast},
    "all_gather": {"ring": ring.all_gather, "recursive_doubling": recursive.all_gather_bruck,
                   "hierarchical": hierarchical.all_gather, "direct": direct.all_gather},
    "reduce_scatter": {"ring": ring.reduce_scatter, "hierarchical": hierarchical.reduce_scatter,
                       "direct": direct.reduce_scatter},
    # gather/scatter "tree" work on a root-relative layout (the table's entry maps it).
    "gather": {"tree": "tree", "direct": direct.gather},
    "scatter": {"tree": "tree", "direct": direct.scatter},
    "all_to_all": {"direct": direct.all_to_all},
    "barrier": {"direct": None},
}


@dataclass(frozen=True)
class Implementation:
    """One entry of the table: ``run`` has its operation's signature (module docstring);
    ``needs`` names the ``Capabilities`` flag a transport must have to offer it (None: any)."""

    run: Callable[..., Any]
    needs: str | None = None

    def offered_on(self, caps: Capabilities) -> bool:
        """True if a transport with ``caps`` offers this implementation."""
        return self.needs is None or bool(getattr(caps, self.needs))


# --- adapters: a Ctx algorithm of REGISTRY or shm_direct -> its operation's signature ---------

def _all_reduce(fn: Callable) -> Callable:
    def run(ctx: Ctx, g: Group, buf: torch.Tensor, op: ReduceOp) -> None:
        fn(ctx, buf, op)
    return run


def _all_reduce_hierarchical(ctx: Ctx, g: Group, buf: torch.Tensor, op: ReduceOp) -> None:
    hierarchical.all_reduce(ctx, buf, op, g.comm.node_size)  # the host split the user configured


def _reduce(fn: Callable) -> Callable:
    def run(ctx: Ctx, g: Group, buf: torch.Tensor, op: ReduceOp, root: int, root_global: int) -> None:
        fn(ctx, buf, op, root)
    return run


def _broadcast(fn: Callable) -> Callable:
    def run(ctx: Ctx, g: Group, buf: torch.Tensor, root: int, root_global: int) -> None:
        fn(ctx, buf, root)
    return run


def _all_gather(fn: Callable) -> Callable:
    """Gather in one flat buffer of p blocks: ``whole`` itself when given (no staging copy; at
    16 MB over 2 hosts the copy-out was about half of the all-gather's time), else scratch."""
    def run(ctx: Ctx, g: Group, inp: torch.Tensor, outs: list[torch.Tensor], whole: torch.Tensor | None) -> None:
        n = inp.numel()
        buf = whole if whole is not None else ctx.scratch("all_gather_out", n * g.size, inp.dtype, inp.device)
        mine = buf[ctx.rank * n : (ctx.rank + 1) * n]
        if not (inp.is_contiguous() and mine.data_ptr() == inp.data_ptr()):  # not already in place
            mine.copy_(inp.reshape(-1))
        fn(ctx, buf)
        if whole is not None:
            return
        for i, o in enumerate(outs):
            o.view(-1).copy_(buf[i * n : (i + 1) * n]) if o.is_contiguous() else o.copy_(buf[i * n : (i + 1) * n].view(o.shape))
    return run


def _all_gather_shm(ctx: Ctx, g: Group, inp: torch.Tensor, outs: list[torch.Tensor], whole: torch.Tensor | None) -> None:
    shm_direct.all_gather_lists(ctx, inp, outs)  # straight from the input into the outputs


def _all_gather_native(ctx: Ctx, g: Group, inp: torch.Tensor, outs: list[torch.Tensor], whole: torch.Tensor | None) -> None:
    native.all_gather(g.torch_group, g.ranks, outs, inp.contiguous(), whole)


def _reduce_scatter(fn: Callable) -> Callable:
    """Stage the inputs in one scratch buffer of p blocks; the result is this rank's block."""
    def run(ctx: Ctx, g: Group, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
        n = out.numel()
        buf = ctx.scratch("rs_in", n * g.size, _work_dtype(out, op), out.device)
        for i, t in enumerate(ins):
            buf[i * n : (i + 1) * n].copy_(t.reshape(-1))
        fn(ctx, buf, op)
        return buf[ctx.rank * n : (ctx.rank + 1) * n]
    return run


_reduce_scatter_staged_shm = _reduce_scatter(shm_direct.reduce_scatter)


# gloo's reduce-scatter (CPU) ran slower than its all-reduce of the whole input, staged in scratch
# and sliced: 0.63-0.91x the time at 4 KB-16 MB on 2 ranks, 0.83-1.0x on 4 (docs/benchmarks.md,
# session 14). Its work also has no future, so the caller cannot look at it before blocking
# (native.finish). Larger groups keep gloo's: an all-reduce moves twice the bytes.
RS_OVER_ALL_REDUCE_MAX = 4


def _reduce_scatter_over_all_reduce(ctx: Ctx, g: Group, out: torch.Tensor, ins: list[torch.Tensor],
                                    op: ReduceOp) -> torch.Tensor:
    """torch's all-reduce of every block, staged in scratch; this rank's block is the result."""
    return _reduce_scatter(lambda c, buf, o: native.all_reduce(g.torch_group, buf, o))(ctx, g, out, ins, op)


def _reduce_scatter_shm(ctx: Ctx, g: Group, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    # Straight from the inputs, no staging buffer, unless a dtype conversion or a stride needs it.
    if _work_dtype(out, op) == out.dtype and shm_direct.reduce_scatter_lists(ctx, ins, out, op):
        return out
    return _reduce_scatter_staged_shm(ctx, g, out, ins, op)


def _reduce_scatter_native(ctx: Ctx, g: Group, out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    if on_host(out) and g.size <= RS_OVER_ALL_REDUCE_MAX and "gloo" in getattr(ctx.transport, "backend", ""):
        return _reduce_scatter_over_all_reduce(ctx, g, out, ins, op)
    wd = _work_dtype(out, op)
    tmp_out = out if wd == out.dtype else out.to(wd)
    native.reduce_scatter(g.torch_group, g.ranks, tmp_out, [t.reshape(tmp_out.shape).to(wd) for t in ins], op)
    return tmp_out


def _work_dtype(t: torch.Tensor, op: ReduceOp) -> torch.dtype:
    return work_dtype(t.dtype, op)


def _blocks(ctx: Ctx, root: int, n: int, dtype: torch.dtype, device: torch.device,
            relative: bool) -> tuple[torch.Tensor, Callable[[int], int]]:
    """Scratch of p blocks on ``device``; ``pos(i)`` is where rank i's block lives (root-relative
    when ``relative``, the layout of the tree algorithms)."""
    buf = ctx.scratch("personal", n * ctx.size, dtype, device)
    if relative:
        return buf, lambda i: (i - root) % ctx.size
    return buf, lambda i: i


def _gather(fn: Callable, relative: bool = False) -> Callable:
    def run(ctx: Ctx, g: Group, inp: torch.Tensor, outs: list[torch.Tensor] | None, root: int, root_global: int) -> None:
        n = inp.numel()
        buf, pos = _blocks(ctx, root, n, inp.dtype, inp.device, relative)
        me = pos(ctx.rank)
        buf[me * n : (me + 1) * n].copy_(inp.reshape(-1))
        fn(ctx, buf, root)
        if ctx.rank == root:
            for i, o in enumerate(outs):
                o.copy_(buf[pos(i) * n : (pos(i) + 1) * n].view(o.shape))
    return run


def _gather_native(ctx: Ctx, g: Group, inp: torch.Tensor, outs: list[torch.Tensor] | None, root: int, root_global: int) -> None:
    native.gather(g.torch_group, g.ranks, inp.contiguous(), outs if ctx.rank == root else None, root_global)


def _scatter(fn: Callable, relative: bool = False) -> Callable:
    def run(ctx: Ctx, g: Group, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int, root_global: int) -> None:
        n = out.numel()
        buf, pos = _blocks(ctx, root, n, out.dtype, out.device, relative)
        if ctx.rank == root:
            for i, t in enumerate(ins):
                buf[pos(i) * n : (pos(i) + 1) * n].copy_(t.reshape(-1))
        fn(ctx, buf, root)
        me = pos(ctx.rank)
        out.copy_(buf[me * n : (me + 1) * n].view(out.shape))
    return run


def _scatter_native(ctx: Ctx, g: Group, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int, root_global: int) -> None:
    dst = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    native.scatter(g.torch_group, g.ranks, dst, [t.contiguous() for t in ins] if ctx.rank == root else None, root_global)
    if dst is not out:
        out.copy_(dst)


def _all_to_all(fn: Callable) -> Callable:
    def run(ctx: Ctx, g: Group, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
        fn(ctx, ins, outs)
    return run


def _build() -> dict[tuple[str, str], Implementation]:
    table: dict[tuple[str, str], Implementation] = {}
    ctx_adapters: dict[str, Callable[[Callable], Callable]] = {
        "all_reduce": _all_reduce, "reduce": _reduce, "broadcast": _broadcast, "all_gather": _all_gather,
        "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all,
    }
    for op, names in REGISTRY.items():  # meshtrain's own: any transport
        for name, fn in names.items():
            if (op, name) == ("all_reduce", "hierarchical"):
                run = _all_reduce_hierarchical
            elif op in ("gather", "scatter"):
                wrap = _gather if op == "gather" else _scatter
                run = wrap(getattr(tree, op), relative=True) if name == "tree" else wrap(fn)
            elif op == "barrier":
                run = lambda ctx, g: None  # noqa: E731  (the runner's metadata exchange is the barrier)
            else:
                run = ctx_adapters[op](fn)
            table[op, name] = Implementation(run)
    natives: dict[str, Callable] = {
        "all_reduce": lambda ctx, g, buf, op: native.all_reduce(g.torch_group, buf, op),
        "reduce": lambda ctx, g, buf, op, root, root_global: native.reduce(g.torch_group, buf, op, root_global),
        "broadcast": lambda ctx, g, buf, root, root_global: native.broadcast(g.torch_group, buf, root_global),
        "all_gather": _all_gather_native, "reduce_scatter": _reduce_scatter_native,
        "gather": _gather_native, "scatter": _scatter_native,
        "all_to_all": lambda ctx, g, outs, ins: native.all_to_all(g.torch_group, g.ranks, outs, ins),
        "barrier": lambda ctx, g: native.barrier(g.torch_group),
    }
    for op, run in natives.items():  # torch.distributed's own collective
        table[op, "native"] = Implementation(run, "native_collectives")
    shm: dict[str, Callable] = {
        "all_reduce": _all_reduce(shm_direct.all_reduce), "reduce": _reduce(shm_direct.reduce),
        "broadcast": _broadcast(shm_direct.broadcast), "all_gather": _all_gather_shm,
        "reduce_scatter": _reduce_scatter_shm, "all_to_all": _all_to_all(shm_direct.all_to_all),
    }
    assert set(shm) == set(shm_direct.ALGORITHMS), "every shm collective needs its entry"
    for op, run in shm.items():  # the members' shared buffers
        table[op, "shm"] = Implementation(run, "shared_memory")
    return table


TABLE: dict[tuple[str, str], Implementation] = _build()
