"""``native``: delegate to torch.distributed's own collective on the group's ProcessGroup.

torch orders a group's ranks ascending; meshtrain groups keep the order they were created with,
so list-valued results are permuted between the two orders here.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions as _AllgatherOptions  # not in dist.*

from ..device import on_host
from . import native_wait
from ..transport.base import usable_cores
from ..types import ReduceOp

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # gloo has no AVG everywhere; the caller divides
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}
# The flat-tensor forms (torch 2.13 renamed them *_single and deprecated the old names).
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# ... and the ProcessGroup's methods under them (``direct`` in ``_run``)
_PG_ALL_GATHER_SINGLE = getattr(dist.ProcessGroup, "all_gather_single", None) or dist.ProcessGroup._allgather_base
_PG_REDUCE_SCATTER_SINGLE = (getattr(dist.ProcessGroup, "reduce_scatter_single", None)
                             or dist.ProcessGroup._reduce_scatter_base)
# meshtrain's own algorithms move these; torch's gloo and NCCL collectives refuse them.
NO_NATIVE = (torch.int16,)
# gloo's reduce-scatter works have no future and complete only inside wait(): nothing to look at.
NO_FUTURE = frozenset({REDUCE_SCATTER_SINGLE, dist.reduce_scatter})


class Aborted(Exception):
    """The call's metadata check, running beside it, failed: stop waiting for torch's op."""


class Guard:
    """Lets the runner's metadata check run beside a native op (``runner.run``): the op is issued
    asynchronously and waited for until it completes or the check fails (``fail``), whichever
    comes first, so a mismatched call that torch would hang on is named at once."""

    def __init__(self) -> None:
        self.failed = False
        self.checked = threading.Event()  # set by the runner once the check has a verdict

    def fail(self) -> None:
        """The check failed (or timed out): the wait stops at its next look."""
        self.failed = True

    def wait(self, work: dist.Work, nbytes: int = 0, future: bool | None = None) -> None:
        """Wait for ``work``; raise ``Aborted`` if the check fails first. (``nbytes``: the op's
        size, unused: this wait looks at the check's verdict between its looks anyway; ``future``:
        whether the work has a future, None to ask it.)

        The wait polls ``is_completed``: it yields the core for the first YIELD_S (gloo's threads
        finish a small op in that time), then sleeps in short steps, looking at the check's verdict
        between them. On 2 cores this came out as fast as torch's blocking wait (a future's
        callback costs two more thread hand-offs: 100-250 us a call; docs/benchmarks.md)."""
        if self.failed:
            raise Aborted()
        if not has_future(work, future):  # some gloo works (reduce_scatter) complete only
            self.checked.wait()  # inside wait(): let the check finish first, as if run before
            if self.failed:
                raise Aborted() from None
            work.wait()
            return
        started = time.monotonic()
        while not work.is_completed():
            spent = time.monotonic() - started
            if spent < YIELD_S:
                os.sched_yield()
                continue
            if self.failed:
                raise Aborted()
            time.sleep(min(MAX_SLEEP_S, max(MIN_SLEEP_S, spent / 16)))
        work.wait()  # completed: raises its error, if any


YIELD_S, MIN_SLEEP_S, MAX_SLEEP_S = 200e-6, 50e-6, 1e-3

class _Local(threading.local):
    guard: Guard | None = None  # a class default: a miss costs no AttributeError
    look = True  # this thread's call looks at its op before parking (native_wait.begin)


_local = _Local()


class guarded:  # noqa: N801 - used as a function: ``with guarded(guard):``
    """Native ops called in this block on this thread wait through ``guard``. (A class, not a
    generator-based context manager: it is entered on every checked call whose peers are late.)"""

    __slots__ = ("guard",)

    def __init__(self, guard: Any) -> None:
        self.guard = guard

    def __enter__(self) -> None:
        _local.guard = self.guard

    def __exit__(self, *exc: Any) -> None:
        _local.guard = None


def has_future(work: dist.Work, known: bool | None = None) -> bool:
    """Whether ``work`` has a future, complete outside ``wait`` (gloo's reduce-scatter works have
    none); ``known``, where the caller knows it for the op (``_future_of``), spares asking."""
    if known is not None:
        return known
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True


_FUTURES: dict[Any, bool] = {}  # torch op -> whether its CPU works have a future: asked once per op


def _future_of(fn: Callable[..., Any], work: dist.Work) -> bool:
    """``has_future`` for a CPU work of torch's ``fn``, asked of its first work only (every work of
    one op is of one kind; ``get_future`` builds a Python object on each call)."""
    known = _FUTURES.get(fn)
    if known is None:
        known = _FUTURES[fn] = has_future(work)
    return known


def _run(fn: Callable[..., Any], *args: Any, direct: Callable[[], Any] | None = None, **kw: Any) -> None:
    """Run torch.distributed's ``fn(*args, **kw)``. On CPU tensors ``direct``, if given, issues the
    same op on the ProcessGroup itself: torch's Python wrapper (argument checks, its logging
    decorator) cost 12-35 µs a call here, and on this VM time in front of a gloo call costs two to
    four times its length (docs/benchmarks.md, session 15)."""
    cpu = _on_cpu(args[0])
    guard = _local.guard
    size = _nbytes(args[0])  # how long the wait looks at the op (polled)
    if guard is None and (not cpu or fn in NO_FUTURE):
        # NCCL's ops are ordered on the stream (the host does not wait); gloo's without a future
        # cannot be looked at: both as torch calls them
        if direct is not None and cpu:
            direct().wait()
        else:
            fn(*args, **kw)
        return
    call = native_wait.begin(size) if cpu and fn not in NO_FUTURE else None
    _local.look = call.look if call is not None else True  # look at the op, or park (native_wait.py)
    work = direct() if direct is not None and cpu else fn(*args, async_op=True, **kw)
    if guard is not None:
        guard.wait(work, size, _future_of(fn, work) if cpu else None)
    else:
        finish(work, size)
    if call is not None:
        native_wait.record(call)


def _nbytes(t: torch.Tensor | list[torch.Tensor]) -> int:
    return sum(x.numel() * x.element_size() for x in t) if isinstance(t, list) else t.numel() * t.element_size()


def _world(pg: Any) -> Any:
    return pg if pg is not None else dist.group.WORLD


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t`` goes to the ProcessGroup as is (torch's wrapper views complex as real)."""
    return not t.is_complex()


def _on_cpu(t: torch.Tensor | list[torch.Tensor]) -> bool:
    return on_host(t[0] if isinstance(t, list) else t)


def finish(work: dist.Work, nbytes: int = 0) -> None:
    """Wait for a CPU op the way a spin-then-park lock does: look at ``work`` for up to POLL_S,
    handing the core to any runnable thread between looks (sched_yield), then block in torch's
    wait. On the 2-core test VM a thread that blocks at once lets its core idle, and waking it
    when the peer's data arrives is slow: this took 0.75-1.0x the time of torch's blocking call at
    4 KB-4 MB on 2 and 4 ranks (docs/benchmarks.md, session 14). Only works with a future complete
    outside ``wait`` (``NO_FUTURE`` are not looked at). ``nbytes``: the op's size (see
    ``polled``)."""
    polled(work, nbytes)
    work.wait()


def polled(work: dist.Work, nbytes: int = 0) -> bool:
    """True once ``work`` completed, looked at for up to POLL_S, yielding the core between looks.
    On a host with more ranks than cores an op of LOOK_MAX_BYTES or more is looked at once only:
    it outlasts the looks, and they take the core from ranks that must run for it to end (4 ranks
    on 2 cores, 1 MB all-gather: 3-10 % slower with them, docs/benchmarks.md, session 15). With a
    core per rank, an op below POLL_SMALL_MAX_BYTES is looked at for up to POLL_SMALL_S: such an op
    mostly ends within it, and a thread that parks sooner lets its core idle, whose wake-up here
    took a scheduler tick (~4 ms) on a quarter to half of 4 KB all-reduces (docs/benchmarks.md,
    session 23). A call whose learned mode is to park (``native_wait``) looks once."""
    if not _local.look or (nbytes >= LOOK_MAX_BYTES and _crowded[0]):
        return work.is_completed()
    end = time.monotonic() + (POLL_SMALL_S if nbytes < POLL_SMALL_MAX_BYTES and not _crowded[0] else POLL_S)
    while not work.is_completed():
        if time.monotonic() >= end:
            return False
        os.sched_yield()
    return True


POLL_S = float(os.environ.get("MESHTRAIN_NATIVE_POLL_US", "200")) * 1e-6
POLL_SMALL_S = float(os.environ.get("MESHTRAIN_NATIVE_POLL_SMALL_US", "1000")) * 1e-6
POLL_SMALL_MAX_BYTES = 4 << 20  # gloo's own ops below it took 0.3-3 ms on 2 ranks here
LOOK_MAX_BYTES = int(os.environ.get("MESHTRAIN_NATIVE_LOOK_MAX_BYTES", str(1 << 20)))
_crowded = [False]  # this host runs more ranks than this process may use cores (``crowded``)


def crowded(ranks_here: int) -> None:
    """Tell the waits how many ranks share this host (comm.init): more than the cores this
    process may use, and large ops are not looked at (``polled``). What the waits learned before is
    forgotten (``native_wait.reset``)."""
    _crowded[0] = ranks_here > usable_cores()
    native_wait.reset()


def _check(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in NO_NATIVE:
        raise RuntimeError(f"algorithm='native' cannot move {t.dtype}: torch.distributed's gloo and NCCL "
                           "collectives do not support it; use algorithm='auto' (meshtrain's own algorithms do)")
    return t


def torch_op(op: ReduceOp) -> dist.ReduceOp:
    """The torch.distributed reduce op that implements ``op`` (AVG is summed, then divided)."""
    return _TORCH_OPS[op]


def order(ranks: list[int]) -> list[int]:
    """For each torch group rank (ascending global ranks), the meshtrain group rank."""
    return [ranks.index(r) for r in sorted(ranks)]


_OPTIONS: dict[tuple[Any, Any], Any] = {}


def _options(kind: Callable[[], Any], op: ReduceOp | None = None) -> Any:
    """The ProcessGroup's options object of ``kind`` (with reduce op ``op``), built once and shared:
    the op reads it when issued and keeps none of it, and building one per call cost a pybind object
    on every call's way in. Never modified after it is built."""
    opts = _OPTIONS.get((kind, op))
    if opts is None:
        opts = kind()
        if op is not None:
            opts.reduceOp = torch_op(op)
        _OPTIONS[kind, op] = opts
    return opts


def all_reduce(pg, buf: torch.Tensor, op: ReduceOp) -> None:
    """torch.distributed.all_reduce."""
    def direct() -> Any:
        return _world(pg).allreduce([buf], _options(dist.AllreduceOptions, op))

    _run(dist.all_reduce, _check(buf), torch_op(op), group=pg, direct=direct if _plain(buf) else None)


def reduce(pg, buf: torch.Tensor, op: ReduceOp, root_global: int) -> None:
    """torch.distributed.reduce."""
    def direct() -> Any:
        group = _world(pg)
        opts = dist.ReduceOptions()
        opts.reduceOp, opts.rootRank, opts.rootTensor = torch_op(op), dist.get_group_rank(group, root_global), 0
        return group.reduce([buf], opts)

    _run(dist.reduce, _check(buf), root_global, torch_op(op), group=pg, direct=direct if _plain(buf) else None)


def broadcast(pg, buf: torch.Tensor, root_global: int) -> None:
    """torch.distributed.broadcast."""
    def direct() -> Any:
        group = _world(pg)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = dist.get_group_rank(group, root_global), 0
        return group.broadcast([buf], opts)

    _run(dist.broadcast, _check(buf), root_global, group=pg, direct=direct if _plain(buf) else None)


def joined(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat tensor whose consecutive blocks are ``ts`` (contiguous, one dtype, adjacent in one
    storage), or None: gloo's tensor forms of all-gather and reduce-scatter skip the list forms'
    per-block copies."""
    first = ts[0]
    if not on_host(first):  # NCCL's list forms are not slower; keep one path there
        return None
    es, at = first.element_size(), first.data_ptr()
    for t in ts:
        if not t.is_contiguous() or t.dtype != first.dtype or t.data_ptr() != at:
            return None
        at += t.numel() * es
    total = sum(t.numel() for t in ts)
    return torch.empty(0, dtype=first.dtype).set_(first.untyped_storage(), first.storage_offset(), (total,))


def all_gather(pg, ranks: list[int], outs: list[torch.Tensor] | None, inp: torch.Tensor,
               whole: torch.Tensor | None = None) -> None:
    """torch.distributed.all_gather into ``outs`` (meshtrain group order), or into the flat
    ``whole`` whose consecutive blocks they are (either may be None, not both)."""
    if ranks == sorted(ranks):
        flat = whole if whole is not None else joined(outs)
        if flat is not None:
            flat_in = _check(inp) if inp.dim() == 1 else _check(inp).reshape(-1)
            direct = (lambda: _PG_ALL_GATHER_SINGLE(_world(pg), flat, flat_in, _options(_AllgatherOptions))) \
                if _plain(flat_in) else None
            _run(ALL_GATHER_SINGLE, flat, flat_in, group=pg, direct=direct)
            return
    if outs is None:
        n = inp.numel()
        outs = [whole[i * n : (i + 1) * n] for i in range(len(ranks))]
    _run(dist.all_gather, [outs[i] for i in order(ranks)], _check(inp), group=pg)


def reduce_scatter(pg, ranks: list[int], out: torch.Tensor, ins: list[torch.Tensor], op: ReduceOp) -> None:
    """torch.distributed.reduce_scatter with ``ins`` in meshtrain group order."""
    whole = joined(ins) if ranks == sorted(ranks) and out.is_contiguous() else None
    if whole is not None and whole.dtype == out.dtype:
        # gloo checks dim 0 (output rows x world == input rows): both flat
        flat_out = _check(out) if out.dim() == 1 else _check(out).view(-1)

        def direct() -> Any:
            return _PG_REDUCE_SCATTER_SINGLE(_world(pg), flat_out, whole, _options(dist.ReduceScatterOptions, op))

        _run(REDUCE_SCATTER_SINGLE, flat_out, whole, torch_op(op), group=pg, direct=direct if _plain(whole) else None)
        return
    _run(dist.reduce_scatter, _check(out), [ins[i] for i in order(ranks)], torch_op(op), group=pg)


def all_to_all(pg, ranks: list[int], outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
    """torch.distributed.all_to_all_single over the concatenated (possibly uneven) blocks."""
    perm = order(ranks)
    ins_t = [ins[i].reshape(-1) for i in perm]
    outs_t = [outs[i] for i in perm]
    flat_in = torch.cat(ins_t) if ins_t else torch.empty(0)
    flat_out = torch.empty(sum(o.numel() for o in outs_t), dtype=flat_in.dtype, device=flat_in.device)
    _run(dist.all_to_all_single, flat_out, _check(flat_in), [o.numel() for o in outs_t], [t.numel() for t in ins_t], group=pg)
    off = 0
    for o in outs_t:
        o.view(-1).copy_(flat_out[off : off + o.numel()])
        off += o.numel()


def gather(pg, ranks: list[int], inp: torch.Tensor, outs: list[torch.Tensor] | None, root_global: int) -> None:
    """torch.distributed.gather (``outs`` in meshtrain group order, on the root only)."""
    lst = [outs[i] for i in order(ranks)] if outs is not None else None
    _run(dist.gather, _check(inp), lst, dst=root_global, group=pg)


def scatter(pg, ranks: list[int], out: torch.Tensor, ins: list[torch.Tensor] | None, root_global: int) -> None:
    """torch.distributed.scatter (``ins`` in meshtrain group order, on the root only)."""
    lst = [ins[i] for i in order(ranks)] if ins is not None else None
    _run(dist.scatter, _check(out), lst, src=root_global, group=pg)


def barrier(pg) -> None:
    """torch.distributed.barrier."""
    dist.barrier(group=pg)
