"""Context parallelism: ring attention over a load-balanced split of the sequence.

The sequence is cut into ``2*cp`` equal chunks and rank ``i`` of the cp group keeps chunks ``i`` and
``2*cp-1-i``: under a causal mask an early chunk attends to little and a late one to a lot, so
pairing them gives every rank the same amount of attention work. ``ring_attention`` then passes
the K/V shares around the ring (``cp`` steps); each step attends this rank's queries to one other
rank's keys, skipping chunk pairs that the causal mask removes entirely, and merges the partial
results exactly through their log-sum-exp (online softmax, fp32). Backward rotates K/V again and
carries the accumulated dK/dV with them until they arrive back at their owner (flash-attention
style: block probabilities are recomputed from the saved LSE, nothing of size s*s is kept).

What each rank computes is data: ``ring_plan(rank, cp)`` lists, per ring step, the blocks of chunk
pairs it attends; the autograd function only executes that plan.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .. import comm
from ..comm import Group, Work
from ..errors import ConfigError
from .tensor_comm import _all_gather

# p2p tags of the ring: one per tensor and direction so forward and backward messages never cross
TAG_FWD_K, TAG_FWD_V, TAG_BWD_K, TAG_BWD_V, TAG_BWD_DK, TAG_BWD_DV = range(0xC700, 0xC706)


# ----------------------------------------------------------------------------------- layout

def _check_divisible(seq_len: int, cp: int, what: str) -> None:
    if seq_len % (2 * cp):
        good = (seq_len // (2 * cp) + 1) * 2 * cp
        raise ConfigError(
            f"context parallel: {what} {seq_len} is not divisible by 2*cp = {2 * cp} (cp={cp}); "
            f"use a sequence length that is a multiple of {2 * cp} (e.g. {good}), or a cp that "
            f"divides it in 2*cp chunks"
        )


def _member(group: Group) -> int:
    if group.rank < 0:
        raise ValueError(f"this rank is not in the cp group {group.ranks}")
    return group.rank


def _chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two sequence chunks (out of 2*cp) that ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def _positions(rank: int, cp: int, chunk: int, device: Any = None) -> torch.Tensor:
    a, b = _chunks_of(rank, cp)
    return torch.cat([torch.arange(a * chunk, (a + 1) * chunk, device=device),
                      torch.arange(b * chunk, (b + 1) * chunk, device=device)])


def cp_shard(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced share of a full sequence: ``dim`` is cut into ``2*cp`` equal chunks
    and rank ``i`` keeps chunks ``i`` and ``2*cp-1-i`` (concatenated in that order). cp == 1 returns
    ``x``. Differentiable locally: the gradient reaching ``x`` is nonzero at this rank's share only.
    Raises ConfigError when ``x.shape[dim]`` is not a multiple of ``2*cp``."""
    cp = group.size
    if cp == 1:
        return x
    rank = _member(group)
    _check_divisible(x.shape[dim], cp, f"sequence length (dim {dim} of shape {tuple(x.shape)})")
    c = x.shape[dim] // (2 * cp)
    a, b = _chunks_of(rank, cp)
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim=dim)


def _reorder_gathered(x: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Rank-ordered shares [0a, 0b, 1a, 1b, ...] -> chunks in sequence order."""
    parts = x.chunk(2 * cp, dim=dim)
    seq: list[torch.Tensor] = [parts[0]] * (2 * cp)
    for r in range(cp):
        a, b = _chunks_of(r, cp)
        seq[a], seq[b] = parts[2 * r], parts[2 * r + 1]
    return torch.cat(seq, dim=dim)


class GatherFromCP(torch.autograd.Function):
    """Forward: all-gather every rank's load-balanced share and restore sequence order. Backward:
    keep this rank's share of the gradient (like ``ScatterToTP``), which is right when what follows
    is computed identically on every cp rank (a replicated loss)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reorder_gathered(_all_gather(x, dim, group), group.size, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return cp_shard(g, ctx.group, ctx.dim).contiguous(), None, None


def cp_unshard(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Inverse of ``cp_shard``: all-gather every rank's share (collective over ``group``) and put the
    chunks back in sequence order. Differentiable through ``GatherFromCP``: backward keeps this
    rank's share of the gradient, which assumes the full result is used the same way on all ranks."""
    if group.size == 1:
        return x
    _member(group)
    if x.shape[dim] % 2:
        raise ConfigError(f"context parallel: a share has two equal chunks, but dim {dim} of shape "
                          f"{tuple(x.shape)} is odd; shard with cp_shard first")
    return GatherFromCP.apply(x, group, dim % x.dim())


def cp_positions(seq_len: int, group: Group, device: Any = None) -> torch.Tensor:
    """Global token positions (int64) of this rank's share of a ``seq_len`` sequence, in the same
    order as ``cp_shard`` (feed them to the rotary table so each token keeps its real position)."""
    cp = group.size
    if cp == 1:
        return torch.arange(seq_len, device=device)
    _check_divisible(seq_len, cp, "sequence length")
    return _positions(_member(group), cp, seq_len // (2 * cp), device)


# ------------------------------------------------------------------------------------- plan

class Block(NamedTuple):
    """Queries in local chunks ``[q_start, q_stop)`` attend to the first ``k_stop`` chunks of the
    visiting K/V share; ``causal``: the block holds a diagonal chunk pair and needs a mask."""

    q_start: int
    q_stop: int
    k_stop: int
    causal: bool


def _blocks(rank: int, src: int, cp: int) -> list[Block]:
    """The blocks of queries of ``rank`` against keys of ``src``. A key chunk is visible to a query
    chunk iff its index is <= the query's; a share's chunks ascend, so visible keys are a prefix."""
    keys = _chunks_of(src, cp)
    per_q = []
    for i, qc in enumerate(_chunks_of(rank, cp)):
        n = sum(kc <= qc for kc in keys)
        if n:
            per_q.append(Block(i, i + 1, n, qc in keys[:n]))
    # two query chunks that see the same unmasked keys become one larger matmul
    if len(per_q) == 2 and per_q[0].k_stop == per_q[1].k_stop and not (per_q[0].causal or per_q[1].causal):
        return [Block(0, 2, per_q[0].k_stop, False)]
    return per_q


def ring_plan(rank: int, cp: int) -> list[list[Block]]:
    """Per ring step ``t`` (K/V of group rank ``(rank - t) % cp`` visiting), the blocks ``rank``
    computes. Load-balanced: every rank's plan covers 2*cp+1 chunk-pair units of work (3 on the
    diagonal step, 2 on each other); a contiguous split would give rank i 4*i+3 (3 .. 4*cp-1)."""
    return [_blocks(rank, (rank - t) % cp, cp) for t in range(cp)]


# ------------------------------------------------------------------------------ ring kernel

def _ring_start(tensors: list[torch.Tensor], tags: list[int],
                group: Group) -> tuple[list[torch.Tensor], list[Work]]:
    """Send ``tensors`` to the next rank and post receives of the same shapes from the previous."""
    r, n = group.rank, group.size
    nxt, prv = group.ranks[(r + 1) % n], group.ranks[(r - 1) % n]
    works, bufs = [], []
    for t, tag in zip(tensors, tags):
        works.append(comm.isend(t, nxt, group=group, tag=tag))
        buf = torch.empty_like(t)
        works.append(comm.irecv(buf, prv, group=group, tag=tag))
        bufs.append(buf)
    return bufs, works


def _wait(works: list[Work]) -> None:
    for w in works:
        w.wait()


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """q: (b, hkv, g, sq, d), k: (b, hkv, sk, d) -> fp32 scores (b, hkv, g, sq, sk); GQA by broadcast."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _mask(blk: Block, pos_q: torch.Tensor, pos_k: torch.Tensor, c: int) -> torch.Tensor | None:
    if not blk.causal:
        return None
    return pos_q[blk.q_start * c:blk.q_stop * c, None] >= pos_k[None, :blk.k_stop * c]


class RingAttention(torch.autograd.Function):
    """Causal attention over the cp ring. Forward: K/V shares travel rank -> rank+1 for cp-1 steps
    (the next transfer overlaps the current block's compute); block outputs are merged with their
    LSE. Backward: K/V travel again, together with the dK/dV accumulated for them, which after cp
    steps are back at their owner; dQ stays local. Inputs are cast to fp32 for compute."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group) -> torch.Tensor:
        b, hq, s, d = q.shape
        hkv, cp, rank = k.shape[1], group.size, group.rank
        c, scale = s // 2, 1.0 / math.sqrt(d)
        k, v = k.contiguous(), v.contiguous()
        q5 = q.float().reshape(b, hkv, hq // hkv, s, d)
        out = torch.zeros_like(q5)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        pos_q = _positions(rank, cp, c, q.device)
        kc, vc = k, v
        for step, blocks in enumerate(ring_plan(rank, cp)):
            if step < cp - 1:  # start the next transfer before computing on the current share
                (kn, vn), works = _ring_start([kc, vc], [TAG_FWD_K, TAG_FWD_V], group)
            pos_k = _positions((rank - step) % cp, cp, c, q.device)
            kf, vf = kc.float(), vc.float()
            for blk in blocks:
                qs, ks = slice(blk.q_start * c, blk.q_stop * c), slice(0, blk.k_stop * c)
                sc = _scores(q5[..., qs, :], kf[..., ks, :], scale, _mask(blk, pos_q, pos_k, c))
                b_lse = torch.logsumexp(sc, dim=-1)
                b_out = torch.matmul(torch.exp(sc - b_lse.unsqueeze(-1)), vf[..., ks, :].unsqueeze(2))
                old = lse[..., qs]
                new = torch.logaddexp(old, b_lse)
                # exp(-inf - finite) = 0: a row seen for the first time takes the block's values
                out[..., qs, :] = (out[..., qs, :] * torch.exp(old - new).unsqueeze(-1)
                                   + b_out * torch.exp(b_lse - new).unsqueeze(-1))
                lse[..., qs] = new
            if step < cp - 1:
                _wait(works)
                kc, vc = kn, vn
        out = out.reshape(b, hq, s, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        b, hq, s, d = q.shape
        hkv, cp, rank = k.shape[1], group.size, group.rank
        g, c, scale = hq // hkv, s // 2, 1.0 / math.sqrt(d)
        q5 = q.float().reshape(b, hkv, g, s, d)
        do5 = dout.float().reshape(b, hkv, g, s, d)
        delta = (do5 * out.float().reshape(b, hkv, g, s, d)).sum(-1)  # rowsum(dO * O)
        dq = torch.zeros_like(q5)
        pos_q = _positions(rank, cp, c, q.device)
        prv = group.ranks[(rank - 1) % cp]
        kc, vc = k, v
        sends: list[Work] = []
        for step, blocks in enumerate(ring_plan(rank, cp)):
            if step < cp - 1:
                (kn, vn), kv_works = _ring_start([kc, vc], [TAG_BWD_K, TAG_BWD_V], group)
            if step > 0:  # the dK/dV that earlier ranks accumulated for the share now visiting
                dk_in = torch.empty(k.shape, dtype=torch.float32, device=k.device)
                dv_in = torch.empty(v.shape, dtype=torch.float32, device=v.device)
                d_works = [comm.irecv(dk_in, prv, group=group, tag=TAG_BWD_DK),
                           comm.irecv(dv_in, prv, group=group, tag=TAG_BWD_DV)]
            pos_k = _positions((rank - step) % cp, cp, c, q.device)
            kf, vf = kc.float(), vc.float()
            dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
            for blk in blocks:
                qs, ks = slice(blk.q_start * c, blk.q_stop * c), slice(0, blk.k_stop * c)
                qb, kb, vb = q5[..., qs, :], kf[..., ks, :], vf[..., ks, :]
                sc = _scores(qb, kb, scale, _mask(blk, pos_q, pos_k, c))
                p = torch.exp(sc - lse[..., qs].unsqueeze(-1))  # recomputed from the saved LSE
                dob = do5[..., qs, :]
                dv[..., ks, :] += torch.matmul(p.transpose(-1, -2), dob).sum(2)
                dp = torch.matmul(dob, vb.unsqueeze(2).transpose(-1, -2))
                ds = p * (dp - delta[..., qs].unsqueeze(-1)) * scale
                dq[..., qs, :] += torch.matmul(ds, kb.unsqueeze(2))
                dk[..., ks, :] += torch.matmul(ds.transpose(-1, -2), qb).sum(2)
            if step > 0:
                _wait(d_works)
                dk += dk_in
                dv += dv_in
            if cp > 1:  # pass the accumulators on; after the last step they reach their owner
                nxt = group.ranks[(rank + 1) % cp]
                sends += [comm.isend(dk, nxt, group=group, tag=TAG_BWD_DK),
                          comm.isend(dv, nxt, group=group, tag=TAG_BWD_DV)]
            if step < cp - 1:
                _wait(kv_works)
                kc, vc = kn, vn
        if cp > 1:
            dk, dv = torch.empty_like(dk), torch.empty_like(dv)
            _wait([comm.irecv(dk, prv, group=group, tag=TAG_BWD_DK),
                   comm.irecv(dv, prv, group=group, tag=TAG_BWD_DV)] + sends)
        return dq.reshape(b, hq, s, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] \
            or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: expected q (b, hq, s, d) and k, v (b, hkv, s, d) with hq a "
                         f"multiple of hkv; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % 2:
        raise ConfigError(
            f"context parallel: the full sequence length {q.shape[2] * cp} ({q.shape[2]} per rank x "
            f"cp={cp}) is not divisible by 2*cp = {2 * cp}; use a sequence length that is a multiple "
            f"of {2 * cp} and shard it with cp_shard")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group) -> torch.Tensor:
    """Causal attention over the cp ``group`` on load-balanced shares (see ``cp_shard``).

    q: (b, hq, s_local, d); k, v: (b, hkv, s_local, d) with hq % hkv == 0 (grouped-query: head h
    uses kv head h // (hq/hkv), like ``repeat_interleave``). Returns (b, hq, s_local, d) in q's
    dtype: this rank's share of causal ``scaled_dot_product_attention`` over the full sequence.
    Collective over ``group``: every rank calls it, in the same order. cp == 1 is plain causal SDPA.
    """
    cp = group.size
    _check_shapes(q, k, v, cp)
    if cp == 1:
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    _member(group)
    return _ring_attention(q, k, v, group)


@torch.compiler.disable  # a graph break under train.compile: dynamo does not trace the ring's messages
def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group) -> torch.Tensor:
    return RingAttention.apply(q, k, v, group)
