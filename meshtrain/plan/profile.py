"""Measured compute for ``this-host``: time one meshtrain block, and the output head, at the shapes
one rank runs, instead of a roofline.

On a CPU the roofline misses most of a small model's time: the framework's per-op overhead (a few
microseconds for each aten op: the 4-block test model runs 369 in its forward, 642 in its backward),
broadcasting element-wise kernels well below the streaming bandwidth, and an unfused attention.
Operator profiling is how vTrain and Alpa price compute; the planner does it in isolation (no
training step is timed): one ``Block`` on the rank's micro-batch (layouts with tp, cp or ZeRO-3
time meshtrain's parallel block instead: ``profile_parallel``), the output head with its loss
(vocabulary split over tp), and an AdamW step over the rank's tensors, each with the intra-op
threads the launcher would give that rank. The pipeline schedule and the data-parallel
collectives stay analytic.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from functools import lru_cache
from typing import Any, Callable, Iterator

from .architectures import Arch
from .corun import together

MAX_PROFILED_FLOPS = 5e9
"""A block forward above this many FLOPs is priced by the roofline (profiling it would take seconds)."""
MAX_PROFILED_ELEMENTS = 50_000_000
"""An optimizer over more elements than this is priced by memory bandwidth (its tensors would take GBs)."""


def threads_per_rank(world: int) -> int:
    """Intra-op threads meshtrain's launcher gives each of ``world`` ranks on this host (``share_cores``)."""
    return max(1, (os.cpu_count() or 1) // max(world, 1))


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block, and restored after it."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def wall_scaled(fwd: list[float], bwd: list[float], wall: float) -> tuple[float, float]:
    """The median forward and backward seconds, scaled so that their sum is ``wall``, the loop's wall
    time per repetition: the medians split forward from backward, and the time slices a rank waits
    while others hold the cores are counted, as a run pays them."""
    f, b = statistics.median(fwd), statistics.median(bwd)
    scale = wall / max(f + b, 1e-12)
    return f * scale, b * scale


def _median_times(forward: Callable[[], Any], budget: float = 0.4, most: int = 60) -> tuple[float, float]:
    """Seconds of ``forward()``, which returns (output, gradient or None), and of the output's
    backward: the two medians, scaled so that their sum is the loop's wall time per repetition."""
    def run() -> tuple[float, float]:
        t0 = time.perf_counter()
        out, grad = forward()
        t1 = time.perf_counter()
        out.backward(grad)
        return t1 - t0, time.perf_counter() - t1

    warm = time.perf_counter()
    for _ in range(20):  # warm-up: the allocator, kernel selection, the thread pool's first wake-ups
        run()
        if time.perf_counter() - warm > budget / 4:
            break
    fwd: list[float] = []
    bwd: list[float] = []
    start = time.perf_counter()
    while len(fwd) < most and (len(fwd) < 5 or time.perf_counter() - start < budget):
        f, b = run()
        fwd.append(f)
        bwd.append(b)
    return wall_scaled(fwd, bwd, (time.perf_counter() - start) / len(fwd))


def profileable(arch: Arch, tp: int, tokens: int) -> bool:
    """True if a rank's block is a dense meshtrain Llama block small enough to time quickly (MoE,
    MLA and wide-head blocks take the roofline: the profiler builds dense blocks)."""
    dense_llama = arch.gated_mlp and not arch.is_moe and arch.mla is None and arch.q_dim == arch.dim
    return dense_llama and 2.0 * arch.matmul_params_per_layer() / tp * tokens <= MAX_PROFILED_FLOPS


def _measured(fn: Callable[..., Any], copies: int, *args: Any) -> Any:
    """The median of ``fn(*args)`` over ``copies`` processes running it at once (``corun``). One copy
    runs in a process of its own too: the timed loop's time is mostly Python, and in the caller's
    process its threads (a launcher's, a test runner's leftovers) and the collector's passes over a
    large heap would count in it (the suite's 1-rank check once read 3-4x slow in-process)."""
    results = together(max(copies, 1), fn, *args)
    if isinstance(results[0], tuple):
        return tuple(statistics.median(r[i] for r in results) for i in range(len(results[0])))
    return statistics.median(results)


@lru_cache(maxsize=512)
def block_seconds(arch: Arch, batch: int, seq: int, threads: int, copies: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of one whole block on ``batch`` x ``seq`` tokens (tp > 1 goes to
    ``profile_parallel``), measured with ``threads`` intra-op threads while ``copies`` ranks do the same."""
    return _measured(_block, copies, arch, batch, seq, threads)


@lru_cache(maxsize=512)
def head_seconds(arch: Arch, tp: int, tokens: int, threads: int, copies: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of the final norm, the output head (vocabulary split ``tp`` ways)
    and the cross-entropy loss on ``tokens`` tokens, measured as ``block_seconds`` is."""
    return _measured(_head, copies, arch, tp, tokens, threads)


@lru_cache(maxsize=512)
def optimizer_seconds(sizes: tuple[int, ...], threads: int, copies: int = 1) -> float:
    """Seconds of one ``torch.optim.AdamW`` step (its CPU default: a loop over the tensors) over fp32
    tensors of ``sizes`` elements with gradients, measured as ``block_seconds`` is."""
    return _measured(_optimizer, copies, sizes, threads)


def _block(arch: Arch, batch: int, seq: int, threads: int) -> tuple[float, float]:
    import torch

    from ..models.llama import Block, LlamaConfig, rotary_table

    cfg = LlamaConfig(vocab_size=arch.vocab_size, dim=arch.dim, n_layers=1, n_heads=arch.n_heads,
                      n_kv_heads=arch.n_kv_heads, ffn_dim=arch.ffn_dim, max_seq_len=seq)
    with intra_op_threads(threads):
        block = Block(cfg)
        cos, sin = rotary_table(cfg.head_dim, torch.arange(seq), cfg.rope_theta)
        x = torch.randn(batch, seq, arch.dim, requires_grad=True)
        grad = torch.randn(batch, seq, arch.dim)
        return _median_times(lambda: (block(x, cos, sin), grad))


def _head(arch: Arch, tp: int, tokens: int, threads: int) -> tuple[float, float]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    from ..models.llama import RMSNorm

    vocab = max(1, arch.vocab_size // tp)
    with intra_op_threads(threads):
        norm, head = RMSNorm(arch.dim, 1e-5), nn.Linear(arch.dim, vocab, bias=False)
        x = torch.randn(tokens, arch.dim, requires_grad=True)
        target = torch.randint(0, vocab, (tokens,))
        return _median_times(lambda: (F.cross_entropy(head(norm(x)).float(), target), None))


def stage_tensor_sizes(arch: Arch, tp: int, layers: int, shard: int, zero_stage: int) -> tuple[int, ...]:
    """Elements of each tensor the rank's optimizer steps: a stage's weights split over tp, one per
    weight without ZeRO; under ZeRO one flat shard (1/shard) per block and one for the rest."""
    kv, hd = arch.n_kv_heads * arch.head_dim, arch.head_dim
    q = arch.n_heads * hd
    block = [arch.dim, arch.dim, arch.dim * q // tp, arch.dim * kv // tp, arch.dim * kv // tp, q * arch.dim // tp,
             *[arch.dim * arch.ffn_dim // tp] * 3]
    rest = [arch.vocab_size * arch.dim // tp, arch.dim, arch.vocab_size * arch.dim // tp]  # embedding, norm, head
    if zero_stage == 0:
        return tuple(block * layers + rest)
    shards = [max(1, sum(block) // shard)] * layers + [max(1, sum(rest) // shard)]
    return tuple(shards)


def _optimizer(sizes: tuple[int, ...], threads: int) -> float:
    import torch

    with intra_op_threads(threads):
        params = [torch.zeros(n, requires_grad=True) for n in sizes]
        for p in params:
            p.grad = torch.randn(p.numel())
        opt = torch.optim.AdamW(params, lr=1e-4)
        opt.step()
        steps = 0
        start = time.perf_counter()
        while steps < 5 or (steps < 60 and time.perf_counter() - start < 0.4):
            opt.step()
            steps += 1
        return (time.perf_counter() - start) / steps  # wall time: time slices count, as in _median_times
