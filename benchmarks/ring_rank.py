"""One context-parallel rank's ring attention on one GPU, at CP 1, 2, 4, 8 (issue 34's T2 rows).

torchtitan's 8B at 32K-256K tokens (8 GPUs, 32K tokens a rank) runs 25-31 % slower at CP 4 and 8
than the planner prices it, and about as priced at CP 1 and 2 (docs/plan.md, "What the misses
are"). Every CP degree makes the same kernel calls, only more of them. This script times those
calls for one rank, as PyTorch's ``_templated_ring_attention`` makes them with the all-gather
rotation and load balancing: a causal call on the rank's two 16K chunks, then per other rank a
non-causal call of the whole query against half the keys or half the query against all of them,
merged in fp32 (``_SDPAMerger``); backward, the flash backward of every call with the final output
and log-sum-exp, accumulated in fp32. K and V are as wide as the queries (torchtitan repeats the
kv heads, ``kvrep=1``). It prints the measured seconds per layer beside the planner's attention
kernel time for the same rank (``compute.attention_rate``) on the preset of this GPU: if the
measured ratio grows with CP, the kernels explain the rows; if it stays flat, the cause is elsewhere.

    python benchmarks/ring_rank.py [CPS] [REPEATS]      (default 1,2,4,8 and 3; CUDA, bf16)
    python benchmarks/ring_rank.py 1,2 1 --tiny         (a CPU smoke run at a toy size)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

HEADS, HEAD_DIM, LOCAL = 32, 128, 32768
"""Llama 3 8B's 32 query heads of 128 (K/V repeated to all 32) and 32K tokens a rank."""


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple:
    """(out, lse, what the backward needs) of one flash-attention call."""
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return r[0], r[1], r
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, None


def _flash_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, saved: tuple | None, causal: bool) -> tuple:
    if q.is_cuda:
        _, _, cq, ck, mq, mk, seed, offset, _ = saved
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, causal)


def _calls(cp: int, rank: int) -> list[tuple[str, bool]]:
    """This rank's calls, step by step: ("all", causal) on its own chunks, then "half_kv" (the whole
    query against the first chunk of an earlier rank's K/V) or "half_q" (the second query chunk
    against a later rank's K/V), as PyTorch's load-balanced ring makes them."""
    return [("all", True)] + [("half_kv" if i <= rank else "half_q", False) for i in range(1, cp)]


def rank_layer(cp: int, local: int, device: str, dtype: torch.dtype, heads: int = HEADS,
               head_dim: int = HEAD_DIM) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's ring attention on the middle rank of ``cp``."""
    rank, c = cp // 2, local // 2
    shape = (1, heads, local, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    calls = _calls(cp, rank)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    sync()
    t0 = time.perf_counter()
    out = torch.zeros(shape, device=device, dtype=torch.float32)
    lse = torch.full((1, heads, local, 1), -float("inf"), device=device, dtype=torch.float32)
    kept = []
    for kind, causal in calls:
        qq, kk, vv = (q[:, :, c:], k, v) if kind == "half_q" else \
            (q, k[:, :, :c], v[:, :, :c]) if kind == "half_kv" else (q, k, v)
        o, l, saved = _flash(qq, kk, vv, causal)
        kept.append((qq, kk, vv, saved, causal, kind))
        view = slice(c, None) if kind == "half_q" else slice(None)
        o32, l32 = o.float(), l.float().unsqueeze(-1)
        acc, acc_lse = out[:, :, view], lse[:, :, view]
        acc.sub_(torch.sigmoid(l32 - acc_lse) * (acc - o32))  # _SDPAMerger's update, in place
        acc_lse.sub_(torch.nn.functional.logsigmoid(acc_lse - l32))
    final, final_lse = out.to(dtype), lse.squeeze(-1)
    sync()
    forward = time.perf_counter() - t0

    grad = torch.randn_like(final)
    sync()
    t0 = time.perf_counter()
    dq, dk, dv = (torch.zeros(shape, device=device, dtype=torch.float32) for _ in range(3))
    for qq, kk, vv, saved, causal, kind in kept:
        view = slice(c, None) if kind == "half_q" else slice(None)
        g, o, l = grad[:, :, view], final[:, :, view], final_lse[:, :, view].contiguous()
        a, b, d = _flash_backward(g, qq, kk, vv, o, l, saved, causal)
        dq[:, :, view] += a
        kv = slice(None, c) if kind == "half_kv" else slice(None)
        dk[:, :, kv] += b  # the rotating accumulators: one rank's dK, dV per step
        dv[:, :, kv] += d
    sync()
    return forward, time.perf_counter() - t0


def predicted(cp: int, local: int) -> tuple[float, float] | None:
    """The planner's attention kernel (forward, backward) seconds for this rank and layer, on the preset
    of this GPU (h100 / h200 at 700 W); None off a known GPU."""
    if not torch.cuda.is_available():
        return None
    from meshtrain.plan.architectures import ARCHS
    from meshtrain.plan.clusters import PRESETS
    from meshtrain.plan.compute import attention_backward_ratio, layer_forward_parts
    from meshtrain.plan.layout import Layout

    name = torch.cuda.get_device_name().lower()
    cluster = PRESETS["h200" if "h200" in name else "h100"]
    layout = Layout(dp=8 // cp, cp=cp, zero_stage=3, ac="full", kv_repeat=True, cp_allgather=cp > 1)
    seq = local * cp
    attn = layer_forward_parts(ARCHS["llama3-8b"], layout, cluster, local, seq)[1]
    return attn, attn * attention_backward_ratio(cluster, layout, seq)


def main(argv: list[str]) -> int:
    tiny = "--tiny" in argv
    args = [a for a in argv if not a.startswith("--")]
    cps = [int(x) for x in (args[0] if args else "1,2,4,8").split(",")]
    repeats = int(args[1]) if len(args) > 1 else 3
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    local, shape = (256, (2, 16)) if tiny else (LOCAL, (HEADS, HEAD_DIM))
    rank_layer(cps[0], local, device, dtype, *shape)  # warm-up: kernels, allocator
    rows = []
    for cp in cps:
        times = [rank_layer(cp, local, device, dtype, *shape) for _ in range(repeats)]
        f, b = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
        row = {"cp": cp, "seq": local * cp, "forward_s": f, "backward_s": b}
        pred = None if tiny else predicted(cp, local)
        if pred:
            row.update(predicted_forward_s=pred[0], predicted_backward_s=pred[1],
                       ratio=(f + b) / (pred[0] + pred[1]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if len(rows) > 1:
        base = rows[0]
        for r in rows[1:]:
            grow = (r["forward_s"] + r["backward_s"]) / (base["forward_s"] + base["backward_s"])
            print(f"# cp={r['cp']}: {grow:.2f}x cp={base['cp']}'s time for {r['cp'] / base['cp']:.0f}x its calls' work")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
