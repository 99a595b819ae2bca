"""What a run's records say after a resume, and after a worker failed.

A resumed run is one run in several *segments* (one per ``meshtrain train``, or per restarted
attempt): segment 1 trains from step 1, each later one from the checkpoint it resumed.

- The resume is named in one line (``resume_line``): the checkpoint, the layout it was saved
  under and its step.
- ``metrics.jsonl`` is only appended to, and each step row carries its ``segment``. A segment that
  resumed from an earlier step than the last one logged appends the steps it trains again; the
  reader ``metrics.read_steps`` drops, where a segment's rows begin, the earlier rows of its steps
  and later ones, so every step appears once, from the segment that trained it last. The replayed
  rows stay in the file as the record of what happened (elastic runs count them:
  ``replayed_steps``); ``whole_run`` gives the plots every segment's steps, each once.
- ``config.toml`` is the latest segment's config; each earlier segment's is kept as
  ``configs/config.segK.toml`` (``keep_config``), so a first segment's layout is not lost.
- The summary counts this segment's steps and the run's (``segment_summary``, ``trained_words``).

A worker process that fails is reported by ``meshtrain train`` in one line (``failure_line``): the
error, the rank, the exit code the command exits with, and the fix. The worker's traceback goes to
``RUN_DIR/logs/rank-R.log``, and what torch's elastic agent logs (its ``E... api.py:...]
Traceback`` lines) to ``RUN_DIR/logs/agent.log`` instead of the terminal (``agent_log``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..errors import exit_code

METRICS = "metrics.jsonl"
CONFIG = "config.toml"
CONFIGS_DIR = "configs"
LOGS_DIR = "logs"
AGENT_LOG = "agent.log"
ELASTIC_LOGGER = "torch.distributed.elastic"
"""The logger of torch's elastic agent; its records reach the terminal through ``torch.distributed``'s
stderr handler (propagation), which ``agent_log`` cuts while a launch runs."""


# -- resume --------------------------------------------------------------------------------------


def layout_words(layout: Mapping[str, int] | None) -> str:
    """"dp=2 tp=2" (``elastic.layout_label``), or "unknown" for a checkpoint without its config."""
    from .elastic import layout_label

    return layout_label(layout) if layout else "unknown"


def resume_line(path: str | os.PathLike, step: int, saved: Mapping[str, int] | None, now: Mapping[str, int]) -> str:
    """The one line a resumed run prints: the checkpoint, its layout and step (and this run's
    layout where it differs: the checkpoint was resharded on load)."""
    line = f"# resumed from {path} (layout {layout_words(saved)}, step {step})"
    if saved and dict(saved) != dict(now):
        line += f", resharded to layout {layout_words(now)}"
    return line


def keep_config(run_dir: str | os.PathLike, text: str) -> int:
    """Write ``config.toml`` (atomically) for the segment starting now, first keeping the one
    there (the previous segment's) as ``configs/config.segK.toml``; returns this segment's number
    (1 for a run's first, K + 1 after keeping segment K's)."""
    from .checkpoint_io import replace_durable

    run = Path(run_dir)
    old, folder = run / CONFIG, run / CONFIGS_DIR
    segment = 1 + len(list(folder.glob("config.seg*.toml"))) if folder.is_dir() else 1
    if old.is_file():
        folder.mkdir(exist_ok=True)
        replace_durable(str(folder / f"config.seg{segment}.toml"), old.read_bytes())
        segment += 1
    replace_durable(str(old), text.encode())
    return segment


def whole_run(run_dir: str | os.PathLike) -> tuple[list[dict[str, Any]], list[int]]:
    """What ``loss.png`` and ``load_balance.png`` draw: every segment's steps, each once
    (``metrics.read_steps``), and the steps later segments resumed from (their first step - 1)."""
    from .metrics import read_steps

    rows = read_steps(Path(run_dir) / METRICS)
    marks = [b["step"] - 1 for a, b in zip(rows, rows[1:]) if b.get("segment") != a.get("segment")]
    return rows, marks


def segment_summary(start_step: int, steps: int, resumed: str | os.PathLike | None, segment: int) -> dict[str, Any]:
    """summary.json's account of the segment: ``steps`` (the run's, as before) is the last step,
    ``trained_steps`` those this segment trained (``first_step`` to ``steps``)."""
    return {"trained_steps": steps - start_step, "first_step": start_step + 1, "resumed_step": start_step,
            "resumed_from": str(resumed) if resumed else None, "segment": segment}


def trained_words(summary: Mapping[str, Any]) -> str:
    """"10 steps (21-30 of 30)" for a resumed segment, "30 steps" for a run trained in one."""
    total = summary["steps"]
    done = summary.get("trained_steps", total)
    if done == total:
        return f"{total} steps"
    return f"{done} steps ({summary.get('first_step', total - done + 1)}-{total} of {total})"


# -- a failed worker -----------------------------------------------------------------------------


@contextlib.contextmanager
def agent_log(run_dir: str | os.PathLike) -> Iterator[Path]:
    """While inside, what torch's elastic agent logs goes to ``RUN_DIR/logs/agent.log`` (created
    only if it logs anything), not to the terminal: its traceback of a failed worker repeats the
    worker's own, 40 lines that would bury the one line ``failure_line`` prints."""
    path = Path(run_dir) / LOGS_DIR / AGENT_LOG
    log = logging.getLogger(ELASTIC_LOGGER)
    handler = _LazyFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"))
    propagate = log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        yield path
    finally:
        log.propagate = propagate
        log.removeHandler(handler)
        handler.close()


class _LazyFileHandler(logging.FileHandler):
    """A FileHandler that makes its folder when it first writes (no empty ``logs/`` otherwise)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, mode="a", encoding="utf-8", delay=True)

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream is None:
            os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
        super().emit(record)


def write_rank_log(run_dir: str | os.PathLike, rank: int, failure: Any) -> Path:
    """Append a failed worker's record (torch's ``ProcessFailure``: its error file's message and
    traceback, exit code, pid) to ``RUN_DIR/logs/rank-R.log``; returns the path."""
    path = Path(run_dir) / LOGS_DIR / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    msg = failure.message
    trace = ""
    if isinstance(msg, dict):
        trace = str((msg.get("extraInfo") or {}).get("py_callstack") or "")
        msg = msg.get("message", "")
    when = time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(getattr(failure, "timestamp", 0) or time.time()))
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"=== {when}: rank {rank} (pid {failure.pid}) failed, process exit code {failure.exitcode}\n"
                f"{msg}\n{trace.rstrip()}\n\n")
    return path


def earlier_checkpoint_fix(step_dir: str | os.PathLike) -> str:
    """The fix for a damaged checkpoint ``step_dir``: restore it, or resume from the newest
    committed checkpoint before it, named with the flag that does so (or say there is none)."""
    from .checkpoint_io import STEP_RE, committed_steps

    step_dir = Path(step_dir)
    m = STEP_RE.match(step_dir.name)
    mine = int(m.group(1)) if m else None
    earlier = [p for s, p in committed_steps(str(step_dir.parent)) if mine is None or s < mine]
    if not earlier:
        return (f"restore the file; no earlier checkpoint exists beside it in {step_dir.parent}, so otherwise start "
                f"without resuming")
    return f"restore the file, or resume from the earlier checkpoint with --checkpoint.resume={earlier[-1]}"


def failure_line(exc: Any, run_dir: str | os.PathLike | None, checkpoint_root: str | None) -> tuple[str, int]:
    """``meshtrain train``'s one line for torch's ``ChildFailedError`` (after writing every failed
    rank's traceback to its log), and the exit code it ends with: 2 for bad input, 1 else
    (``errors.exit_code`` of the error's class)."""
    from .interrupt import restart_hint

    rank, failure = exc.get_first_failure()
    msg = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
    msg = restart_hint(msg, checkpoint_root)  # a lost peer's advice, made true
    code = exit_code(msg.split(":", 1)[0])
    where = ""
    if run_dir:
        with contextlib.suppress(OSError):  # a read-only run dir still gets the line
            logs = {r: write_rank_log(run_dir, r, f) for r, f in sorted(exc.failures.items())}
            where = f"; traceback in {logs[rank]}"
    if not msg:  # killed by a signal, or ended without an error record
        msg = f"the process ended with exit code {failure.exitcode} ({failure.signal_name()})"
    return f"worker rank {rank} failed: {msg} (exit code {code}{where})", code


__all__ = ["LOGS_DIR", "CONFIGS_DIR", "layout_words", "resume_line", "keep_config",
           "whole_run", "segment_summary", "trained_words", "agent_log", "write_rank_log", "earlier_checkpoint_fix",
           "failure_line"]
