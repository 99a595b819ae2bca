"""The 4D-parallel pieces of ``compat_llama``, written against torch.distributed's public API only:
``dist`` is either ``torch.distributed`` or ``meshtrain.comm``.

- ``Mesh``: the rank grid (pp, dp, cp, tp), tp fastest, and its groups;
- tensor parallelism (Megatron): ``copy_to_tp`` / ``reduce_from_tp``;
- context parallelism: ``ring_attention`` (K/V blocks rotate around the cp ring; exact backward);
- pipeline parallelism: ``one_f_one_b`` (warm-up forwards, steady 1F1B, cool-down backwards).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

DIMS = ("pp", "dp", "cp", "tp")  # the rank grid's order, tp fastest


@dataclass
class Mesh:
    """This rank's place in the (pp, dp, cp, tp) grid and the groups it belongs to. A group of a
    dimension of size 1 is None (nothing to communicate); ``dpcp`` is the gradient-reduction group
    (weights are replicated over dp and cp alike), one group as torchtitan makes it."""

    dist: Any
    rank: int
    sizes: dict[str, int]
    coord: dict[str, int]
    tp: Any = None
    cp: Any = None
    dpcp: Any = None
    pp: Any = None
    cp_ranks: tuple[int, ...] = ()
    pp_ranks: tuple[int, ...] = ()


def grid_rank(sizes: dict[str, int], coord: dict[str, int]) -> int:
    """The global rank at ``coord`` of the (pp, dp, cp, tp) grid."""
    r = 0
    for d in DIMS:
        r = r * sizes[d] + coord[d]
    return r


def _coords(sizes: dict[str, int]) -> list[dict[str, int]]:
    out = [{}]
    for d in DIMS:
        out = [{**c, d: i} for c in out for i in range(sizes[d])]
    return out  # in rank order


def _enumerate(sizes: dict[str, int], along: tuple[str, ...]) -> list[list[int]]:
    """Rank lists of the groups that vary ``along`` these dims (the others fixed), in a fixed order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for c in _coords(sizes):
        key = tuple(c[d] for d in DIMS if d not in along)
        groups.setdefault(key, []).append(grid_rank(sizes, c))
    return list(groups.values())


def build_mesh(dist: Any, rank: int, sizes: dict[str, int]) -> Mesh:
    """Make every group of the grid (every rank makes every group, in the same order)."""
    coord = next(c for c in _coords(sizes) if grid_rank(sizes, c) == rank)
    mesh = Mesh(dist, rank, dict(sizes), coord)
    for name, along in (("tp", ("tp",)), ("cp", ("cp",)), ("dpcp", ("dp", "cp")), ("pp", ("pp",))):
        if all(sizes[d] == 1 for d in along):
            continue
        lists = _enumerate(sizes, along)
        mine, _ = dist.new_subgroups_by_enumeration(lists)
        setattr(mesh, name, mine)
        ranks = tuple(next(lst for lst in lists if rank in lst))
        if name == "cp":
            mesh.cp_ranks = ranks
        elif name == "pp":
            mesh.pp_ranks = ranks
    return mesh


def exchange(dist: Any, group: Any, sends: list[tuple[torch.Tensor, int]],
             recvs: list[tuple[torch.Tensor, int]]) -> list[Any]:
    """Post sends and receives (tensor, global peer) as one ``batch_isend_irecv``; return the Works."""
    ops = [dist.P2POp(dist.isend, t, p, group) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, p, group) for t, p in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def wait_all(works: list[Any]) -> None:
    """Wait on every Work of an ``exchange``."""
    for w in works:
        w.wait()


# ------------------------------------------------------------------------- tensor parallelism


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the input's gradient over the tp group (each rank saw only
    its heads' / columns' share of it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.contiguous().clone()  # autograd's buffer may be shared: reduce a copy of our own
        ctx.mesh.dist.all_reduce(g, op=ctx.mesh.dist.ReduceOp.SUM, group=ctx.mesh.tp)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward sums the row-parallel partial outputs over the tp group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        out = x.contiguous().clone()
        mesh.dist.all_reduce(out, op=mesh.dist.ReduceOp.SUM, group=mesh.tp)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def copy_to_tp(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Enter a column-parallel region (identity when tp = 1)."""
    return x if mesh.tp is None else _CopyToTP.apply(x, mesh)


def reduce_from_tp(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Leave a row-parallel region (identity when tp = 1)."""
    return x if mesh.tp is None else _ReduceFromTP.apply(x, mesh)


# ------------------------------------------------------------------------ ring attention (cp)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:  # the block of this rank's own chunk: causal inside it
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's query chunk over every earlier chunk of the sequence. Rank
    i of the cp ring holds chunk i; at ring step j it holds chunk i - j's K/V (blocks of later
    chunks are fully masked and skipped), merged by log-sum-exp. Backward rotates K/V again, with
    their dK/dV accumulators travelling along; one last hop brings each rank its own chunk's."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        n, me = len(mesh.cp_ranks) or 1, mesh.coord["cp"]
        scale = q.shape[-1] ** -0.5
        kv = torch.stack([k, v])
        out = lse = None
        for j in range(n):
            works, nxt = [], None
            if j < n - 1:  # start the next hop now; it overlaps this block's compute
                nxt = torch.empty_like(kv)
                works = _hop(mesh, kv, nxt)
            src = (me - j) % n
            if src <= me:
                s = _scores(q, kv[0], scale, src == me)
                m = s.amax(-1, keepdim=True)
                p = torch.exp(s - m)
                l_ = p.sum(-1, keepdim=True)
                o, lse_b = torch.matmul(p, kv[1]) / l_, m + torch.log(l_)
                if out is None:
                    out, lse = o, lse_b
                else:  # online softmax: rescale both partial outputs to the merged normaliser
                    new = torch.logaddexp(lse, lse_b)
                    out = out * torch.exp(lse - new) + o * torch.exp(lse_b - new)
                    lse = new
            wait_all(works)
            if nxt is not None:
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mesh = mesh
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        mesh = ctx.mesh
        n, me = len(mesh.cp_ranks) or 1, mesh.coord["cp"]
        scale = q.shape[-1] ** -0.5
        dout = dout.contiguous()
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        # one buffer [k, v, dk, dv]: K/V and their gradient accumulators make one message per hop
        buf = torch.cat([torch.stack([k, v]), torch.zeros((2, *k.shape), dtype=k.dtype)])
        for j in range(n):
            src = (me - j) % n
            if src <= me:
                kb, vb = buf[0], buf[1]
                p = torch.exp(_scores(q, kb, scale, src == me) - lse)
                buf[3] += torch.matmul(p.transpose(-1, -2), dout)
                ds = p * (torch.matmul(dout, vb.transpose(-1, -2)) - delta)
                dq += torch.matmul(ds, kb) * scale
                buf[2] += torch.matmul(ds.transpose(-1, -2), q) * scale
            if j < n - 1:
                got = torch.empty_like(buf)
                wait_all(_hop(mesh, buf, got))
                buf = got
        dkv = buf[2:]
        if n > 1:  # dK/dV of chunk me + 1 are complete: one last hop takes them home
            dkv = torch.empty_like(dkv)
            wait_all(_hop(mesh, buf[2:].contiguous(), dkv))
        return dq, dkv[0], dkv[1], None


def _hop(mesh: Mesh, send: torch.Tensor, recv: torch.Tensor) -> list[Any]:
    """One step around the cp ring: send to the next rank, receive from the previous."""
    n, me = len(mesh.cp_ranks), mesh.coord["cp"]
    return exchange(mesh.dist, mesh.cp, [(send, mesh.cp_ranks[(me + 1) % n])],
                    [(recv, mesh.cp_ranks[(me - 1) % n])])


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Causal attention over the whole (cp-split) sequence; q, k, v: [batch, heads, chunk, head_dim]
    of this rank's chunk. With cp = 1 it is plain blockwise causal attention."""
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), mesh)


# ----------------------------------------------------------------------------- pipeline (1F1B)


def one_f_one_b(mesh: Mesh, n_micro: int, forward: Callable[[int, torch.Tensor | None], torch.Tensor],
                act_shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Run ``n_micro`` micro-batches through this rank's stage with the 1F1B schedule, accumulating
    gradients. ``forward(i, x)`` returns the stage's output for micro-batch i (x: the received
    activation, None on the first stage); on the last stage that is the micro-batch's loss.
    Activations (``act_shape``) go forward and their gradients back with ``batch_isend_irecv``;
    each steady step pairs a send with the matching receive in one batch, as Megatron does."""
    dist, stages, s = mesh.dist, mesh.sizes["pp"], mesh.coord["pp"]
    first, last = s == 0, s == stages - 1
    prev = None if first else mesh.pp_ranks[s - 1]
    nxt = None if last else mesh.pp_ranks[s + 1]
    pending: deque[tuple[torch.Tensor | None, torch.Tensor]] = deque()

    def comm(send_to: int | None, send: torch.Tensor | None, recv_from: int | None) -> torch.Tensor | None:
        got = None if recv_from is None else torch.empty(act_shape, dtype=dtype)
        sends = [] if send_to is None or send is None else [(send.detach().contiguous(), send_to)]
        wait_all(exchange(dist, mesh.pp, sends, [] if got is None else [(got, recv_from)]))
        return got

    def fwd(i: int, x: torch.Tensor | None) -> torch.Tensor:
        if x is not None:
            x.requires_grad_()
        y = forward(i, x)
        pending.append((x, y))
        return y

    def bwd(dy: torch.Tensor | None) -> torch.Tensor | None:
        x, y = pending.popleft()
        torch.autograd.backward(y, None if last else dy)
        return None if x is None else x.grad

    warm = min(stages - s - 1, n_micro)
    steady = n_micro - warm
    for i in range(warm):
        y = fwd(i, comm(None, None, prev))
        comm(nxt, y, None)
    x = comm(None, None, prev) if steady else None
    for j in range(steady):
        y = fwd(warm + j, x)
        dy = comm(nxt, None if last else y, nxt)  # send this activation, get an earlier one's gradient
        dx = bwd(dy)
        x = comm(prev, dx, None if j == steady - 1 else prev)
    for _ in range(warm):
        dx = bwd(comm(None, None, nxt))
        comm(prev, dx, None)
