"""Starting a run: ``meshtrain train`` resolves and validates the config, warms the data caches,
then starts dp·pp·cp·tp local worker processes with torch.distributed's elastic launcher (or, with
a ``comm.transport`` whose ranks are threads, such as ``"local"``, runs the ranks as threads in this
process). Under ``torchrun`` the same workers run through ``python -m meshtrain.train`` with the
environment torchrun provides.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Iterator

import torch

from .. import comm, worker_processes
from ..comm.launch import share_cores
from ..comm.transport import registry
from ..errors import ConfigError, LaunchError, MeshtrainError, exit_code
from . import elastic, elastic_world, interrupt, run_dir, run_records
from .config import Config, from_dict, resolve_out, to_dict, validate


def world_size(config: Config) -> int:
    """The number of ranks the layout needs."""
    return config.parallel.world_size


def check_backend_and_device(config: Config) -> None:
    """``ConfigError`` where this process cannot run ``comm.backend`` or ``train.device``: NCCL
    without CUDA (or a torch without NCCL), ``cuda`` without a GPU. Called before any process group
    exists, so a job sent to the wrong nodes stops with the fix, not with torch's tracebacks."""
    cuda = torch.cuda.is_available()
    if config.comm.backend == "nccl" and not (cuda and torch.distributed.is_nccl_available()):
        why = "sees no CUDA device" if not cuda else "has a torch without NCCL"
        raise ConfigError(f"comm.backend = 'nccl' cannot work here: this process {why} (torch {torch.__version__}, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); on CPU nodes "
                          f"use --comm.backend=gloo --train.device=cpu (`meshtrain launch --device cpu` writes a job "
                          f"that does), or 'auto' for both to use GPUs only where there are some")
    if config.train.device == "cuda" and not cuda:
        from .trainer import resolve_device  # (imported only here: the trainer pulls in the whole model stack)

        resolve_device("cuda")  # its ConfigError, the one the trainer would raise


def worker(config_dict: dict[str, Any], progress: bool = True, own_run_dir: bool = False) -> dict[str, Any]:
    """One worker process: initialise meshtrain.comm from the launcher's environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT), train, shut down. ``own_run_dir`` (torchrun, where no
    launcher holds the run directory): rank 0 takes its lock once every rank has joined."""
    from .trainer import train

    config = from_dict(config_dict)
    check_backend_and_device(config)  # before comm.init: no process group for a job that cannot run
    c = config.comm
    # the elastic agent, unlike torchrun's command line, leaves every worker one thread per core
    share_cores(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    try:
        comm.init(transport=c.transport, backend=None if c.backend == "auto" else c.backend, timeout=c.timeout_s,
                  check=c.check, init_timeout=c.init_timeout_s)
    except RuntimeError as exc:  # torch's DistNetworkError when the master cannot listen
        if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc):
            raise
        addr = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise LaunchError(f"the rendezvous port {addr} (MASTER_ADDR:MASTER_PORT) is already in use by another "
                              f"process; pick a free port (torchrun --master-port=PORT, or MASTER_PORT) or stop the "
                              f"process that holds it") from exc
    failure: BaseException | None = None
    lock = None
    if own_run_dir and comm.get_rank() == 0:  # after comm.init: every rank has checked out before it is claimed
        try:
            lock = run_dir.claim(config, torchrun=True)
        except BaseException as exc:
            exit_within(EXIT_GRACE_S, exit_code(exc))
            comm.destroy(exc)  # the other ranks stop at once, not at their first collective's timeout
            raise
    config.overwrite = False  # done by rank 0; the same on every rank (the trainer checks that they agree)
    me = comm.current()
    if me.liveness is not None:  # a lost peer: kill frozen siblings; an elastic run leaves its stop mark
        me.liveness.add_listener(elastic_world.on_peer_lost(config.out, comm.get_rank(), comm.get_world_size(),
                                                            me.liveness, me.hosts, config.elastic.enabled))
    try:
        # SIGINT / SIGTERM: every rank saves at the next step boundary; a second SIGINT ends it at once
        with interrupt.guard(stopping=True, at_once=lambda signum: _worker_exit_now(config, signum)):
            return train(config, progress=progress and int(os.environ.get("RANK", "0")) == 0, report=own_run_dir)
    except BaseException as exc:
        failure = exc  # the other ranks are told at once, not at their next collective's timeout
        exit_within(EXIT_GRACE_S, exit_code(exc))
        if me.liveness is not None:  # a frozen sibling would hold its agent's restart 30 s
            elastic_world.report_frozen([], comm.get_rank(), me.hosts)
        if config.elastic.enabled and config.out:  # the next world times the change from it
            elastic_world.write_stop(config.out, comm.get_rank(), comm.get_world_size(), f"{type(exc).__name__}: {exc}")
        raise
    finally:
        comm.destroy(failure)
        if lock is not None:
            lock.release()


EXIT_GRACE_S = 3.0  # a failed worker's error is reported and its interpreter gone well within this


def _worker_exit_now(config: Config, signum: int) -> None:
    """A second SIGINT in a worker: end it at once. Under torchrun (which named the resume command:
    ``main_torchrun``) rank 0 says so in one line; ``meshtrain train``'s launcher prints its own."""
    line, resume = "", interrupt.resume_command()
    if resume is not None and int(os.environ.get("RANK", "0") or 0) == 0:
        root = os.path.join(config.out, config.checkpoint.dir)
        line = "meshtrain.train: " + interrupt.unsaved_line(signum, "again", root, resume, config.checkpoint.enabled)
    interrupt.exit_now(line, interrupt.exit_code(signum))


def exit_within(seconds: float, code: int) -> None:
    """End this process with ``code`` if it still runs ``seconds`` from now. Python's exit joins
    every executor thread (an async op's, a bucket's reduction), and one still waiting in a
    collective on a peer that is itself exiting would hold the process, its host's agent and the
    job until the collective timeout; the error is reported before then, and the streams are
    flushed before the end."""

    def end() -> None:
        time.sleep(seconds)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    threading.Thread(target=end, name="meshtrain-exit", daemon=True).start()


def _thread_rank(rank: int, config: Config, progress: bool) -> dict[str, Any]:
    from .trainer import train

    return train(config, progress=progress and rank == 0)


_SCRATCH = re.compile(r"meshtrain-run-(\d+)-")


def remove_stale_scratch(root: str | None = None) -> list[str]:
    """Remove the scratch directories of launchers that are gone (killed before they cleaned up)."""
    from ..comm.transport.shm_memory import alive

    root = root or tempfile.gettempdir()
    removed = []
    for name in os.listdir(root):
        m = _SCRATCH.match(name)
        if m and not alive(int(m.group(1))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


@contextlib.contextmanager
def scratch_tmpdir() -> Iterator[str]:
    """A private temp directory for one launch: the elastic agent's log directories and error
    files and anything the workers put in TMPDIR land there, and it is removed when the launch
    ends, however the workers ended (torch leaves both behind in /tmp after a failed worker)."""
    remove_stale_scratch()
    path = tempfile.mkdtemp(prefix=f"meshtrain-run-{os.getpid()}-")
    old_env, old_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = path, path
    try:
        yield path
    finally:
        tempfile.tempdir = old_tempdir
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env
        shutil.rmtree(path, ignore_errors=True)


def launch(config: Config, max_restarts: int = 0, progress: bool = True, world: int | None = None) -> dict[str, Any]:
    """Run ``config`` on this host; returns rank 0's summary. With ``max_restarts`` the elastic
    agent restarts failed workers, which resume from the run's latest checkpoint. ``world`` starts
    that many ranks instead of the layout's (``elastic.enabled`` then chooses the layout for them,
    as after a torchrun membership change)."""
    resolve_out(config)
    if max_restarts and not config.checkpoint.resume:
        config.checkpoint.resume = "auto"
    if not config.parallel.auto:
        validate(config)  # with auto, the layout is checked once chosen (below)
    check_backend_and_device(config)  # here, once, not in every worker
    run_dir.absolute_paths(config)  # config.toml and the checkpoints then mean the same from any directory
    run_dir.use_checkpoint_tokenizer(config)  # a resumed run tokenises as its checkpoint did
    from .tokenizer import prepare_data

    corpus, tokenizer, tokens = prepare_data(config.data)  # build the tokenizer and token caches once, before the ranks start
    if config.parallel.auto:
        from ..plan.auto import choose_layout, describe

        print(describe(choose_layout(config, tokenizer.vocab_size)), file=sys.stderr, flush=True)
    if config.train.device in ("cpu", "auto") and not torch.cuda.is_available():
        from ..hardware import device_peak

        device_peak(torch.device("cpu"))  # measure the CPU peak while the machine is still quiet
    n = world_size(config) if world is None else world
    if n != world_size(config):
        if not config.elastic.enabled:
            raise ConfigError(f"--world-size {n} differs from the {world_size(config)} ranks of the layout "
                              f"(dp x tp x pp x cp); set elastic.enabled = true to choose the layout for {n} ranks, "
                              f"or leave --world-size out")
        elastic.effective_config(config, n, tokenizer.vocab_size)  # a world with no layout: one error, here
    from . import preflight

    # the run against this host (ConfigError where its ranks cannot start), its settings' no-ops and the
    # data it will see: once, here, not in every rank
    preflight.report(config, n, registry.runs_as_threads(config.comm.transport), corpus, tokenizer, tokens)
    # last, once the input is known good: this launcher owns out for its ranks (ConfigError if another
    # run does, or out holds a run this one would train over)
    lock = run_dir.claim(config)
    config.overwrite = False  # done (the previous run's files are gone): config.toml says false
    try:
        return _start(config, n, max_restarts, progress)
    finally:
        lock.release()


def _start(config: Config, n: int, max_restarts: int, progress: bool) -> dict[str, Any]:
    """Run the ``n`` ranks of ``config``, threads or worker processes (``launch`` holds the lock)."""
    if registry.runs_as_threads(config.comm.transport):
        def run() -> dict[str, Any]:
            return comm.run_local(n, _thread_rank, config, progress, timeout=config.comm.timeout_s,
                                  transport=config.comm.transport)[0]

        def exit_now(signum: int) -> None:  # a second SIGINT: threads cannot be stopped, so end the process
            root = os.path.join(config.out, config.checkpoint.dir)
            interrupt.exit_now("meshtrain train: " + interrupt.unsaved_line(
                signum, "again", root, interrupt.resume_command(), config.checkpoint.enabled), interrupt.exit_code(signum))

        # ranks as threads: this thread runs the signal handler, so it must stay awake
        with interrupt.guard(stopping=True, at_once=exit_now):
            return elastic.call_interruptibly(run)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the workers fork from a server that imported torch once (worker_processes), not n new
    # interpreters importing it (about 1.3 s of CPU each), under this process's environment; the
    # server starts before the scratch directory, which is removed at the end (its socket lives on)
    worker_processes.ensure_server()
    # SIGINT / SIGTERM are this process's, not the agent's (signals_to_handle): torch's agent would
    # end with a traceback and SIGKILL workers still saving after 30 s. The first is passed on to
    # the workers as SIGTERM (a terminal's Ctrl-C has reached them already: a SIGINT from here
    # would look like a second one); a second SIGINT kills them and ends the launch.
    def again(signum: int) -> None:
        interrupt.kill_workers(interrupt.forkserver_workers())
        raise interrupt.Interrupted(signum, again=True)

    def forward(signum: int) -> None:
        interrupt.signal_workers(interrupt.forkserver_workers(), signal.SIGTERM)

    # the agent's own log (its traceback of a failed worker) goes to RUN_DIR/logs/agent.log, not the
    # terminal, where the launcher's one line says what failed (run_records.failure_line)
    with scratch_tmpdir(), run_records.agent_log(config.out), \
            interrupt.guard(stopping=True, forward=forward, at_once=again):
        lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=f"meshtrain-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=max_restarts,
                          monitor_interval=0.5, rdzv_configs={"timeout": int(config.comm.init_timeout_s)},
                          start_method="forkserver", signals_to_handle="SIGHUP,SIGQUIT")
        results = elastic_launch(lc, worker_processes.with_caller_env(os.environ, worker))(to_dict(config), progress)
    return results[0]


def main_torchrun(argv: list[str] | None = None) -> int:
    """``torchrun ... -m meshtrain.train [--config F] [--section.key=value ...]``: one worker."""
    from .config import load_config

    args = list(sys.argv[1:] if argv is None else argv)
    path = None
    if "--config" in args:
        i = args.index("--config")
        path = args[i + 1]
        del args[i : i + 2]
    try:
        config = load_config(path, args)
    except MeshtrainError as exc:
        print(f"meshtrain.train: error: {exc}", file=sys.stderr)
        return 2
    if config.parallel.auto:  # every rank would plan alone, and the plans could differ
        print("meshtrain.train: error: parallel.auto = true chooses the layout before the ranks start, which "
              "torchrun does not let it do; run `meshtrain plan --cluster this-host --search ...` (or launch with "
              "`meshtrain train --parallel.auto=true`) and pass the layout it ranks first", file=sys.stderr)
        return 2
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and not config.checkpoint.resume:
        # torchrun --max-restarts N: a restarted attempt must continue from the last checkpoint,
        # as `meshtrain train --max-restarts` does, not train again from step 1
        config.checkpoint.resume = "auto"
    if not config.out:
        raise SystemExit("meshtrain.train under torchrun: pass --out DIR (every rank must write to the same run "
                         "directory)")
    try:
        check_backend_and_device(config)
        run_dir.check_reusable(config, torchrun=True)  # reads only; rank 0 takes the lock once all joined (worker)
    except ConfigError as exc:
        # every rank of a host finds the same, before any process group: one line per host, not per rank
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
            print(f"meshtrain.train: error: [host {socket.gethostname()}] ConfigError: {exc}", file=sys.stderr)
        return 2
    run_dir.use_checkpoint_tokenizer(config)  # a resumed run tokenises as its checkpoint did
    # what rank 0's line after an interrupt names (torchrun's own options are not known here)
    interrupt.set_resume(lambda: interrupt.resume_argv(["torchrun", "...", "-m", "meshtrain.train"], path, args,
                                                       config.out))
    try:
        summary = worker(to_dict(config), own_run_dir=True)
    except MeshtrainError as exc:  # one line naming it (and the fix); 2 for bad input, 1 else (as meshtrain train)
        text = interrupt.restart_hint(str(exc), os.path.join(config.out, config.checkpoint.dir))  # a lost peer's
        print(f"meshtrain.train: error: [rank {os.environ.get('RANK', '?')}] {type(exc).__name__}: {text}",
              file=sys.stderr)
        return exit_code(exc)
    if summary.get("preempted"):  # stopped at a step boundary by a signal: non-zero, so torchrun restarts
        if int(os.environ.get("RANK", "0") or 0) == 0:
            line = interrupt.stopped_line(summary, resume=interrupt.resume_command(), elastic_run=config.elastic.enabled)
            print(f"meshtrain.train: {line}", file=sys.stderr)
        return int(summary.get("exit_code", elastic.EXIT_PREEMPTED))
    if int(os.environ.get("RANK", "0") or 0) == 0:
        from . import preflight

        preflight.plan_lines(summary)
    return 0
