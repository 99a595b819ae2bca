"""Context parallelism: ring attention on load-balanced shares against full causal attention
in plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtrain import comm
from meshtrain.errors import ConfigError
from meshtrain.parallel.context import (cp_positions, cp_shard, cp_unshard, ring_attention, ring_plan)

B, S, D = 2, 16, 8


def _inputs(hq: int, hkv: int, seed: int = 0, s: int = S):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hq, s, D, generator=g)
    k = torch.randn(B, hkv, s, D, generator=g)
    v = torch.randn(B, hkv, s, D, generator=g)
    dout = torch.randn(B, hq, s, D, generator=g)
    return q, k, v, dout


def _full_attention(q, k, v, dout):
    """Plain causal SDPA over the full sequence (GQA by repeat_interleave); output and grads."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_causal_attention_and_grads(cp, hq, hkv):
    q, k, v, dout = _inputs(hq, hkv)
    want = _full_attention(q, k, v, dout)

    def fn(rank):
        g = comm.current().world
        ql, kl, vl = (cp_shard(t, g, dim=2).clone().requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, g)
        out.backward(cp_shard(dout, g, dim=2))
        # a second call reuses the same tags: messages must still pair up in order
        again = ring_attention(ql.detach(), kl.detach(), vl.detach(), g)
        return out.detach(), ql.grad, kl.grad, vl.grad, again

    results = comm.run_local(cp, fn, timeout=60)
    for rank, (out, dq, dk, dv, again) in enumerate(results):
        chunks = [t.chunk(2 * cp, dim=2) for t in want]
        share = [torch.cat([c[rank], c[2 * cp - 1 - rank]], dim=2) for c in chunks]
        torch.testing.assert_close(out, share[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again, out, atol=0, rtol=0)
        torch.testing.assert_close(dq, share[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dk, share[2], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dv, share[3], atol=1e-5, rtol=1e-5)


def test_bf16_inputs_return_bf16_close_to_fp32_reference():
    q, k, v, dout = _inputs(4, 2, seed=1)
    want = _full_attention(q, k, v, dout)[0]

    def fn(rank):
        g = comm.current().world
        ql, kl, vl = (cp_shard(t, g, dim=2).bfloat16().requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, g)
        out.backward(cp_shard(dout, g, dim=2).bfloat16())
        return out.detach(), ql.grad.dtype, kl.grad.dtype

    res = comm.run_local(2, fn, timeout=60)
    for out, dq_dtype, dk_dtype in res:
        assert out.dtype == dq_dtype == dk_dtype == torch.bfloat16
    got = torch.cat([r[0] for r in res], dim=2)
    # undo the load-balanced layout by hand: rank order is chunks 0, 3, 1, 2
    c = got.chunk(4, dim=2)
    torch.testing.assert_close(torch.cat([c[0], c[2], c[3], c[1]], dim=2).float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("cp", [2, 4])
def test_shard_unshard_round_trip_and_positions(cp):
    x = torch.randn(3, 24, 5)

    def fn(rank):
        g = comm.current().world
        share = cp_shard(x, g, dim=1)
        pos = cp_positions(24, g)
        back = cp_unshard(share, g, dim=1)
        # differentiable: the gradient of the full result comes back as this rank's share
        y = share.clone().requires_grad_()
        (cp_unshard(y, g, dim=1) * torch.arange(24.0)[None, :, None]).sum().backward()
        return share, pos, back, y.grad

    for rank, (share, pos, back, grad) in enumerate(comm.run_local(cp, fn, timeout=60)):
        c = 24 // (2 * cp)
        want_pos = torch.cat([torch.arange(rank * c, (rank + 1) * c),
                              torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
        assert share.shape == (3, 2 * c, 5)
        assert pos.dtype == torch.int64
        torch.testing.assert_close(pos, want_pos)
        torch.testing.assert_close(share, x[:, want_pos])
        torch.testing.assert_close(back, x)
        torch.testing.assert_close(grad, want_pos.float()[None, :, None].expand(3, -1, 5))
        # positions are the shard of arange: the same rule applied to token indices
        assert torch.equal(pos, want_pos)


def test_positions_equal_shard_of_arange_and_cover_the_sequence():
    def fn(rank):
        g = comm.current().world
        return cp_positions(32, g), cp_shard(torch.arange(32)[None], g, dim=1)[0]

    res = comm.run_local(4, fn, timeout=60)
    for pos, shard in res:
        assert torch.equal(pos, shard)
    assert sorted(torch.cat([p for p, _ in res]).tolist()) == list(range(32))


def test_not_divisible_sequence_raises_config_error_with_the_fix():
    def fn(rank):
        g = comm.current().world
        errs = []
        for call in (lambda: cp_shard(torch.zeros(1, 10, 2), g), lambda: cp_positions(10, g),
                     lambda: ring_attention(*(torch.zeros(1, 2, 3, 4),) * 3, g)):
            with pytest.raises(ConfigError) as e:
                call()
            errs.append(str(e.value))
        return errs

    for errs in comm.run_local(4, fn, timeout=60):
        assert "10" in errs[0] and "cp=4" in errs[0] and "multiple of 8" in errs[0]
        assert "10" in errs[1] and "multiple of 8" in errs[1]
        assert "12" in errs[2] and "cp=4" in errs[2] and "multiple of 8" in errs[2]


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_cp1_is_plain_causal_sdpa(hq, hkv):
    q, k, v, dout = _inputs(hq, hkv, s=10)  # cp == 1: any length works
    want = _full_attention(q, k, v, dout)

    def fn(rank):
        g = comm.current().world
        assert cp_shard(q, g, dim=2) is q and torch.equal(cp_positions(10, g), torch.arange(10))
        assert cp_unshard(q, g, dim=2) is q
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, g)
        out.backward(dout)
        return out.detach(), ql.grad, kl.grad, vl.grad

    (got,) = comm.run_local(1, fn, timeout=60)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_rotary_with_global_positions_then_ring_attention_matches_full_model_attention():
    from meshtrain.models.llama import apply_rotary, rotary_table

    q, k, v, dout = _inputs(4, 2, seed=2)
    cos, sin = rotary_table(D, torch.arange(S), 10000.0)
    qf, kf = q.clone().requires_grad_(), k.clone().requires_grad_()
    rep = 2
    out_full = F.scaled_dot_product_attention(apply_rotary(qf, cos, sin),
                                              apply_rotary(kf, cos, sin).repeat_interleave(rep, 1),
                                              v.repeat_interleave(rep, 1), is_causal=True)
    out_full.backward(dout)

    def fn(rank):
        g = comm.current().world
        ql, kl = (cp_shard(t, g, dim=2).clone().requires_grad_() for t in (q, k))
        c, s = rotary_table(D, cp_positions(S, g), 10000.0)
        out = ring_attention(apply_rotary(ql, c, s), apply_rotary(kl, c, s), cp_shard(v, g, dim=2), g)
        out.backward(cp_shard(dout, g, dim=2))
        # local positions (0..s_local) instead of global ones must give a different answer
        c0, s0 = rotary_table(D, torch.arange(S // 2), 10000.0)
        wrong = ring_attention(apply_rotary(ql, c0, s0), apply_rotary(kl, c0, s0), cp_shard(v, g, dim=2), g)
        return (out.detach(), ql.grad, kl.grad, cp_unshard(out.detach(), g, dim=2), wrong.detach())

    for rank, (out, dq, dk, full, wrong) in enumerate(comm.run_local(2, fn, timeout=60)):
        sh = [torch.cat([t.chunk(4, dim=2)[rank], t.chunk(4, dim=2)[3 - rank]], dim=2)
              for t in (out_full.detach(), qf.grad, kf.grad)]
        torch.testing.assert_close(out, sh[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dq, sh[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dk, sh[2], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(full, out_full.detach(), atol=1e-5, rtol=1e-5)
        assert (wrong - out).abs().max() > 1e-3


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_ring_plan_is_balanced_and_covers_every_causal_chunk_pair(cp):
    seen = set()
    works = []
    for rank in range(cp):
        work = 0
        mine = (rank, 2 * cp - 1 - rank)
        for step, blocks in enumerate(ring_plan(rank, cp)):
            src = (rank - step) % cp
            keys = (src, 2 * cp - 1 - src)
            for blk in blocks:
                work += (blk.q_stop - blk.q_start) * blk.k_stop
                for qc in mine[blk.q_start:blk.q_stop]:
                    for kc in keys[:blk.k_stop]:
                        if kc <= qc:
                            seen.add((qc, kc))
                        else:  # only the diagonal block may hold a masked pair, and it is masked
                            assert blk.causal
        works.append(work)
    assert works == [2 * cp + 1] * cp  # the point of the layout: every rank does the same work
    assert seen == {(qc, kc) for qc in range(2 * cp) for kc in range(qc + 1)}
