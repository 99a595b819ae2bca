"""What ``meshtrain plan`` prints and writes: a ranked table, JSON, and a PNG of each layout's step
time broken into compute, exposed communication per dimension and bubble."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from ..files import atomic_path
from .step import Prediction

CHART_FORMATS = (".png", ".svg", ".pdf")
"""What ``--chart`` writes (matplotlib picks the format by the suffix)."""
PARTS = ("compute", "tp", "cp", "pp", "ep", "dp", "bubble", "optimizer", "pcie", "sync")
GiB = 2**30


def header(preds: list[Prediction], context: dict) -> str:
    """One comment line above the table: what was asked, and the memory rule "fits" applies (the
    margin, and the bytes a rank's peak may reach)."""
    cap = preds[0].capacity / GiB if preds else float("nan")
    m = context["memory_margin"]
    what = "--search: the fastest layouts that fit" if context.get("search") else "--layout: fastest first"
    return (f"# {what}; {context['model']} on {context['gpus']} x {context['cluster']}, global batch "
            f"{context['global_batch']} x seq {context['seq']}; fits: peak <= {1 - m:.0%} of the {cap:.1f} GiB a "
            f"rank may use = {cap * (1 - m):.1f} GiB (--memory-margin {m:g})")


def table(preds: list[Prediction]) -> str:
    """A ranked text table: layout, step time and its parts (seconds), memory per rank (device, and
    host with CPU offload), MFU."""
    host = any(p.memory.host for p in preds)
    w = max([52] + [len(p.layout.label()) for p in preds])
    head = (f"{'#':>2}  {'layout':<{w}} {'step s':>8} " + " ".join(f"{p:>8}" for p in PARTS)
            + f" {'GiB/rank':>9}" + (f" {'host GiB':>9}" if host else "")
            + f" {'fits':>4} {'tok/s/gpu':>10} {'MFU':>6}")
    rows = [head, "-" * len(head)]
    for i, p in enumerate(preds, 1):
        rows.append(f"{i:>2}  {p.layout.label():<{w}} {p.step_time:>8.3f} "
                    + " ".join(f"{p.parts[k]:>8.3f}" for k in PARTS)
                    + f" {p.memory.total / GiB:>9.1f}" + (f" {p.memory.host / GiB:>9.1f}" if host else "")
                    + f" {'yes' if p.fits else 'NO':>4} "
                    f"{p.tokens_per_s_per_gpu:>10.0f} {p.mfu * 100:>5.1f}%")
    return "\n".join(rows)


def to_json(preds: list[Prediction], context: dict) -> str:
    """The predictions, fastest first, with the inputs they answer (``context``)."""
    return json.dumps({**context, "layouts": [p.as_dict() for p in preds]}, indent=1)


def chart(preds: list[Prediction], path: Path, title: str = "") -> Path:
    """A horizontal stacked bar per layout: step time split into its parts; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training hosts
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.5 * len(preds) + 1.5))
    labels = [p.layout.label() for p in preds][::-1]
    left = [0.0] * len(preds)
    for part in PARTS:
        widths = [p.parts[part] for p in preds][::-1]
        ax.barh(labels, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds per step")
    ax.set_title(title or "predicted step time")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the bars, not over them
    ax.tick_params(axis="y", labelsize="x-small")
    fig.tight_layout()
    # a temporary file renamed into place: a failed write leaves no partial chart
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=100, format=path.suffix[1:])  # the temporary name has no format suffix
    except OSError as e:
        raise ConfigError(f"--chart {path}: cannot write it ({e}); give a writable path") from e
    finally:
        plt.close(fig)
    return path
