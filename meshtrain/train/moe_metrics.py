"""A mixture-of-experts run's routing metrics: per layer, how evenly the experts were loaded.

Each step's record (``metrics.jsonl``, TensorBoard) gets, for every MoE layer in model order
(``moe_layers`` holds their indices): the tokens the busiest and the idlest expert took
(``moe_tokens_max`` / ``moe_tokens_min``), the coefficient of variation of the tokens per expert
(``moe_tokens_cv``: 0 is perfectly even), the assignments capacity dropped, the auxiliary loss,
and the raw tokens per expert (``moe_tokens``). ``plot_load_balance`` draws ``load_balance.png``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..models.moe import MoEStats


def moe_record(stats: MoEStats) -> dict[str, Any]:
    """The metrics of one step's statistics (the same on every rank)."""
    counts = stats.counts.double().cpu()
    mean = counts.mean(1)
    cv = counts.std(1, unbiased=False) / mean.clamp(min=1e-12)
    return {
        "moe_layers": stats.layers,
        "moe_tokens_min": counts.min(1).values.tolist(),
        "moe_tokens_max": counts.max(1).values.tolist(),
        "moe_tokens_cv": cv.tolist(),
        "moe_dropped": stats.dropped.double().cpu().tolist(),
        "moe_aux_loss": float(stats.aux.double().sum()),
        "moe_tokens": counts.tolist(),
    }


def tensorboard_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The per-layer metrics of a record as TensorBoard tags (``moe_tokens_cv/layer3``)."""
    out: dict[str, float] = {}
    for key in ("moe_tokens_min", "moe_tokens_max", "moe_tokens_cv", "moe_dropped"):
        for layer, v in zip(record.get("moe_layers", []), record.get(key, [])):
            out[f"{key}/layer{layer}"] = float(v)
    return out


def plot_load_balance(history: list[dict[str, Any]], path: Path) -> None:
    """``load_balance.png``: each MoE layer's coefficient of variation of tokens per expert over
    the steps, and the last step's tokens per expert as a heat map (layers x experts)."""
    rows = [r for r in history if "moe_tokens" in r]
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, hm) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    for i, layer in enumerate(rows[-1]["moe_layers"]):
        ax.plot(steps, [r["moe_tokens_cv"][i] for r in rows], lw=1.1, label=f"layer {layer}")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens per expert: std / mean")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    im = hm.imshow(rows[-1]["moe_tokens"], aspect="auto", cmap="viridis")
    hm.set_xlabel("expert")
    hm.set_ylabel("MoE layer")
    hm.set_yticks(range(len(rows[-1]["moe_layers"])), [str(x) for x in rows[-1]["moe_layers"]])
    hm.set_title(f"tokens per expert, step {steps[-1]}", fontsize=9)
    fig.colorbar(im, ax=hm)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
