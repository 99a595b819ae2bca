"""Interrupted runs keep their work: SIGINT (Ctrl-C) and SIGTERM (Slurm's time limit and scancel,
Kubernetes' eviction, ``kill``) stop every rank after the same step, with a checkpoint of it.

The first SIGINT or SIGTERM a process gets sets ``elastic``'s stop flag; the trainer all-reduces it
(MAX) once per step (``elastic.stop_flag``, read with the step's loss and gradient norm; elastic
runs keep ``elastic.agree_at_boundary``, which carries their replicas' step beside it), so all
ranks stop after the same step however the signal reached them: at the launcher
(``meshtrain train`` forwards SIGTERM to its workers), at one worker, at all of them (a terminal's
Ctrl-C reaches its whole process group), or at torchrun (which forwards the signal it got). The
ranks save that step (even with ``checkpoint.every = 0``; not with ``checkpoint.enabled = false``)
and return a summary marked ``preempted``; the launcher prints one line (``stopped_line``) naming
the step saved and the command that resumes it, and exits 130 after SIGINT, 143 after SIGTERM
(128 + the signal, what a shell shows for a process the signal ended).

A second SIGINT exits at once, without saving (still one line, exit 130). A SIGINT within
``DEBOUNCE_S`` of the first is the same Ctrl-C arriving twice: once from the terminal, once
forwarded by the worker's launcher (torchrun forwards what it gets to processes the terminal also
signalled). Repeated SIGTERMs are ignored: agents send them again while they wait.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from .. import procfs
from . import elastic

EXIT_SIGINT = 128 + signal.SIGINT
"""Exit code of a run stopped by SIGINT (Ctrl-C), saved or not: 130, as a shell reports it."""
EXIT_SIGTERM = 128 + signal.SIGTERM
"""Exit code of a run stopped by SIGTERM: 143 (``elastic.EXIT_PREEMPTED``)."""
DEBOUNCE_S = 1.0
"""A SIGINT this soon after the first one is the same Ctrl-C, delivered twice (see the docstring)."""
NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


class Interrupted(BaseException):
    """Raised in a launcher by a signal that cannot wait for a step boundary: one that came before
    the ranks started (nothing to save yet) or a second SIGINT (``again``). A BaseException, as
    KeyboardInterrupt is, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int, again: bool = False) -> None:
        super().__init__(f"interrupted by {signal_name(signum)}")
        self.signum, self.again = signum, again


def signal_name(signum: int) -> str:
    """"SIGINT (Ctrl-C)", "SIGTERM", or the signal's own name."""
    return NAMES.get(signum) or signal.Signals(signum).name


def exit_code(signum: int) -> int:
    """128 + the signal: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


@dataclass
class _State:
    """One per process (the ranks of a thread transport share it, as they share the stop flag)."""

    signum: int = 0  # the first SIGINT / SIGTERM this process got; 0: none
    sigint_at: float | None = None  # when its first SIGINT came (monotonic)
    stopping: bool = False  # ranks are training: a signal asks them to stop; else it raises Interrupted
    forward: Callable[[int], None] | None = None  # passes the first signal on (a launcher's workers)
    at_once: Callable[[int], None] | None = None  # a second SIGINT; default: raise Interrupted(again)
    resume: Callable[[], str] | None = None  # the command that resumes the run, for the line
    depth: int = 0
    stack: list[Any] = field(default_factory=list)


_S = _State()


def received() -> int:
    """The first SIGINT or SIGTERM this process got while guarded (0: none)."""
    return _S.signum


def requested_signal() -> int:
    """What this rank puts into the stop flag at a step boundary: its signal number if it was asked
    to stop (SIGTERM for ``elastic.request_stop()`` called directly), else 0."""
    if not elastic.stop_requested():
        return 0
    return _S.signum or int(signal.SIGTERM)


def set_resume(command: Callable[[], str]) -> None:
    """Name the command that resumes this run (called lazily: ``out`` is fixed by the launch)."""
    _S.resume = command


def resume_command() -> str | None:
    """The resume command ``set_resume`` gave, if any."""
    return _S.resume() if _S.resume is not None else None


def _handler(signum: int, frame: Any) -> None:
    first = _S.signum == 0
    if first:
        _S.signum = signum
    if signum == signal.SIGINT:
        now = time.monotonic()
        if _S.sigint_at is None:
            _S.sigint_at = now
        elif now - _S.sigint_at > DEBOUNCE_S:
            if _S.at_once is not None:
                _S.at_once(signum)
                return
            raise Interrupted(signum, again=True)
    if not first:
        return
    if not _S.stopping:
        raise Interrupted(signum)
    elastic.request_stop()
    if _S.forward is not None:
        _S.forward(signum)


@contextlib.contextmanager
def guard(stopping: bool = False, forward: Callable[[int], None] | None = None,
          at_once: Callable[[int], None] | None = None) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM are handled here: with ``stopping`` (ranks are training) the
    first one asks every rank to stop at the next step boundary and is passed to ``forward``;
    without it the first raises ``Interrupted``. A second SIGINT calls ``at_once`` (default: raise
    ``Interrupted(again=True)``). Guards nest (an inner one changes the mode, the signal seen is
    kept); the outermost clears the state on entry and exit. Only the main thread may set handlers:
    elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _S.depth == 0:
        _S.signum, _S.sigint_at = 0, None
        elastic.clear_stop()
    _S.stack.append((_S.stopping, _S.forward, _S.at_once, signal.getsignal(signal.SIGINT),
                     signal.getsignal(signal.SIGTERM)))
    _S.depth += 1
    _S.stopping, _S.forward, _S.at_once = stopping, forward, at_once
    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    if stopping and _S.signum:  # asked before the ranks began: they stop after their first step
        elastic.request_stop()
    try:
        yield
    finally:
        _S.depth -= 1
        _S.stopping, _S.forward, _S.at_once, sigint, sigterm = _S.stack.pop()
        signal.signal(signal.SIGINT, sigint)
        signal.signal(signal.SIGTERM, sigterm)
        if _S.depth == 0:
            _S.signum, _S.sigint_at = 0, None
            elastic.clear_stop()


# -- a launcher's workers -----------------------------------------------------------------------


def forkserver_workers() -> list[int]:
    """The worker processes of ``meshtrain train``: the children of multiprocessing's fork server,
    which forks them (``worker_processes``; torch's elastic agent keeps their handles to itself)."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return procfs.children(pid) if pid else []


def signal_workers(pids: Sequence[int], signum: int) -> None:
    """Send ``signum`` to each of ``pids`` that still exists."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signum)


def kill_workers(pids: Sequence[int], wait_s: float = 3.0) -> None:
    """SIGKILL ``pids`` and wait (at most ``wait_s``) until they are gone, so the agent finds them
    dead rather than logging that it closes them."""
    signal_workers(pids, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(procfs.alive(p) for p in pids):
        time.sleep(0.02)


# -- what the ranks return, and the line -------------------------------------------------------


def stopped_summary(step: int, signum: int, checkpoint: str | None, run_dir: str, steps: int) -> dict[str, Any]:
    """What the trainer returns on every rank after a stop at ``step`` agreed on ``signum``
    (``checkpoint``: the step's directory; None with checkpointing disabled)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:  # (1: elastic.request_stop() called directly, without a signal)
        name = str(signum)
    # "preempted": the key elastic runs and their launchers already read
    return {"preempted": True, "step": step, "checkpoint": checkpoint, "run_dir": run_dir, "steps": steps,
            "signal": name, "signum": int(signum), "exit_code": exit_code(signum)}


def _resume_words(resume: str | None) -> str:
    return f"resume with: {resume}" if resume else "resume with the same command and --checkpoint.resume=auto"


def stopped_line(summary: Mapping[str, Any], signum: int | None = None, resume: str | None = None,
                 elastic_run: bool = False) -> str:
    """The one line for a run that stopped at a step boundary (``stopped_summary``); ``signum``: the
    signal the launcher got, if it got one (else the ranks' agreed one)."""
    signum = signum or summary.get("signum") or int(signal.SIGTERM)
    what = f"interrupted by {signal_name(signum)} after step {summary['step']} of {summary['steps']}"
    code = f"(exit code {exit_code(signum)})"
    if summary.get("checkpoint") is None:
        return (f"{what}: every rank stopped there, but nothing was saved: checkpointing is disabled "
                f"(checkpoint.enabled = false); run again to train from the start {code}")
    if elastic_run:
        return (f"{what}: every rank stopped there and saved checkpoint {summary['checkpoint']}; a restart resumes "
                f"from it (checkpoint.resume = 'auto') with the layout chosen for the ranks it gets {code}")
    return (f"{what}: every rank stopped there and saved checkpoint {summary['checkpoint']}; "
            f"{_resume_words(resume)} {code}")


UNSAVED = {
    "again": "interrupted again by {}: stopped at once without saving",
    "early": "interrupted by {} before training began",
    "ended": "interrupted by {}: the workers ended before a step boundary, without saving",
}
"""How ``unsaved_line`` begins, by what happened."""


def unsaved_line(signum: int, what: str, checkpoint_root: str | None, resume: str | None,
                 enabled: bool = True) -> str:
    """The one line for a run that ended without a stop at a step boundary (``what``, a key of
    ``UNSAVED``: a second SIGINT, a signal before training began, workers that ended before their
    handler ran). Names the newest checkpoint there is, if any, and the command that resumes it."""
    from .checkpoint import latest_checkpoint

    head = UNSAVED[what].format(signal_name(signum))
    code = f"(exit code {exit_code(signum)})"
    last = latest_checkpoint(checkpoint_root) if checkpoint_root and os.path.isdir(checkpoint_root) else None
    if last is not None:
        return f"{head}; the last checkpoint is {last}: {_resume_words(resume)} {code}"
    why = "checkpointing is disabled (checkpoint.enabled = false)" if not enabled else "there is no checkpoint yet"
    return f"{head}; {why}, so running it again starts from step 1 {code}"


LOST_HINT = "restart the job"
"""How ``meshtrain.comm``'s lost-peer message (``liveness``) ends."""


def restart_hint(message: str, checkpoint_root: str | None) -> str:
    """``message`` with the lost-peer advice made true: it names the checkpoint a restart resumes
    from, or says there is none yet (a restart then trains from step 1)."""
    from .checkpoint import latest_checkpoint

    if LOST_HINT not in message:
        return message
    last = latest_checkpoint(checkpoint_root) if checkpoint_root and os.path.isdir(checkpoint_root) else None
    hint = (f"restart the job (resuming from the last checkpoint, {last}, with --checkpoint.resume=auto)" if last
            else "restart the job (no checkpoint was saved yet, so it trains from step 1)")
    return message.replace(LOST_HINT, hint)


def resume_argv(prog: Sequence[str], config_path: str | None, overrides: Sequence[str], out: str,
                flags: Sequence[str] = ()) -> str:
    """The shell command that resumes a run: ``prog`` (``meshtrain train``), the config file, the
    overrides without any ``--checkpoint.resume``/``--out``, ``flags``, then ``--out OUT
    --checkpoint.resume=auto``."""
    kept: list[str] = []
    skip = False
    for a in overrides:
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in ("--checkpoint.resume", "--out"):
            skip = "=" not in a  # "--checkpoint.resume PATH": its value is the next word
            continue
        kept.append(a)
    words = [*prog, *(["--config", config_path] if config_path else []), *kept, *flags, f"--out={out}",
             "--checkpoint.resume=auto"]
    return shlex.join(words)


def exit_now(line: str, code: int) -> None:
    """Print ``line`` (if any) on stderr and end the process with ``code`` at once: ranks as threads
    cannot be stopped, and an interpreter that finalises under them aborts."""
    if line:
        print(line, file=sys.stderr, flush=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


__all__ = ["EXIT_SIGINT", "EXIT_SIGTERM", "DEBOUNCE_S", "Interrupted", "signal_name", "exit_code", "received",
           "requested_signal", "set_resume", "resume_command", "guard", "forkserver_workers", "signal_workers",
           "kill_workers", "stopped_summary", "stopped_line", "UNSAVED", "unsaved_line",
           "LOST_HINT", "restart_hint", "resume_argv", "exit_now"]
