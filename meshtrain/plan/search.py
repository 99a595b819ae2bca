"""``--search``: enumerate the layouts that fill the GPUs, predict each, rank the ones that fit.

For each (tp, cp, pp, dp) that divides the GPUs (tp inside a node and splitting the heads, cp
dividing the sequence, pp at most the layers, dp dividing the batch), a few micro-batch counts,
the pipeline schedules, every ZeRO stage and, with ZeRO, HSDP replica counts whose shard groups
span 1, 2 or 4 nodes are tried, and for a mixture-of-experts model every expert-parallel degree ep
the layout allows (a multiple of cp dividing dp_shard x cp and the number of experts); activation
checkpointing is the least recomputation that fits (none, selective, full: each saves memory at
more compute; torchtitan's "op" only when asked), unless the caller fixed it. Settings the caller
fixes (precision, ac, zero stage, schedule, ep, CPU offload) are kept; with offload, only the ZeRO
stages it runs on (1-3, or 3 for "params"), even on one rank.

Every candidate goes through ``layout.validate``, the rules a ``--layout`` gets (what meshtrain train
refuses, and pipeline splits Megatron refuses unless ``uneven`` is fixed): those it refuses are left
out. A layout fits if its predicted peak is at most (1 - ``memory_margin``) of a rank's memory.

What it varies it prices: cp through ring attention's exchange, merge passes and the attention
kernel's length curve (``step._context_parallel``, ``compute.ring_merge_bytes``), ep through the
all-to-alls, offload through the PCIe and CPU update, ZeRO across nodes on every NIC. Async TP
(``async_tp`` fixed True: the runtime has it, ``--async-tp``) is priced on every tp > 1 candidate
(it hides part of the forward's collectives and costs no memory, so it is never slower); meshtrain's
own runtime has none, so ``--parallel.auto`` never sets it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

from ..errors import ConfigError
from .architectures import Arch
from .clusters import Cluster
from .layout import AC_MODES, Layout, check_sizes, ep_choices, fewest_even_chunks, tp_splits
from .step import DEFAULT_MEMORY_MARGIN, Prediction, check_memory_margin, predict


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _microbatch_choices(local: int, pp: int, interleaved: bool) -> list[int]:
    """Up to three micro-batch counts for ``local`` sequences per dp rank: the most (smallest
    bubble), and the fewest and a middle one that a schedule on ``pp`` stages accepts."""
    if pp == 1:
        return sorted({1, local})
    # one micro-batch per sequence has the smallest bubble; more than 8 per stage otherwise buys
    # under 1/9 of the bubble back and the simulator's work grows with m
    valid = [m for m in _divisors(local) if m >= pp and (not interleaved or m % pp == 0)]
    if not valid:
        return []
    capped = [m for m in valid if m <= 8 * pp] or valid[:1]
    return sorted({capped[0], capped[len(capped) // 2], capped[-1], valid[-1]})


def _virtual_choices(layers: int, pp: int) -> list[int]:
    """Model chunks per pipeline rank worth pricing: 2 and 4, and ``fewest_even_chunks`` (what Megatron
    needs: 92 layers on 4 stages allow only v = 23), so a published interleaved layout is a candidate."""
    even = fewest_even_chunks(layers, pp)
    return sorted({v for v in (2, 4, even) if v is not None and pp * v <= layers})


def _replicas(dp: int, others: int, per_node: int) -> list[int]:
    """HSDP replica counts worth pricing: none (1), and those whose ZeRO shard groups span 1, 2 or 4
    nodes (with the other dimensions): gathers stay on the fast links, replicas all-reduce across."""
    spans = {per_node, 2 * per_node, 4 * per_node}
    return [1] + [r for r in range(2, dp + 1) if dp % r == 0 and dp // r * others in spans]


def candidates(arch: Arch, cluster: Cluster, gpus: int, global_batch: int, seq: int,
               fixed: dict) -> Iterator[Layout]:
    """Every layout the search prices (activation checkpointing left to ``search``)."""
    base = Layout(**{k: v for k, v in fixed.items() if k != "ac"})
    for tp in _divisors(gpus):
        if cluster.gpus_per_node % tp or not tp_splits(arch, tp):
            continue
        for cp in (c for c in _divisors(gpus // tp) if c <= 16 and seq % c == 0):
            for pp in (p for p in _divisors(gpus // tp // cp) if p <= min(arch.n_layers, 64)):
                dp = gpus // (tp * cp * pp)
                if global_batch % dp:
                    continue
                schedules = ["1f1b", "interleaved"] if pp > 1 else ["1f1b"]
                if "schedule" in fixed and pp > 1:
                    schedules = [fixed["schedule"]]
                for sched in schedules:
                    vs = _virtual_choices(arch.n_layers, pp) if sched == "interleaved" else [1]
                    for v in vs:
                        for m in _microbatch_choices(global_batch // dp, pp, sched == "interleaved"):
                            zeros = [fixed["zero_stage"]] if "zero_stage" in fixed else \
                                ([0, 1, 2, 3] if dp * cp > 1 or base.offload != "none" else [0])
                            if base.offload != "none":  # offload needs ZeRO ("params": ZeRO-3)
                                zeros = [z for z in zeros if z >= (3 if base.offload == "params" else 1)]
                            for z in zeros:
                                for rep in _replicas(dp, tp * pp * cp, cluster.gpus_per_node) if z else [1]:
                                    atp = base.async_tp and tp > 1 and base.sequence_parallel
                                    layout = replace(base, dp=dp, tp=tp, pp=pp, cp=cp, microbatches=m, virtual=v,
                                                     schedule=sched, zero_stage=z, dp_replicate=rep, ep=1,
                                                     async_tp=atp, async_tp_backward=base.async_tp_backward and atp,
                                                     p2p_overlap=base.p2p_overlap and sched == "interleaved")
                                    eps = [fixed["ep"]] if "ep" in fixed else ep_choices(arch, layout)
                                    for ep in eps:
                                        yield replace(layout, ep=ep)


def check_top(top: object) -> None:
    """ConfigError naming ``--top`` unless it is a whole number >= 1."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ConfigError(f"--top {top!r}: must be a whole number >= 1 (layouts to show); use e.g. --top 10")


def search(arch: Arch, cluster: Cluster, gpus: int, global_batch: int, seq: int, fixed: dict | None = None,
           top: int = 10, memory_margin: float = DEFAULT_MEMORY_MARGIN) -> list[Prediction]:
    """The ``top`` fastest layouts that fit with ``memory_margin`` of each rank's memory left free,
    fastest first. Candidates that ``layout.validate`` refuses (the rules ``--layout`` gets: what
    meshtrain train and Megatron refuse) are left out. ConfigError (with the smallest peak memory
    seen and the GPUs that would need) if none fits."""
    check_sizes(gpus, global_batch, seq)
    memory_margin = check_memory_margin(memory_margin)
    check_top(top)
    fixed = dict(fixed or {})
    # "op" is torchtitan's selective op checkpointing, which meshtrain train does not offer: only
    # priced when asked for (to compare with torchtitan's runs)
    acs = [fixed["ac"]] if "ac" in fixed else [a for a in AC_MODES if a != "op"]
    found: list[Prediction] = []
    smallest: Prediction | None = None
    refused: str | None = None  # the first candidate's reason, should none be priced
    for layout in candidates(arch, cluster, gpus, global_batch, seq, fixed):
        for ac in acs:
            try:
                pred = replace(predict(arch, cluster, replace(layout, ac=ac), global_batch, seq),
                               memory_margin=memory_margin)
            except ConfigError as e:
                refused = refused or f"{replace(layout, ac=ac).label()}: {e}"
                break
            if smallest is None or pred.memory.total < smallest.memory.total:
                smallest = pred
            if pred.fits:
                found.append(pred)
                break
    if not found:
        if smallest is None:
            why = f" (e.g. {refused})" if refused else ""
            raise ConfigError(f"no layout of {gpus} GPUs runs {arch.name} with --global-batch {global_batch} "
                              f"--seq {seq}{why}; use a global batch that is a multiple of {gpus}")
        need = smallest.memory.total / smallest.memory_limit
        raise ConfigError(f"{arch.name} fits no layout of {gpus} GPUs on {cluster.name}: the smallest peak is "
                          f"{smallest.memory.total / 2**30:.1f} GiB per rank ({smallest.layout.label()}) of "
                          f"{smallest.memory_limit / 2**30:.1f} GiB ({smallest.capacity / 2**30:.1f} GiB less the "
                          f"{memory_margin:.0%} --memory-margin); try --gpus "
                          f"{gpus * max(2, 2 ** int(need).bit_length())} or a smaller --global-batch")
    found.sort(key=lambda p: p.step_time)
    return found[:top]
