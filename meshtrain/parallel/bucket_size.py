"""``bucket_cap_mb = "auto"``: the gradient bucket size of DataParallel and ZeRO-1/2 from the cost model.

A bucket's reduction costs a fixed latency (α per message, several messages per collective) plus a
time per byte. Small buckets pay the latency many times over; large ones leave little to overlap
with backward (the last bucket can only start when backward ends). ``auto_bucket_bytes`` takes the
smallest size at which the latency is at most 5 % of the bucket's transfer time, then caps it so
that the gradients still make several buckets; ``resolve_bucket_cap`` fetches the group's fitted
model (``comm.select.calibrate``) and the time of one near-empty call (``call_latency``) and applies
them at a wrapper's construction; ``split_by_bytes`` cuts ZeRO-1/2's parameters into units of that size.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

from ..config.parallel import check_bucket_cap
from ..comm import select
from ..comm.select import CostModel
from ..comm.transport.base import capabilities

if TYPE_CHECKING:
    from ..comm import Group

MiB = 1 << 20
ALPHA_SHARE = 0.05
"""The largest share of a bucket's transfer time its latency may take."""
MIN_BUCKETS = 4
"""The fewest buckets the gradients should make: the reductions of all but the last overlap backward."""
# Below 1 MiB the costs per bucket outside the link's α (the post-accumulate hook, the hand-off to
# the reduce thread, the collective's metadata check: tens of µs in Python each) dominate; torch DDP's
# first bucket is 1 MiB for the same reason. Above 256 MiB every link measured here is deep in its
# bandwidth regime, and a bucket is one allocation (on the CPU a shared-memory segment every peer maps).
MIN_BYTES, MAX_BYTES = 1 * MiB, 256 * MiB


def size_text(nbytes: float) -> str:
    """Bytes as the log shows them: "12.0 MiB", or "14.2 KiB" below 0.1 MiB."""
    return f"{nbytes / MiB:.1f} MiB" if nbytes >= MiB / 10 else f"{nbytes / 1024:.1f} KiB"


def auto_bucket_bytes(model: CostModel, grad_bytes: int, p: int, op: str = "all_reduce", *,
                      call_s: float = 0.0, share: float = ALPHA_SHARE, min_buckets: int = MIN_BUCKETS,
                      lo: int | None = None, hi: int | None = None) -> tuple[int, str]:
    """The bucket size in bytes for ``grad_bytes`` of gradients reduced by ``op`` ("all_reduce":
    DataParallel; "reduce_scatter": ZeRO-1/2) over ``p`` ranks, and a one-line reason.

    The cost of a bucket of n bytes is ``model.predict(op, "ring", n, p)``: a latency L (its value at
    n = 0: 2(p-1)·α for the all-reduce, (p-1)·α for the reduce-scatter) plus a transfer time T(n)
    linear in n (2(p-1)/p·n·β + (p-1)/p·n·γ for the all-reduce). The size is the smallest n with
    L <= ``share``·T(n), where L is at least ``call_s``, the measured time of a near-empty call
    (``call_latency``): a bucket pays the whole call, Python and the metadata check included, and
    the ping-pong behind α sees none of that (on two busy cores 1.2 ms a call against α = 27 µs:
    docs/benchmarks.md, session 20).

    The ring is priced whatever ``algorithm="auto"`` will run: auto's pick depends on the size
    being decided and on the transport (the shm collectives, gloo's and NCCL's own are not priced
    by the model), while every bandwidth-optimal all-reduce moves the ring's bytes, and of those the
    ring has the largest latency term, so its n errs large (halving-doubling's 2·log2(p)·α would
    allow smaller buckets).

    That size is then capped at ``grad_bytes / min_buckets`` so that several buckets' reductions
    overlap backward, and clamped to [``lo``, ``hi``] (default ``MIN_BYTES`` and ``MAX_BYTES``, read
    at the call). Pure: no communication.
    """
    lo = MIN_BYTES if lo is None else lo
    hi = MAX_BYTES if hi is None else hi
    if p <= 1:
        n = min(max(grad_bytes, lo), hi)
        return n, f"{p} rank: nothing to reduce, one bucket of {size_text(n)}"
    ring = model.predict(op, "ring", 0, p)
    latency = max(ring, call_s)
    per_byte = (model.predict(op, "ring", MiB, p) - ring) / MiB
    alpha_n = math.ceil(latency / (share * per_byte))
    overlap_n = grad_bytes // max(min_buckets, 1)
    n = min(max(min(alpha_n, overlap_n), lo), hi)
    call = f", a call {call_s * 1e6:.0f}us measured" if call_s else ""
    link = (f"alpha {model.alpha * 1e6:.0f}us, beta {1 / model.beta / 1e9:.2f} GB/s, {model.source}{call}; "
            f"ring {op} over {p} ranks")
    pct = f"{share * 100:g}%"
    alpha = "latency" if call_s > ring else "alpha"
    if alpha_n <= overlap_n and lo <= alpha_n <= hi:
        why = f"{alpha} = {pct} of a bucket's transfer at {size_text(alpha_n)}"
    elif alpha_n > overlap_n and lo <= overlap_n <= hi:
        why = (f"{alpha} would be {pct} of a bucket's transfer at {size_text(alpha_n)}; capped at "
               f"{size_text(grad_bytes)} of gradients / {min_buckets} so that backward overlaps")
    elif n == lo:
        why = (f"{size_text(min(alpha_n, overlap_n))} raised to the {size_text(lo)} floor "
               f"({alpha} = {pct} at {size_text(alpha_n)}, {size_text(grad_bytes)} of gradients)")
    else:
        why = (f"{alpha} = {pct} of a bucket's transfer at {size_text(alpha_n)}; lowered to the "
               f"{size_text(hi)} ceiling")
    return n, f"{link}: {why}"


def measures(group: Group) -> bool:
    """Whether "auto" measures ``group``'s link (``select.calibrate``, ``call_latency``): on process
    transports with two or more members. Ranks as threads keep their transport's defaults (a
    ping-pong between threads measures the GIL, not a link); so does NCCL (the ping-pong moves host
    tensors, which NCCL cannot). The same answer on every member: it reads no measurement."""
    t = group.comm.transport
    return not capabilities(t).ranks_are_threads and group.size >= 2 and "nccl" not in str(getattr(t, "backend", ""))


def call_latency(group: Group, op: str = "all_reduce", reps: int = 5) -> float:
    """Seconds one near-empty ``op`` takes on ``group`` through ``meshtrain.comm``: the slowest
    member's median of ``reps`` timed calls after two untimed ones (which also line the ranks up),
    the same value on every member. Collective."""
    import statistics
    import time

    import torch

    from .. import comm

    src, out = torch.zeros(group.size), torch.zeros(1)

    def once() -> None:
        if op == "reduce_scatter":
            comm.reduce_scatter_tensor(out, src, group=group)
        else:
            comm.all_reduce(out, group=group)

    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        once()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
    comm.all_reduce(worst, op="max", group=group)
    return float(worst)


def resolve_bucket_cap(bucket_cap_mb: float | str, group: Group, grad_bytes: int,
                       op: str = "all_reduce") -> tuple[int, str | None]:
    """``bucket_cap_mb`` (a positive number of MiB or "auto") in bytes for the gradients of ``group``,
    and for "auto" the reason (``auto_bucket_bytes``), else None. Raises ``ConfigError`` (a
    ``ValueError``) naming the argument for anything else. "auto" is collective where it ``measures``:
    every member must call it at the same point (a wrapper's constructor, which broadcasts anyway)."""
    check_bucket_cap(bucket_cap_mb)
    if bucket_cap_mb != "auto":
        return max(int(float(bucket_cap_mb) * MiB), 1), None
    t = group.comm.transport
    if not measures(group):
        model = group.cost_model or select.default_model(t.kind)
        n, why = auto_bucket_bytes(model, grad_bytes, group.size, op)
        return n, f"{why} (not measured on {t.kind})"
    model = group.cost_model if group.cost_model is not None else select.calibrate(group)  # cached on disk
    n, why = auto_bucket_bytes(model, grad_bytes, group.size, op, call_s=call_latency(group, op))
    return n, why


def split_by_bytes(named: list[tuple[str, Any]], cap_bytes: int, elem_bytes: int) -> list[list[tuple[str, Any]]]:
    """``named`` (name, parameter) cut into runs of consecutive parameters of at most ``cap_bytes``
    at ``elem_bytes`` per element (a larger parameter is a run of its own), filled from the end, the
    order in which backward produces gradients, so that the first run holds the remainder; each
    run and the runs in the given order."""
    runs: list[list[tuple[str, Any]]] = []
    cur: list[tuple[str, Any]] = []
    size = 0
    for item in reversed(named):
        nbytes = item[1].numel() * elem_bytes
        if cur and size + nbytes > cap_bytes:
            runs.append(cur[::-1])
            cur, size = [], 0
        cur.append(item)
        size += nbytes
    if cur:
        runs.append(cur[::-1])
    return runs[::-1]


def log_auto(who: str, cap_bytes: int, why: str, buckets: int, grad_bytes: int) -> None:
    """Print the chosen size once per run: on the world's rank 0, to stderr as the trainer's notes."""
    from .. import comm

    if comm.is_initialized() and comm.get_rank() != 0:
        return
    print(f"# {who} bucket_cap_mb auto: {size_text(cap_bytes)} ({why}; {buckets} buckets for "
          f"{size_text(grad_bytes)} of gradients)", file=sys.stderr, flush=True)


__all__ = ["ALPHA_SHARE", "MAX_BYTES", "MIN_BUCKETS", "MIN_BYTES", "auto_bucket_bytes", "call_latency",
           "log_auto", "measures", "resolve_bucket_cap", "size_text", "split_by_bytes"]
