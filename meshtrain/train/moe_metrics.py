"""A mixture-of-experts run's routing metrics: per layer, how evenly the experts were loaded.

Each step's record (``metrics.jsonl``, TensorBoard) gets, for every MoE layer in model order
(``moe_layers`` holds their indices): the tokens the busiest and the idlest expert took
(``moe_tokens_max`` / ``moe_tokens_min``), the coefficient of variation of the tokens per expert
(``moe_tokens_cv``: 0 is perfectly even), the assignments capacity dropped, the auxiliary loss,
and the raw tokens per expert (``moe_tokens``). ``plot_load_balance`` draws ``load_balance.png``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..files import atomic_path
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
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")  # the temporary name has no .png to go by
    plt.close(fig)


COLLAPSE_SHARE = 0.1
"""An expert is starved while its tokens are below this fraction of an even share (1 / n_experts)."""
COLLAPSE_STEPS = 10
"""Steps in a row an expert must be starved before ``CollapseWatch`` warns."""


class CollapseWatch:
    """Rank 0's watch for routing collapse: once some expert of some MoE layer has taken less than
    ``share`` of an even share of the tokens for ``steps`` steps in a row, one warning line naming
    each such layer and its experts (then silence: ``load_balance.png`` shows the rest)."""

    def __init__(self, share: float = COLLAPSE_SHARE, steps: int = COLLAPSE_STEPS) -> None:
        self.share, self.steps = share, steps
        self.starved: dict[tuple[int, int], int] = {}
        """(layer, expert) -> steps in a row it has been starved."""
        self.warned = False

    def update(self, record: dict[str, Any]) -> str | None:
        """Feed one step's record (``moe_record``'s keys); the warning line, the first time only."""
        if self.warned or "moe_tokens" not in record:
            return None
        for layer, counts in zip(record["moe_layers"], record["moe_tokens"]):
            even = sum(counts) / max(len(counts), 1)
            for expert, c in enumerate(counts):
                key = (layer, expert)
                self.starved[key] = self.starved.get(key, 0) + 1 if c < self.share * even else 0
        worst: dict[int, list[int]] = {}
        for (layer, expert), n in sorted(self.starved.items()):
            if n >= self.steps:
                worst.setdefault(layer, []).append(expert)
        if not worst:
            return None
        self.warned = True
        n_experts = len(record["moe_tokens"][0])
        layers = "; ".join(f"layer {layer}: expert{'s' if len(e) > 1 else ''} {', '.join(map(str, e))} of {n_experts}"
                           for layer, e in worst.items())
        return (f"# moe: routing collapse at step {record['step']}: {layers} took under {self.share:.0%} of an even "
                f"share of the tokens for {self.steps} steps in a row; balance the router (model.bias_update_rate, "
                f"e.g. 0.001, or model.aux_loss_coef, e.g. 0.01) and see load_balance.png")
