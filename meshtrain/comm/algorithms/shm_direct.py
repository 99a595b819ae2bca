"""Collectives that work on the shared buffers directly (the shm transport only): ``algorithm="shm"``.

Point-to-point algorithms copy every byte twice per hop (into a slot, out of it). Here a rank
copies its input into its own shared buffer once, and its peers read it from there:

* all_reduce: rank i reduces slice i of the chunk straight out of every peer's buffer into its
  own tensor, publishes the reduced slice, and every rank copies the other slices out (a
  reduce-scatter and an all-gather through memory). Messages up to ``SMALL_BYTES`` take one step
  instead: every rank reduces the whole message from all buffers, in rank order, so all ranks
  get the same bits.
* reduce_scatter / all_gather / broadcast / reduce / all_to_all: one copy in, one read out per
  byte (all_to_all's sizes travel in a header with its first chunk, checked by every member).
* all_reduce of a symmetric tensor (``meshtrain.comm.symmetric_empty``: it lives in shared memory
  on every member): no copy in and no chunks. Rank i reduces slice i straight out of its peers'
  tensors, then copies the other reduced slices out of their owners' tensors.

Messages larger than ``CHUNK_BYTES`` are cut into chunks that alternate between the two halves
of each buffer (see ``transport/shm_area.py`` for the step protocol), so peers overlap. 1 MiB
chunks keep the shared buffers in the last-level cache: on the 2-core test machine they were
20-35 % faster than 4 MiB ones at 16 MB (docs/benchmarks.md).
"""

from __future__ import annotations

import os

import torch

from ..types import ReduceOp, combine_
from ..transport.base import FingerprintMismatch, on_shared_memory
from .base import Ctx, even_bounds

CHUNK_BYTES = int(os.environ.get("MESHTRAIN_SHM_CHUNK_BYTES", str(1 << 20)))
SMALL_BYTES = 64 << 10
# The in-place all-reduce sums its slice in blocks of this size, one block through every peer
# before the next: at 64 MB with 4 ranks 9-10 % faster than whole-slice passes, equal at 16 MB.
REDUCE_BLOCK_BYTES = 1 << 20


def usable(ctx: Ctx) -> bool:
    """True if ``ctx``'s group can run the shm collectives (shm transport, one host)."""
    return on_shared_memory(ctx.transport, ctx.ranks)


def _area(ctx: Ctx, half_bytes: int):
    if not usable(ctx):
        raise ValueError(
            f"algorithm='shm' needs the shm transport with every rank of the group on one host; "
            f"this group's ranks {ctx.ranks} are on {sorted(set(ctx.hosts))} over transport "
            f"'{ctx.transport.kind}': use init(transport='shm' or 'auto'), or another algorithm"
        )
    area = ctx.transport.area(ctx.ranks, f"t{ctx.tag}", ctx.deadline)
    area.reserve(half_bytes, max(CHUNK_BYTES, SMALL_BYTES), ctx.deadline)
    return area


def _arrive(ctx: Ctx, area, c: int, what: str) -> None:
    """Announce step 2c+1 (my input is in my buffer) and wait for every member's. In a call's
    first chunk the call's metadata fingerprint travels with the step and is compared here: the
    metadata check without a synchronisation of its own. On a mismatch every member sees it (one
    differing fingerprint differs from everyone's), finishes the chunk and raises."""
    fp = ctx.fingerprint
    area.announce(2 * c + 1, fp)
    area.wait_all(2 * c + 1, ctx.deadline, what)
    if fp is not None:
        ctx.fingerprint = None
        if not area.agree(2 * c + 1, fp):
            area.announce(2 * c + 2)
            raise FingerprintMismatch()


def check_only(ctx: Ctx) -> None:
    """Meet the group in one step that only checks the call's fingerprint: for an empty call, and
    ahead of a non-shm algorithm on a shm group (so every call on the group meets at the same
    kind of step, and a mismatched pair of calls is named rather than left to time out)."""
    if ctx.fingerprint is not None and ctx.size > 1:
        area = _area(ctx, 1)
        c, _ = area.begin(ctx.deadline)
        _arrive(ctx, area, c, "the metadata check")
        area.announce(2 * c + 2)


def _per_chunk(es: int, blocks: int = 1) -> int:
    """Elements per block in one chunk (a chunk holds ``blocks`` such blocks)."""
    return max(CHUNK_BYTES // (es * blocks), 1)


def symmetric_of(transport, ranks: list[int], buf: torch.Tensor):
    """(allocation's area, byte offset) if the all-reduce of ``buf`` takes the in-place path:
    ``buf`` lies in a symmetric allocation of the group ``ranks`` and is larger than
    ``SMALL_BYTES`` (smaller ones take the one-step path). None otherwise."""
    if (len(ranks) == 1 or buf.numel() * buf.element_size() <= SMALL_BYTES
            or not on_shared_memory(transport, ranks)):
        return None
    return transport.symmetric.find(buf, ranks)


def all_reduce_symmetric(ctx: Ctx, buf: torch.Tensor, op: ReduceOp, sym, offset: int, divide: int = 1) -> None:
    """All-reduce in place across the members' symmetric tensors (``sym, offset`` from
    ``symmetric_of``; the front end dispatches here). Three synchronisations, on the
    group's step protocol (two of its chunks, no data in its buffers): inputs ready (with the
    metadata fingerprint), slices reduced, peers done reading (before anyone returns, since the
    caller may then write its tensor). ``divide`` > 1 divides each reduced slice by it while it is
    in cache (an average: the same values as dividing the whole result, without another pass over
    it on every rank)."""
    p, r, es, dt = ctx.size, ctx.rank, buf.element_size(), buf.dtype
    b = even_bounds(buf.numel(), p)
    area = _area(ctx, 1)
    c, _ = area.begin(ctx.deadline)
    _arrive(ctx, area, c, "inputs")
    step = max(REDUCE_BLOCK_BYTES // es, 1)
    for s in range(b[r], b[r + 1], step):  # by blocks: the partial sum stays in cache across peers
        e = min(s + step, b[r + 1])
        for d in range(1, p):  # staggered, so the ranks do not all read one tensor at once
            combine_(buf[s:e], sym.view((r + d) % p, 0, offset + s * es, e - s, dt), op)
        if divide > 1:
            buf[s:e].div_(divide)
    area.announce(2 * c + 2)
    c1, _ = area.begin(ctx.deadline)
    area.wait_all(2 * c + 2, ctx.deadline, "reduced slices")
    ks = [(r + d) % p for d in range(1, p)]
    torch._foreach_copy_([buf[b[k] : b[k + 1]] for k in ks],
                         [sym.view(k, 0, offset + b[k] * es, b[k + 1] - b[k], dt) for k in ks])
    area.announce(2 * c1 + 1)
    area.wait_all(2 * c1 + 1, ctx.deadline, "its peers to finish reading")
    area.announce(2 * c1 + 2)


def all_reduce(ctx: Ctx, buf: torch.Tensor, op: ReduceOp) -> None:
    """Reduce-scatter then all-gather through the shared buffers: per rank (p-1)/p·n copied in,
    (p-1)/p·n reduced, n/p published, (p-1)/p·n copied out; two steps per chunk. (A symmetric
    tensor goes to ``all_reduce_symmetric`` instead.)"""
    p, r, n, es = ctx.size, ctx.rank, buf.numel(), buf.element_size()
    if p == 1 or n == 0:
        return check_only(ctx)
    if n * es <= SMALL_BYTES:
        area = _area(ctx, n * es)
        c, half = area.begin(ctx.deadline)
        area.view(r, half, 0, n, buf.dtype).copy_(buf)
        _arrive(ctx, area, c, "inputs")
        views = [area.view(k, half, 0, n, buf.dtype) for k in range(p)]
        if op is ReduceOp.SUM or op is ReduceOp.AVG:
            torch.add(views[0], views[1], out=buf)
        else:
            buf.copy_(views[0])
            combine_(buf, views[1], op)
        for k in range(2, p):
            combine_(buf, views[k], op)
        area.announce(2 * c + 2)
        return
    per = _per_chunk(es)
    area = _area(ctx, min(n, per) * es)
    ks = [(r + d) % p for d in range(1, p)]
    for start in range(0, n, per):
        x = buf[start : start + per]
        b = even_bounds(x.numel(), p)
        c, half = area.begin(ctx.deadline)

        def shared(k: int, i: int) -> torch.Tensor:  # slice i of member k's buffer
            return area.view(k, half, b[i] * es, b[i + 1] - b[i], buf.dtype)

        lo, hi, m = b[r], b[r + 1], x.numel()
        if lo > 0:  # the slices the others reduce, in at most two copies
            area.view(r, half, 0, lo, buf.dtype).copy_(x[:lo])
        if hi < m:
            area.view(r, half, hi * es, m - hi, buf.dtype).copy_(x[hi:])
        _arrive(ctx, area, c, "inputs")
        mine = x[lo:hi]
        for k in ks:  # staggered, so the ranks do not all read one buffer at once
            combine_(mine, shared(k, r), op)
        shared(r, r).copy_(mine)
        area.announce(2 * c + 2)
        area.wait_all(2 * c + 2, ctx.deadline, "reduced slices")
        torch._foreach_copy_([x[b[k] : b[k + 1]] for k in ks], [shared(k, k) for k in ks])


def _scatter_reduce(ctx: Ctx, srcs: list[torch.Tensor], dst: torch.Tensor, op: ReduceOp) -> None:
    """``dst`` <- the reduction over ranks of their ``srcs[r]`` (flat, equal sizes): publish the
    blocks peers need, reduce mine straight out of their buffers (``dst`` may be ``srcs[r]``)."""
    p, r, nb, es, dt = ctx.size, ctx.rank, dst.numel(), dst.element_size(), dst.dtype
    if p == 1 or nb == 0:
        return check_only(ctx)
    per = _per_chunk(es, p)
    area = _area(ctx, min(nb, per) * p * es)
    for s in range(0, nb, per):
        m = min(per, nb - s)
        c, half = area.begin(ctx.deadline)
        for i in range(p):
            if i != r:
                area.view(r, half, i * m * es, m, dt).copy_(srcs[i][s : s + m])
        _arrive(ctx, area, c, "inputs")
        mine = dst[s : s + m]
        if mine.data_ptr() != srcs[r][s : s + m].data_ptr():
            mine.copy_(srcs[r][s : s + m])
        for d in range(1, p):
            combine_(mine, area.view((r + d) % p, half, r * m * es, m, dt), op)
        area.announce(2 * c + 2)


def reduce_scatter(ctx: Ctx, buf: torch.Tensor, op: ReduceOp) -> None:
    """``buf`` holds p blocks; block r ends up reduced. Peers' blocks for r are read in place."""
    nb = buf.numel() // ctx.size
    blocks = [buf[k * nb : (k + 1) * nb] for k in range(ctx.size)]
    _scatter_reduce(ctx, blocks, blocks[ctx.rank], op)


def reduce_scatter_lists(ctx: Ctx, ins: list[torch.Tensor], out: torch.Tensor, op: ReduceOp) -> bool:
    """The same from the caller's tensors, without the staging buffer of the generic front end.
    Returns False, doing nothing, when a dtype conversion or a strided tensor needs that path."""
    if not out.is_contiguous() or any(t.dtype != out.dtype or not t.is_contiguous() for t in ins):
        return False
    _scatter_reduce(ctx, [t.reshape(-1) for t in ins], out.view(-1), op)
    if ctx.size == 1:
        out.view(-1).copy_(ins[0].reshape(-1))
    return True


def _gather_blocks(ctx: Ctx, src: torch.Tensor, dsts: list[torch.Tensor], own: bool = False) -> None:
    """Publish flat ``src`` chunk by chunk; copy every peer k's chunk into flat ``dsts[k]`` (and,
    with ``own``, my chunk into ``dsts[rank]`` while it is still in cache)."""
    p, r, nb, es = ctx.size, ctx.rank, src.numel(), src.element_size()
    if p == 1 or nb == 0:
        if own:
            dsts[r].copy_(src)
        return check_only(ctx)
    per = _per_chunk(es)
    area = _area(ctx, min(nb, per) * es)
    for s in range(0, nb, per):
        m = min(per, nb - s)
        c, half = area.begin(ctx.deadline)
        area.view(r, half, 0, m, src.dtype).copy_(src[s : s + m])
        if own:  # before the wait: it overlaps the peers' publishing
            dsts[r][s : s + m].copy_(src[s : s + m])
        _arrive(ctx, area, c, "blocks")
        for d in range(1, p):
            k = (r + d) % p
            dsts[k][s : s + m].copy_(area.view(k, half, 0, m, src.dtype))
        area.announce(2 * c + 2)


def all_gather(ctx: Ctx, buf: torch.Tensor) -> None:
    """``buf`` holds p blocks, own in place: publish mine, copy every peer's out of its buffer."""
    nb = buf.numel() // ctx.size
    blocks = [buf[k * nb : (k + 1) * nb] for k in range(ctx.size)]
    _gather_blocks(ctx, blocks[ctx.rank], blocks)


def all_gather_lists(ctx: Ctx, inp: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """The same from the caller's tensors: ``outs[i]`` receives rank i's ``inp`` without the
    staging buffer the generic front end copies through (two full passes fewer)."""
    src = inp.reshape(-1)
    if all(o.is_contiguous() for o in outs):
        flat = [o.view(-1) for o in outs]
        _gather_blocks(ctx, src, flat, own=flat[ctx.rank].data_ptr() != src.data_ptr())
        return
    n = src.numel()  # some output is strided: gather into a staging buffer, then copy
    buf = ctx.scratch("all_gather_out", n * ctx.size, src.dtype)
    buf[ctx.rank * n : (ctx.rank + 1) * n].copy_(src)
    all_gather(ctx, buf)
    for i, o in enumerate(outs):
        o.copy_(buf[i * n : (i + 1) * n].view(o.shape))


def _rooted(ctx: Ctx, buf: torch.Tensor, publish: bool, read_from: list[int], consume) -> None:
    """The one-to-all and all-to-one shape: per chunk, publish ``buf``'s chunk if ``publish``,
    then wait for the members ``read_from`` and ``consume(chunk, area, half)``."""
    p, n, es = ctx.size, buf.numel(), buf.element_size()
    if p == 1 or n == 0:
        return check_only(ctx)
    per = _per_chunk(es)
    area = _area(ctx, min(n, per) * es)
    for s in range(0, n, per):
        x = buf[s : s + per]
        c, half = area.begin(ctx.deadline)
        if publish:
            area.view(ctx.rank, half, 0, x.numel(), buf.dtype).copy_(x)
        if ctx.fingerprint is not None:  # the first chunk of a checked call: everyone meets
            _arrive(ctx, area, c, "published data")
        else:
            area.announce(2 * c + 1)
            for k in read_from:
                area.wait(k, 0, 2 * c + 1, ctx.deadline, "published data")
        if read_from:
            consume(x, area, half)
        area.announce(2 * c + 2)


def broadcast(ctx: Ctx, buf: torch.Tensor, root: int) -> None:
    """The root publishes each chunk once; every other rank copies it out."""
    def copy_out(x: torch.Tensor, area, half: int) -> None:
        x.copy_(area.view(root, half, 0, x.numel(), x.dtype))

    _rooted(ctx, buf, ctx.rank == root, [] if ctx.rank == root else [root], copy_out)


def reduce(ctx: Ctx, buf: torch.Tensor, op: ReduceOp, root: int) -> None:
    """Everyone publishes; the root reduces every peer's buffer into its own tensor."""
    others = [k for k in range(ctx.size) if k != root]

    def reduce_in(x: torch.Tensor, area, half: int) -> None:
        for k in others:
            combine_(x, area.view(k, half, 0, x.numel(), x.dtype), op)

    _rooted(ctx, buf, ctx.rank != root, others if ctx.rank == root else [], reduce_in)


HEADER_BYTES = 64
"""all_to_all's header (what a rank sends to and expects from each member) is padded to a multiple
of this, so the data after it stays aligned."""


def _publish_window(area, r: int, half: int, at: int, ins: list[torch.Tensor], lo: int, hi: int) -> None:
    """Copy elements [lo, hi) of the concatenation of flat ``ins`` to byte ``at`` of my half."""
    start, es = 0, ins[0].element_size()
    for t in ins:
        a, b = max(lo, start), min(hi, start + t.numel())
        if a < b:
            area.view(r, half, at + (a - lo) * es, b - a, t.dtype).copy_(t[a - start : b - start])
        start += t.numel()


def all_to_all(ctx: Ctx, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """Flat ``outs[k]`` receives rank k's flat ``ins[me]`` through the members' buffers: every rank
    publishes a header (the elements it sends to and expects from each member) and its inputs back
    to back, once, a chunk at a time; every rank copies its part out of each peer's buffer. One copy
    in and one out per byte, where point-to-point copies each part into a slot and out again.

    The pairs are checked here, not by a metadata exchange first: every rank reads every header,
    so all see the same size matrix, and a rank whose send to j differs from what j expects makes
    every member raise ``FingerprintMismatch`` at the same step (the runner then names them)."""
    p, r, dtype = ctx.size, ctx.rank, ins[0].dtype
    if p == 1:
        outs[0].copy_(ins[0])
        return check_only(ctx)
    es = ins[0].element_size()
    head = -(-2 * p * 8 // HEADER_BYTES) * HEADER_BYTES
    per = max((CHUNK_BYTES - head) // es, 1)
    area = _area(ctx, head + per * es)
    sends = [t.numel() for t in ins]
    c, half = area.begin(ctx.deadline)
    area.view(r, half, 0, 2 * p, torch.int64).copy_(torch.tensor(sends + [o.numel() for o in outs]))
    _publish_window(area, r, half, head, ins, 0, per)
    outs[r].copy_(ins[r])  # before the wait: it overlaps the peers' publishing
    _arrive(ctx, area, c, "the all-to-all's parts")
    table = [area.view(k, half, 0, 2 * p, torch.int64).tolist() for k in range(p)]
    if any(table[k][j] != table[j][p + k] for k in range(p) for j in range(p)):
        area.announce(2 * c + 2)
        raise FingerprintMismatch()
    mine = [(sum(table[k][:r]), table[k][r]) for k in range(p)]  # (offset, length) of my part in k's data
    rounds = max(-(-sum(row[:p]) // per) for row in table)
    for i in range(max(rounds, 1)):
        if i:
            c, half = area.begin(ctx.deadline)
            _publish_window(area, r, half, head, ins, i * per, (i + 1) * per)
            area.announce(2 * c + 1)
            area.wait_all(2 * c + 1, ctx.deadline, "the all-to-all's parts")
        for d in range(1, p):
            k = (r + d) % p
            off, n = mine[k]
            a, b = max(off, i * per), min(off + n, (i + 1) * per)
            if a < b:
                outs[k][a - off : b - off].copy_(area.view(k, half, head + (a - i * per) * es, b - a, dtype))
        area.announce(2 * c + 2)


ALGORITHMS = {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "all_gather": all_gather,
              "broadcast": broadcast, "reduce": reduce, "all_to_all": all_to_all}
