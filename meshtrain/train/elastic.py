"""Elastic training: the layout for the world a (re)start got, and a stop at a step boundary on SIGTERM.

Under ``torchrun --nnodes MIN:MAX`` the workers restart with a new ``WORLD_SIZE`` when hosts leave or
join. With ``[elastic] enabled = true`` the trainer then does not fail on a world that differs from
``[parallel]``: ``layout_for_world`` picks the layout for it, the last checkpoint is resharded into
that layout (checkpoints load under any layout) and the loader's saved position continues with the
next sample, so every sample is trained on once. The global batch stays fixed (each dp rank takes
more or fewer rows of it) unless ``elastic.keep_global_batch = false``.

The layout is always derived from the configured ``[parallel]``, never from the previous world's,
so a run that shrank returns to the configured layout when its hosts come back.

``elastic_world.py`` times the changes (the ``world_change`` row's seconds, from the stop marks the
old world leaves) and ``elastic_launch.py`` writes elastic Slurm and Kubernetes jobs.

SIGTERM (what torchrun's agent sends its workers on a membership change) sets a flag; the ranks
all-reduce it (MAX) at every step boundary, so all of them stop after the same step, save a
checkpoint there and return a summary marked ``preempted`` (no rank raises, so none aborts its
peers while they finish the save); the process then exits with ``EXIT_PREEMPTED``. Every run does
this, elastic or not, and on SIGINT too: ``interrupt.py`` sets the flag.
"""

from __future__ import annotations

import copy
import math
import threading
from typing import Any, Callable, Mapping

import torch

from ..config.check import model_config, validate
from ..config.dims import DEGREE_NAMES, check_degrees, degrees_of, world_size_of
from ..errors import ConfigError
from .config import Config

EXIT_PREEMPTED = 143
"""Exit code of a worker stopped by SIGTERM after its checkpoint: 128 + SIGTERM, what a shell shows
for a process SIGTERM ended. torchrun counts any non-zero exit as a failed worker and restarts the
group while ``--max-restarts`` remains; a restart the agent started itself (a membership change,
the usual source of the SIGTERM) counts no restart."""

SHRINK_ORDER = ("cp", "pp", "tp")
"""With ``elastic.reshape_model_parallel``, the degrees given up first when dp alone cannot absorb a
world: cp, then pp, then tp (tp is kept longest: it is the one a model most needs to fit)."""


def preempted_summary(step: int, path: str, run_dir: str, steps: int) -> dict[str, Any]:
    """What the trainer returns on every rank after a SIGTERM stop at ``step`` (saved at ``path``)."""
    return {"preempted": True, "step": step, "checkpoint": path, "run_dir": run_dir, "steps": steps}


def preempted_message(summary: Mapping[str, Any]) -> str:
    """The line a launcher prints for a ``preempted_summary`` of an elastic run (``interrupt.stopped_line``)."""
    from .interrupt import stopped_line

    return stopped_line(summary, elastic_run=True)


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, largest first."""
    return [d for d in range(n, 0, -1) if n % d == 0]


def layout_label(d: Mapping[str, int]) -> str:
    """A layout in a few words: "dp=2 tp=2" (the degrees that are not 1, dp always)."""
    return " ".join(f"{k}={v}" for k, v in d.items() if k == "dp" or v != 1) or "dp=1"


def _candidates(d: Mapping[str, int], reshape: bool) -> list[dict[str, int]]:
    """The (tp, pp, cp) to try, best first: the configured ones; with ``reshape`` then every mix of
    their divisors, keeping tp longest, then pp, then cp (``SHRINK_ORDER`` read backwards)."""
    if not reshape:
        return [{"tp": d["tp"], "pp": d["pp"], "cp": d["cp"]}]
    mixes = [{"tp": t, "pp": p, "cp": c} for t in _divisors(d["tp"]) for p in _divisors(d["pp"])
             for c in _divisors(d["cp"])]
    return sorted(mixes, key=lambda m: tuple(-m[k] for k in reversed(SHRINK_ORDER)))


def _carve(d: Mapping[str, int], dp: int, inner: Mapping[str, int]) -> dict[str, int]:
    """The full degrees for ``dp`` and ``inner`` (tp, pp, cp): dp_replicate and ep shrink to the
    largest divisor of their configured value that still fits (``config.dims``' carving rules)."""
    out = {**d, **inner, "dp": dp}
    out["dp_replicate"] = math.gcd(d["dp_replicate"], dp)
    whole = dp // out["dp_replicate"] * out["cp"]  # ep is carved out of dp_shard x cp
    out["ep"] = next(v for v in _divisors(d["ep"]) if whole % v == 0 and (v == 1 or v % out["cp"] == 0))
    return out


def _try(d: Mapping[str, int], world: int, global_batch: int | None, microbatches: int, reshape: bool,
         check: Callable[[dict[str, int]], None] | None) -> tuple[dict[str, int] | None, list[str]]:
    """The first candidate layout for ``world`` that passes every rule, and why the others failed."""
    why: list[str] = []
    for inner in _candidates(d, reshape):
        n = inner["tp"] * inner["pp"] * inner["cp"]
        label = f"tp x pp x cp = {inner['tp']} x {inner['pp']} x {inner['cp']} = {n}"
        if n > world:
            why.append(f"{label} is larger than the {world} rank{'s' * (world != 1)} left")
            continue
        if world % n:
            why.append(f"{label} does not divide the {world} ranks")
            continue
        dp = world // n
        if global_batch is not None and global_batch % (dp * microbatches):
            why.append(f"train.global_batch = {global_batch} is not divisible by dp x microbatches = {dp} x "
                       f"{microbatches} (dp = {world} / {n})")
            continue
        cand = _carve(d, dp, inner)
        try:
            check_degrees(cand, world)
            if check is not None:
                check(cand)
        except ConfigError as exc:
            why.append(f"{layout_label(cand)}: {exc}")
            continue
        return cand, why
    return None, why


def allowed_worlds(degrees: Mapping[str, int], global_batch: int | None, min_world: int, max_world: int,
                   microbatches: int = 1, reshape: bool = False,
                   check: Callable[[dict[str, int]], None] | None = None) -> list[int]:
    """The world sizes in ``min_world .. max_world`` that ``layout_for_world`` finds a layout for
    (``global_batch`` None: the global batch follows dp, as with ``keep_global_batch = false``)."""
    d = check_degrees(degrees)
    return [w for w in range(max(min_world, 1), max_world + 1)
            if _try(d, w, global_batch, microbatches, reshape, check)[0] is not None]


def layout_for_world(parallel_degrees: Mapping[str, int], world: int, global_batch: int | None,
                     microbatches: int = 1, reshape: bool = False,
                     check: Callable[[dict[str, int]], None] | None = None,
                     max_world: int | None = None) -> tuple[dict[str, int], str]:
    """The layout for ``world`` ranks from the configured degrees, and one line saying why.

    The rule: keep tp, pp and cp and set dp = world / (tp x pp x cp); dp_replicate and ep shrink to
    the largest divisor of their configured value that is still carved validly out of the new dp
    (and cp). The global batch must be divisible by dp x microbatches (``global_batch`` None: no
    such rule, the batch follows dp). If that cannot work and ``reshape`` is true, cp is shrunk
    first, then pp, then tp, each through the divisors of its configured value, and the first
    layout that works is taken. ``check(degrees)`` may add rules (the trainer passes the config's
    ``validate``: the model's shape under tp and pp, the schedule) by raising ``ConfigError``.

    Raises ``ConfigError`` naming the problem and the fix, with the world sizes up to ``max_world``
    (default: twice the larger of ``world`` and the configured world) that would work.
    """
    d = check_degrees(parallel_degrees)
    configured = world_size_of(d)
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"the world size must be a positive integer, got {world!r}")
    if world == configured:
        return d, f"the {world} ranks are the configured layout's ({layout_label(d)})"
    got, why = _try(d, world, global_batch, microbatches, reshape, check)
    if got is None:
        top = max_world or 2 * max(world, configured)
        ok = allowed_worlds(d, global_batch, 1, top, microbatches, reshape, check)
        fix = [f"run on one of the world sizes that work: {ok}" if ok else
               f"no world size up to {top} works with this layout and batch"]
        if not reshape and d["tp"] * d["pp"] * d["cp"] != 1:
            fix.append("set elastic.reshape_model_parallel = true to let cp, then pp, then tp shrink")
        if global_batch is not None and any("global_batch" in w for w in why):
            fix.append("choose a train.global_batch divisible by more dp sizes (e.g. a power of two), or set "
                       "elastic.keep_global_batch = false")
        raise ConfigError(f"elastic: no layout for the {world} rank{'s' * (world != 1)} this run got (configured "
                          f"{layout_label(d)} on {configured}): {why[0]}; " + "; or ".join(fix))
    changed = [f"{k} {d[k]} -> {got[k]}" for k in d if got[k] != d[k]]
    reason = f"{world} ranks instead of the configured {configured}: {', '.join(changed)}"
    shrunk = [k for k in SHRINK_ORDER if got[k] != d[k]]
    if shrunk:
        reason += f" ({why[0]}; elastic.reshape_model_parallel shrank {', '.join(shrunk)})"
    elif global_batch is not None:
        reason += (f" (tp, pp, cp kept; the global batch {global_batch} stays: {global_batch // got['dp']} rows per "
                   f"dp rank)")
    return got, reason


def with_degrees(config: Config, degrees: Mapping[str, int]) -> Config:
    """A copy of ``config`` with the parallel degrees replaced."""
    out = copy.deepcopy(config)
    for k, v in degrees.items():
        setattr(out.parallel, k, v)
    return out


def effective_config(config: Config, world: int, tokenizer_vocab: int | None = None) -> tuple[Config, str | None]:
    """The config a run on ``world`` ranks trains with, and the reason it differs (None: it does not).

    Without ``elastic.enabled`` it is ``config`` itself (the mesh then refuses a world that differs).
    With it, the layout is ``layout_for_world``'s; an empty ``checkpoint.resume`` becomes "auto" (a
    restart continues from the last checkpoint). With ``elastic.keep_global_batch = false`` each dp
    rank keeps the configured ``train.global_batch / parallel.dp`` rows, so the global batch becomes
    rows x the new dp, and ``train.lr`` and ``train.min_lr`` scale by new / configured global batch
    (the linear scaling rule); warmup and the step count stay. If tp changes, ``model.vocab_size``
    is pinned to the configured layout's padding of ``tokenizer_vocab`` (default: data.vocab_size),
    so the checkpoint's embedding still fits.
    """
    e = config.elastic
    if not e.enabled:
        return config, None
    out = copy.deepcopy(config)
    if not out.checkpoint.resume:
        out.checkpoint.resume = "auto"
    p, t = config.parallel, config.train
    keep = e.keep_global_batch

    def check(d: dict[str, int]) -> None:
        cand = with_degrees(out, d)
        if not keep:
            cand.train.global_batch = t.global_batch // p.dp * d["dp"]
        validate(cand)

    degrees, reason = layout_for_world(degrees_of(p), world, t.global_batch if keep else None, p.microbatches,
                                       e.reshape_model_parallel, check)
    if degrees == degrees_of(p):
        return out, None
    out = with_degrees(out, degrees)
    if not keep:
        out.train.global_batch = t.global_batch // p.dp * degrees["dp"]
        scale = out.train.global_batch / t.global_batch
        out.train.lr, out.train.min_lr = t.lr * scale, t.min_lr * scale
        reason += (f"; elastic.keep_global_batch = false: global batch {t.global_batch} -> "
                   f"{out.train.global_batch}, lr {t.lr:g} -> {out.train.lr:g}")
    if degrees["tp"] != p.tp and config.model.vocab_size is None:
        out.model.vocab_size = model_config(config, tokenizer_vocab).vocab_size
    return out, reason


def layout_of_checkpoint(extra: Mapping[str, Any]) -> dict[str, int] | None:
    """The layout a checkpoint was saved under, from its ``extra`` (the config it stores)."""
    par = (extra.get("config") or {}).get("parallel")
    if not isinstance(par, dict):
        return None
    return {n: int(par.get(n, 1)) for n in DEGREE_NAMES}


def world_change_row(step: int, old: Mapping[str, int], new: Mapping[str, int], reason: str | None,
                     seconds: Mapping[str, float | None], event: str = "world_change", **extra: Any) -> dict[str, Any]:
    """The ``metrics.jsonl`` row of a resume under another layout than the checkpoint's (``event``
    "restart": under the same one, after a stop); ``extra`` adds fields (``stopped_by``,
    ``replayed_steps``). ``seconds``: ``elastic_world.change_seconds``."""
    return {"event": event, "step": step, "old_layout": dict(old), "new_layout": dict(new),
            "old_world": world_size_of(old), "new_world": world_size_of(new), "reason": reason, **extra,
            "seconds": dict(seconds)}


# -- stopping on SIGTERM ------------------------------------------------------------------------

_STOP = threading.Event()  # one per process: the ranks of a thread transport share it


def request_stop() -> None:
    """Ask this process's ranks to stop at the next step boundary (what SIGTERM does)."""
    _STOP.set()


def stop_requested() -> bool:
    """Whether this process was asked to stop."""
    return _STOP.is_set()


def clear_stop() -> None:
    """Forget a stop request (a guard of ``interrupt.py`` starting or ending)."""
    _STOP.clear()


def call_interruptibly(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a helper thread while this one waits in short joins: a signal the OS hands to a
    rank's thread still runs its Python handler here promptly (a plain join may sleep through it);
    re-raises what ``fn`` raised."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            box["error"] = exc

    t = threading.Thread(target=run, name="meshtrain-ranks", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.05)
    if "error" in box:
        raise box["error"]
    return box["result"]


def agree_to_stop(requested: bool, device: torch.device | str = "cpu") -> bool:
    """Collective over the world: True on every rank if any rank asks to stop (an all-reduce MAX of
    one flag), so all ranks stop after the same step though a SIGTERM reaches them at different times.
    ``device``: the training device (an NCCL group moves only CUDA tensors)."""
    return agree_at_boundary(requested, 0, device)[0] > 0


def stop_flag(requested: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The stop flag all-reduced (MAX) over the world, left on ``device`` unread: a run without
    elastic brings it to the host in its step's one read (``step.measure_step``), so asking costs
    no device sync. Collective; ``requested``: this rank's signal number, 0 if none."""
    from .. import comm

    flag = torch.tensor([float(requested)], dtype=torch.float64, device=device)
    comm.all_reduce(flag, op=comm.ReduceOp.MAX)
    return flag


def agree_at_boundary(requested: bool | int, done: int, device: torch.device | str = "cpu") -> tuple[int, int]:
    """``agree_to_stop``, and in the same all-reduce the smallest ``done`` over the ranks: the newest
    step whose in-memory replicas every rank has finished keeping (``memory_replica``; -1 if a rank's
    copy failed). One all-reduce MAX of [flag, -done]: no collective more than the stop flag's.
    ``requested`` may be the signal that asked this rank to stop (``interrupt.requested_signal``):
    the first value returned is then the largest such signal number over the ranks (0: no stop)."""
    from .. import comm

    flag = torch.tensor([float(int(requested)), -float(done)], dtype=torch.float64, device=device)
    comm.all_reduce(flag, op=comm.ReduceOp.MAX)
    return int(flag[0].item()), int(-flag[1].item())


__all__ = ["EXIT_PREEMPTED", "SHRINK_ORDER", "preempted_summary", "preempted_message", "layout_label",
           "allowed_worlds", "layout_for_world", "effective_config", "with_degrees", "layout_of_checkpoint",
           "world_change_row", "request_stop", "stop_requested", "clear_stop", "stop_flag", "call_interruptibly",
           "agree_to_stop", "agree_at_boundary"]
