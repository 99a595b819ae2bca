"""What a run reports: per-step JSON lines (``MetricsLogger``, read back by ``read_rows`` and
``read_steps``), TensorBoard events, a progress bar or a ``step_line`` every few steps, and the loss
plot. The figures behind MFU live elsewhere: the FLOPs per token in ``models.flops``, the device's
peak and the process's peak memory in ``meshtrain.hardware``; the run's check of the planner in
``plan.run_check``."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

from ..files import atomic_path
from .moe_metrics import tensorboard_scalars


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (steps and events), in order; [] if there is none yet. A line
    that does not parse is skipped: one a killed rank 0 left half-written, or one being written now."""
    rows = []
    with contextlib.suppress(FileNotFoundError):
        for line in Path(path).read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def read_steps(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The step rows of a ``metrics.jsonl``, each step once, by step. A resumed run's rows carry its
    ``segment`` (1, 2, ...): where a segment's rows begin, at step S, the earlier rows of steps S
    and later are dropped (steps the run no longer contains, though the new segment may stop short
    of them); of a step's rows in one segment the last counts (rows without ``segment``: the last).
    ``read_rows`` keeps them all, in order."""
    steps: dict[int, dict[str, Any]] = {}
    segment = None
    for row in read_rows(path):
        if "event" in row or not isinstance(row.get("step"), int):
            continue
        if row.get("segment") is not None and row["segment"] != segment:
            if segment is not None:
                steps = {s: r for s, r in steps.items() if s < row["step"]}
            segment = row["segment"]
        steps[row["step"]] = row
    return [steps[s] for s in sorted(steps)]


def line_every(total_steps: int, log_every: int = 1, print_every: int = 0) -> int:
    """Steps between the ``step_line``s of a run without a progress bar: ``train.print_every``
    (0: about 20 a run), rounded up to a multiple of ``log_every`` (the steps that are logged)."""
    k = print_every or max(1, total_steps // 20)
    return -(-k // log_every) * log_every


def step_line(record: dict[str, Any], total_steps: int) -> str:
    """One step as a line for a log without a progress bar (a cluster job's): ``# step S/N: ...``."""
    eta = record["step_s"] * (total_steps - record["step"])
    return (f"# step {record['step']}/{total_steps}: loss {record['loss']:.4f}, lr {record['lr']:.3g}, "
            f"{record['tokens_per_s']:.0f} tokens/s, MFU {100 * record['mfu']:.1f}%, {record['step_s']:.3f} s/step, "
            f"ETA {eta:.0f} s")


class MetricsLogger:
    """Rank 0's record of a run: ``metrics.jsonl`` (one object per step), TensorBoard events
    beside it, and a tqdm progress bar (step, loss, tokens/s, MFU, ETA); without the bar, a
    ``step_line`` every ``print_every`` steps (0: none), so a cluster's log shows progress."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, progress: bool = True,
                 print_every: int = 0) -> None:
        self.run_dir = run_dir
        self.total_steps, self.print_every = total_steps, print_every
        self.file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.history: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        """Rows that are not steps (``{"event": "world_change", ...}``), kept out of ``history``."""
        try:
            from torch.utils.tensorboard import SummaryWriter

            # a resume from an earlier step than the last logged: TensorBoard hides the replaced steps'
            # events (those from start_step + 1 on), as metrics.read_steps keeps each step's latest row
            self.tb: Any = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        except ImportError:  # tensorboard is a dependency; a broken install should not stop training
            self.tb = None
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        """Write one step's record everywhere."""
        self.history.append(record)
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            scalars.update(tensorboard_scalars(record))  # a mixture of experts' per-layer balance
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, record["step"])
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                 mfu=f"{100 * record['mfu']:.1f}%", refresh=False)
            self.bar.update(1)
        elif self.print_every and (record["step"] % self.print_every == 0 or record["step"] == self.total_steps):
            print(step_line(record, self.total_steps), flush=True)

    def event(self, row: dict[str, Any]) -> None:
        """Write a row that is not a step (it has an ``event`` key) to ``metrics.jsonl`` only."""
        self.events.append(row)
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        """Flush and close the files and the bar."""
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.file.close()


def plot_loss(history: list[dict[str, Any]], path: Path, marks: Sequence[int] = ()) -> None:
    """``loss.png``: loss against step (written to a temp file, then renamed), with a dashed vertical
    line at each step of ``marks`` (world changes: the steps a run resumed from under a new layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], lw=1.2)
    for step in marks:
        ax.axvline(step, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")  # the temporary name has no .png to go by
    plt.close(fig)
