"""Worker processes (the ranks of ``comm.launch.spawn``, benchmark helpers) that start in
milliseconds: forked from one server process that imported torch once.

multiprocessing's ``spawn`` starts each process as a new interpreter, which imports torch again:
1.3 s of CPU each, about 3 s for four ranks on 2 cores, before any rank runs. The ``forkserver``
context instead forks each process from a server that preloaded torch (``PRELOAD``): four ranks
start in about 30 ms once the server is up. Torch is made to be forked after its import (its
DataLoader's workers are), and the server runs nothing but that import before it forks. It
imports torch's compiler front end (torch._dynamo) too, another 1.2 s of CPU in every process
that would import it anyway: every training rank does (torch's optimizers import it when they are
built, and meshtrain's model code marks functions with ``torch.compiler.disable``).

A forked process inherits the *server's* environment, not the caller's as under spawn. ``start``
therefore carries the caller's ``os.environ`` along and installs it before the target is even
unpickled, so meshtrain's modules, which read some settings at import (``MESHTRAIN_SHM_*``,
``MESHTRAIN_HEARTBEAT_S``), and the caller's own are imported under the caller's environment.
Only torch (with torch._dynamo) was imported before that, under the environment the server
started with.

This module imports nothing of meshtrain or torch: unpickling its ``_entry`` in a new process
must not import a module before the environment is in place.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import tempfile
from multiprocessing.context import BaseContext
from typing import Any, Callable, Sequence

PRELOAD = ["torch", "torch._dynamo", "meshtrain.worker_processes"]
"""What the server imports before it forks: torch and its compiler front end, and this module, so
that ``SERVER_ENV`` holds the environment the server started with (in the server and every
process forked from it)."""
SERVER_ENV: dict[str, str] = dict(os.environ)
"""This process's environment when this module was imported: in a forked process, the server's."""


def context() -> BaseContext:
    """The forkserver context, with torch preloaded in its server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def ensure_server() -> None:
    """Start the server now, if it is not running. Its start makes multiprocessing's temp
    directory (``pymp-*``), which lives as long as this process: a test session starts the
    server first so that no test sees that directory appear."""
    context()
    from multiprocessing import forkserver

    forkserver.ensure_running()


def start(target: Callable[..., Any], args: Sequence[Any], handles: Sequence[Any] = (),
          name: str | None = None) -> mp.Process:
    """Start a daemon process running ``target(*args, *handles)`` under this process's current
    environment (see the module docstring). ``target`` and ``args`` travel by ``pickle`` (tensors
    by value); ``handles`` (pipe ends, ...) by multiprocessing's own pickler, which passes their
    file descriptors."""
    payload = pickle.dumps((target, tuple(args)))
    proc = context().Process(target=_entry, args=(dict(os.environ), payload, *handles), name=name, daemon=True)
    proc.start()
    return proc


def _entry(environ: dict[str, str], payload: bytes, *handles: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    tempfile.tempdir = None  # computed again from TMPDIR, as a new interpreter would
    target, args = pickle.loads(payload)
    target(*args, *handles)


def with_caller_env(environ: dict[str, str], target: Callable[..., Any]) -> Callable[..., Any]:
    """``target`` for a launcher that forks from the server and then sets variables of its own in
    the child before calling it (torch's elastic agent: RANK, MASTER_PORT, ...): the child runs
    under ``environ`` (the caller's, at the call) with those variables on top. Picklable when
    ``target`` is."""
    return functools.update_wrapper(functools.partial(_in_env, dict(environ), target), target)  # (its __name__)


def _in_env(environ: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    launcher = {k: v for k, v in os.environ.items() if SERVER_ENV.get(k) != v}  # what the launcher set here
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(launcher)
    tempfile.tempdir = None
    return target(*args)
