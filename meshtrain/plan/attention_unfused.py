"""The unfused attention of Megatron-LM before FlashAttention (``attn=unfused``): the scores materialised.

Megatron's ``ParallelAttention`` (``megatron/model/transformer.py``, e.g. at commit 50a4b5fa02, April
2021, the code behind its README's 1.7B-1T table) runs, per head and sequence of s tokens:
``torch.baddbmm`` (Q K^T, written into an s x s score tensor), its fused causal scale-mask-softmax
(``scaled_upper_triang_masked_softmax``, fp16/bf16 up to 2,048 keys), the attention dropout (its
default 0.1) and ``torch.bmm`` (probabilities x V). Unlike FlashAttention it computes every score, the
masked half included, and moves each score tensor through memory several times: at s = 2,048 and
head dim 96 that traffic takes longer than the two GEMMs' FLOPs.

Each kernel is priced on its own roofline, max(FLOPs at the matmul rate, bytes at the memory rate).
Bytes per score element, activation bytes a, counted from the code and its kernels:

* forward: Q K^T writes a; the causal softmax reads the lower triangle (a/2 on average: elements past
  the diagonal are never loaded) and writes the whole row, zeros included (a); dropout (torch's
  ``_fused_dropout``) reads a, writes a and a one-byte mask; probabilities x V reads a;
* backward: dP = dO V^T writes a; dV = P^T dO reads the dropped probabilities (a); the dropout's
  backward (``_masked_scale``) reads a and the mask, writes a; the softmax backward reads the gradient
  and the saved output over the lower triangle (a) and writes the whole row (a); dQ = dS K and
  dK = dS^T Q each read dS (a).

Kept for backward per score element (``saved_bytes_per_element``): the softmax output (a), the
dropout mask (1) and the dropped probabilities (a), Korthikanti et al.'s 5as/h term at a = 2 (arXiv
2205.05198). Megatron falls back to torch's unfused softmax beyond 2,048 keys (more passes): not priced.
"""

from __future__ import annotations

from .architectures import Arch
from .clusters import Cluster
from .layout import Layout

FORWARD_KERNELS = ((1, 1.0, 0), (0, 1.5, 0), (0, 2.0, 1), (1, 1.0, 0))
"""(GEMMs, x, y) of the forward's kernels, Q K^T, softmax, dropout, P V: each moves x·a + y bytes per
score element."""
BACKWARD_KERNELS = ((1, 1.0, 0), (1, 1.0, 0), (0, 2.0, 1), (0, 2.0, 0), (1, 1.0, 0), (1, 1.0, 0))
"""... of the backward's: dP, dV, dropout, softmax, dQ, dK."""


def score_elements(arch: Arch, layout: Layout, tokens: float, seq: int) -> float:
    """Score elements one rank materialises per block for ``tokens`` tokens of sequences of ``seq``:
    its n_heads / tp heads, each query against all ``seq`` keys (the masked half too)."""
    return arch.n_heads / layout.tp * seq * tokens


def unfused_attention_seconds(arch: Arch, layout: Layout, cluster: Cluster, tokens: float, seq: int,
                              act_bytes: int) -> tuple[float, float]:
    """(forward, backward) seconds of one block's unfused attention on ``tokens`` tokens: each kernel
    of ``FORWARD_KERNELS`` / ``BACKWARD_KERNELS`` at its roofline (a GEMM's FLOPs, 2 x head dim per
    score element, at ``matmul_efficiency`` of peak; bytes at the rank's memory rate)."""
    elements = score_elements(arch, layout, tokens, seq)
    head_dim = (arch.q_dim + arch.o_dim) / 2 / arch.n_heads  # Q K^T reduces over q's, P V writes o's
    flop_rate = cluster.per_rank_peak(layout.world, layout.precision) * cluster.matmul_efficiency
    byte_rate = cluster.per_rank_bandwidth(layout.world)

    def seconds(kernels: tuple[tuple[int, float, int], ...]) -> float:
        return sum(max(gemms * 2.0 * head_dim * elements / flop_rate, (x * act_bytes + y) * elements / byte_rate)
                   for gemms, x, y in kernels)

    return seconds(FORWARD_KERNELS), seconds(BACKWARD_KERNELS)


def saved_bytes_per_element(act_bytes: int) -> float:
    """Bytes a block keeps for backward per score element: softmax output, dropout mask, dropped
    probabilities."""
    return 2.0 * act_bytes + 1.0
