"""nccl-tests-style tables, JSON records and busbw plots for collective benchmarks."""

from __future__ import annotations

import os
from typing import Any, Iterable

from ..files import write_json_atomic

# nccl-tests' bus-bandwidth factors: busbw = algbw * factor(n)
BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}

_TYPE_NAMES = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16",
               "int32": "int32", "int64": "int64"}


def parse_size(text: str) -> int:
    """'64M' -> 67108864; accepts B, K, M, G suffixes (powers of 1024)."""
    t = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def parse_sizes(spec: str, factor: int = 4) -> list[int]:
    """'1K:64M' -> geometric sizes from 1K to 64M by ``factor``; '1K,1M' -> exactly those."""
    if ":" in spec:
        lo, hi = (parse_size(s) for s in spec.split(":", 1))
        if lo <= 0 or hi < lo or factor < 2:
            raise ValueError(f"bad size range {spec!r}: need 0 < lo <= hi and --factor >= 2")
        out, n = [], lo
        while n <= hi:
            out.append(n)
            n *= factor
        return out
    return [parse_size(s) for s in spec.split(",") if s.strip()]


def header(title: str) -> str:
    """The two nccl-tests header lines under a '# title' line."""
    return "\n".join([
        f"# {title}",
        "#       size         count      type   redop    root     time   algbw   busbw #wrong",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       ",
    ])


def row(rec: dict[str, Any]) -> str:
    """One nccl-tests table row from a record."""
    return (f"{rec['size']:>12d}  {rec['count']:>12d}  {_TYPE_NAMES.get(rec['dtype'], rec['dtype']):>8s}"
            f"  {rec['redop']:>6s}  {rec['root']:>6d}  {rec['time_us']:>7.1f}  {rec['algbw']:>6.2f}"
            f"  {rec['busbw']:>6.2f}  {rec['wrong']:>5d}")


def write_json(records: Iterable[dict[str, Any]], path: str, extra: dict[str, Any] | None = None) -> None:
    """Write records (and run facts) as JSON, atomically."""
    write_json_atomic(path, {"records": list(records), **(extra or {})})


def plot_busbw(records: list[dict[str, Any]], path: str, title: str, memcpy_gbps: float | None = None) -> None:
    """PNG of busbw against size, one line per (transport, algorithm, world size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    lines: dict[tuple, list] = {}
    for r in records:
        lines.setdefault((r["transport"], r["algorithm"], r["world_size"], r["op"]), []).append(r)
    for (tr, algo, world, op), rs in sorted(lines.items()):
        rs = sorted(rs, key=lambda r: r["size"])
        ax.plot([r["size"] for r in rs], [r["busbw"] for r in rs], marker="o", label=f"{tr} {algo} (p={world})")
    if memcpy_gbps:
        ax.axhline(memcpy_gbps, color="gray", linestyle="--", label=f"1-core memcpy {memcpy_gbps:.1f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    save_figure(fig, [ax], path)


def save_figure(fig: Any, axes: list[Any], path: str) -> None:
    """Grid and legend on every axis, then write ``fig`` to ``path`` as a PNG and close it."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
