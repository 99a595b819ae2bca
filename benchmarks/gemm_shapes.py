"""One block's GEMMs at the per-rank shapes of Megatron-LM's H100 model table, timed on this GPU beside
the rate the planner prices them at (issue 34: the table's 1.7B runs 34 % slower than priced, its
7.1B 15 %, while its large models come within 10 %; docs/plan.md, "What the misses are").

For each model (micro-batch 1 of 4,096 tokens; with sequence parallelism every GEMM of a tp rank sees
all 4,096), the forward GEMMs of a GPT block on one tp rank: QKV (d -> 3d/tp), the attention's output
projection (d/tp -> d), fc1 (d -> 4d/tp), fc2 (4d/tp -> d), and the head (d -> V/tp); each also as its
backward's two GEMMs (input gradient and weight gradient). Prints per model the measured seconds of
the block's forward and backward GEMMs and the planner's (``compute.layer_forward_parts``' matmul part,
``dense_gemm_factors`` for the backward), and their ratio: a ratio that grows as the model shrinks
says the narrow-GEMM law (``gemm_k0``) misses what the small rows lose.

    python benchmarks/gemm_shapes.py [REPEATS]          (default 20; CUDA, bf16)
    python benchmarks/gemm_shapes.py 2 --tiny           (a CPU smoke run at toy sizes)
"""

from __future__ import annotations

import json
import sys
import time

import torch

TOKENS = 4096
MODELS = {"megatron-2024-gpt-1.7b": 1, "megatron-2024-gpt-7.1b": 2, "megatron-2024-gpt-16b": 4,
          "megatron-2024-gpt-32b": 8, "megatron-2024-gpt-70b": 8, "gpt-175b": 8, "megatron-2024-gpt-462b": 8}
"""Model: its tp in the table."""


def block_gemms(arch, tp: int, scale: int = 1) -> dict[str, tuple[int, int]]:
    """(K, N) of each forward GEMM of one tp rank of ``arch`` (widths divided by ``scale`` for a smoke
    run): reduction width K, output width N."""
    d, qkv, o, ffn = (w // scale for w in (arch.dim, arch.q_dim + 2 * arch.kv_dim, arch.o_dim, arch.ffn_dim))
    return {"qkv": (d, qkv // tp), "proj": (o // tp, d), "fc1": (d, ffn // tp), "fc2": (ffn // tp, d),
            "head": (d, arch.vocab_size // scale // tp)}


def _time(fn, repeats: int, cuda: bool) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls (after two warm-up calls)."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(tokens: int, k: int, n: int, repeats: int, device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(forward, backward) seconds of a [tokens x k] @ [k x n] GEMM: forward, then input gradient
    ([tokens x n] @ [n x k]) plus weight gradient ([k x tokens] @ [tokens x n])."""
    x, w, g = (torch.randn(tokens, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype),
               torch.randn(tokens, n, device=device, dtype=dtype))
    cuda = device == "cuda"
    fwd = _time(lambda: x @ w, repeats, cuda)
    wt, xt = w.t().contiguous(), x.t().contiguous()
    bwd = _time(lambda: (g @ wt, xt @ g), repeats, cuda)
    return fwd, bwd


def predicted(name: str, tp: int) -> tuple[float, float] | None:
    """The planner's (forward, backward) seconds of the block's weight GEMMs (without the head) on one
    tp rank, on the preset of this GPU; None off a known GPU."""
    if not torch.cuda.is_available():
        return None
    from meshtrain.plan.architectures import ARCHS
    from meshtrain.plan.clusters import PRESETS
    from meshtrain.plan.compute import dense_gemm_factors, layer_forward_parts
    from meshtrain.plan.layout import Layout

    gpu = torch.cuda.get_device_name().lower()
    cluster = PRESETS["h200" if "h200" in gpu else "h100"]
    arch, layout = ARCHS[name], Layout(dp=1, tp=tp, attn_kernel="cudnn", compile=True)
    mm = layer_forward_parts(arch, layout, cluster, TOKENS, TOKENS)[0]
    fwd, bwd = dense_gemm_factors(arch, layout, cluster, TOKENS)
    return mm, 2 * mm * bwd / fwd


def main(argv: list[str]) -> int:
    tiny = "--tiny" in argv
    args = [a for a in argv if not a.startswith("--")]
    repeats = int(args[0]) if args else 20
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    from meshtrain.plan.architectures import ARCHS

    models = dict(list(MODELS.items())[:2]) if tiny else MODELS
    for name, tp in models.items():
        arch = ARCHS[name]
        tokens = 256 if tiny else TOKENS
        shapes = block_gemms(arch, tp, 16 if tiny else 1)
        row: dict = {"model": name, "tp": tp, "tokens": tokens}
        block_f = block_b = 0.0
        for gemm, (k, n) in shapes.items():
            f, b = measure(tokens, k, n, repeats, device, dtype)
            flops = 2.0 * tokens * k * n
            row[gemm] = {"k": k, "n": n, "forward_tflops": flops / f / 1e12, "backward_tflops": 2 * flops / b / 1e12}
            if gemm != "head":
                block_f, block_b = block_f + f, block_b + b
        row.update(block_forward_s=block_f, block_backward_s=block_b)
        pred = None if tiny else predicted(name, tp)
        if pred:
            row.update(predicted_forward_s=pred[0], predicted_backward_s=pred[1],
                       ratio=(block_f + block_b) / (pred[0] + pred[1]))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
