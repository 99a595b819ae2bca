"""What a run reports: per-step JSON lines, TensorBoard events, a progress bar, the loss plot and
the model-FLOPs utilisation (MFU) against the device's peak."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ..bench.report import write_json_atomic
from ..errors import MeshtrainError
from ..models.llama import LlamaConfig
from .moe_metrics import tensorboard_scalars

# dense bf16 peaks (FLOP/s) of GPUs people train on; CPUs are measured
GPU_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def flops_per_token(cfg: LlamaConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls with parameters (N without the input
    embedding, which is a lookup) plus 12·L·H·S for attention (PaLM's formula, H = model width,
    S = sequence length)."""
    return 6.0 * n_params + 12.0 * cfg.n_layers * cfg.dim * seq_len


def measure_cpu_peak(n: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of the best of several fp32 n×n matmuls with all of torch's threads (the best, so
    that a busy moment does not lower the peak and inflate MFU)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def _cpu_peak_cache() -> tuple[Path, str]:
    """Where the CPU peak is cached, and the key (cores, torch) a cached figure must have."""
    cache = Path(os.environ.get("MESHTRAIN_CACHE_DIR", Path.home() / ".cache" / "meshtrain")) / "cpu_peak.json"
    # the host's peak (every core), whatever this process's thread count: the launcher gives each
    # worker one thread, and the ranks of a host share its cores
    return cache, f"{os.cpu_count()}-{torch.__version__}"


def cached_cpu_peak() -> float:
    """The CPU peak FLOP/s ``device_peak`` cached for this host and torch; 0.0 if there is none."""
    cache, key = _cpu_peak_cache()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # no cache, or an unreadable one
        data = json.loads(cache.read_text())
        if data.get("key") == key:
            return float(data["flops"])
    return 0.0


def device_peak(device: torch.device, refresh: bool = True) -> float:
    """Peak FLOP/s of one device: a GPU's datasheet bf16 figure, or for the CPU a matmul
    microbenchmark cached in MESHTRAIN_CACHE_DIR or ~/.cache/meshtrain. The cache keeps the
    highest figure seen, because a measurement taken while the machine was busy reads low
    (and would inflate MFU). With ``refresh`` it measures again (about 0.3 s) and raises the
    cached figure if it can; without, a cached figure is used as it is (the workers: the launcher
    has just measured, and workers measuring at once would only compete for the cores)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK.items():
            if key in name:
                return peak
    cache, key = _cpu_peak_cache()
    cached = cached_cpu_peak()
    if cached and not refresh:
        return cached
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        flops = measure_cpu_peak()
    finally:
        torch.set_num_threads(threads)
    if flops <= cached:
        return cached
    with contextlib.suppress(OSError):  # a read-only home only costs a re-measurement next time
        write_json_atomic(str(cache), {"key": key, "flops": flops})
    return flops


def step_summary(records: list[dict[str, Any]]) -> dict[str, float]:
    """A run's measured step from its per-step records: the median and fastest ``step_s`` after the
    first two steps (warm-up: allocators and caches; the last record if there are no more) and the
    highest ``peak_mem_bytes``. ``meshtrain bench plan`` and the run's own planner check use it."""
    timed = records[2:] or records[-1:]
    return {"step_s": statistics.median(r["step_s"] for r in timed),
            # the fastest step: what the machine does when nothing else runs (the cores are shared)
            "best_step_s": min(r["step_s"] for r in timed),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records)}


PROFILE_AFTER_S = 100.0
"""``train.plan_check = "auto"``: a CPU run that trained this long has its blocks timed after it."""


def plan_check(config: Any, model_cfg: LlamaConfig, device: torch.device,
               records: list[dict[str, Any]], profiled: bool = False) -> dict[str, Any]:
    """The planner's prediction for this run's own layout beside what the run measured, for
    summary.json: ``predicted_step_s`` and ``predicted_peak_mem_bytes`` (null with
    ``prediction_reason`` when no prediction could be made: ``train.plan_check = "off"``, a GPU no
    preset prices, a layout the planner cannot price, no cached host calibration) and
    ``measured_step_s`` / ``measured_peak_mem_bytes`` (``step_summary``). It never raises: a
    finished run is not failed over its prediction. Nothing is measured for it (a CPU host's cached
    calibration) unless ``profiled`` (``profiled_plan_check``)."""
    got = step_summary(records)
    out: dict[str, Any] = {"predicted_step_s": None, "measured_step_s": got["step_s"],
                           "predicted_peak_mem_bytes": None, "measured_peak_mem_bytes": got["peak_mem_bytes"],
                           "prediction": None, "prediction_reason": None}
    if config.train.plan_check == "off":
        out["prediction_reason"] = "train.plan_check = 'off'"
        return out
    try:
        from ..plan.auto import predict_run

        pred, cluster = predict_run(config, model_cfg, device.type, profiled=profiled)
    except Exception as exc:  # noqa: BLE001 - any failure is the prediction's, never the run's
        out["prediction_reason"] = str(exc) if isinstance(exc, MeshtrainError) else f"{type(exc).__name__}: {exc}"
        return out
    out.update(predicted_step_s=pred.step_time, predicted_peak_mem_bytes=pred.memory.total,
               prediction={"cluster": cluster.name, "layout": pred.layout.label(),
                           "compute": "profiled" if cluster.profile_compute else "roofline",
                           "step_ratio": pred.step_time / got["step_s"] if got["step_s"] else None,
                           "mem_ratio": pred.memory.total / got["peak_mem_bytes"] if got["peak_mem_bytes"] else None})
    return out


def profiles_after(config: Any, summary: dict[str, Any]) -> bool:
    """True if ``meshtrain train`` times the finished run's blocks for its check (``train.plan_check``):
    "profiled", or "auto" for a CPU run that trained ``PROFILE_AFTER_S`` or longer. Only a completed
    CPU run of the layout its config gives (not one an elastic resize left on another world)."""
    from ..config.dims import degrees_of

    mode = config.train.plan_check
    return (summary.get("device") == "cpu" and summary.get("measured_step_s") is not None
            and summary.get("layout") == degrees_of(config.parallel)
            and (mode == "profiled" or (mode == "auto" and summary.get("seconds", 0.0) >= PROFILE_AFTER_S)))


def profiled_plan_check(config: Any, summary: dict[str, Any]) -> dict[str, Any]:
    """After every rank of a CPU run has ended (the cores free): the planner's prediction again, with
    the model's blocks timed at the run's shapes (``plan_check(profiled=True)``, as ``meshtrain bench
    plan`` prices), replacing the cached one in ``summary`` and its summary.json (rewritten
    atomically); the cached one is kept as ``prediction["cached"]``. A failure keeps the cached check,
    with the reason in ``prediction_profiled_reason``."""
    from .config import model_config

    records = [{"step_s": summary["measured_step_s"], "peak_mem_bytes": summary["measured_peak_mem_bytes"]}]
    started = time.perf_counter()
    check = plan_check(config, model_config(config, summary["vocab_size"]), torch.device("cpu"), records,
                       profiled=True)
    if check["predicted_step_s"] is None:
        summary["prediction_profiled_reason"] = check["prediction_reason"]
    else:
        cached = {k: summary.get(k) for k in ("predicted_step_s", "predicted_peak_mem_bytes", "prediction")}
        check["prediction"].update(cached=cached, profile_s=time.perf_counter() - started)
        summary.update({k: check[k] for k in ("predicted_step_s", "predicted_peak_mem_bytes", "prediction",
                                              "prediction_reason")})
    write_json_atomic(str(Path(summary["run_dir"]) / "summary.json"), summary)
    return summary


def plan_check_line(check: dict[str, Any]) -> str:
    """The run's last log line: predicted vs measured step time and peak memory (or why no prediction)."""
    measured = (f"measured {check['measured_step_s']:.4f} s/step, "
                f"{check['measured_peak_mem_bytes'] / 2**20:.0f} MiB peak")
    if check["predicted_step_s"] is None:
        return f"# planner: no prediction ({check['prediction_reason']}); {measured}"
    p = check["prediction"]
    return (f"# planner: predicted {check['predicted_step_s']:.4f} s/step, "
            f"{check['predicted_peak_mem_bytes'] / 2**20:.0f} MiB/rank ({p['cluster']}, {p['compute']}, "
            f"{p['layout']}); {measured}")


def resident_peak_bytes() -> int:
    """This process's resident-set high-water mark: Linux's VmHWM, which (unlike ``ru_maxrss``) a
    process does not inherit from the parent that forked it; ``ru_maxrss`` elsewhere."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA's allocator peak, or the resident set's high-water mark."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resident_peak_bytes()


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
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
