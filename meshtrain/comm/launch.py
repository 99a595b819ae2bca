"""``spawn``: run a function on N real processes (gloo, or shared memory), for tests and benchmarks.

The parent owns the TCPStore (port 0: the OS picks a free port, so there is no port race) and each
child connects to it, initialises torch.distributed and meshtrain.comm, and runs ``fn(rank, *args)``.
A child that raises, dies or overruns ``timeout`` fails the whole run with its rank and traceback,
and every other child is terminated: nothing is left running.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
import traceback
from multiprocessing import connection
from typing import Any, Callable

from .. import worker_processes
from ..errors import CollectiveError


DEATH_GRACE_S = 5.0  # how long the other ranks may run on after one died, before they are killed


class RankFailure(CollectiveError):
    """A spawned rank raised, died or timed out; the message holds its rank and traceback."""


def share_cores(local_processes: int) -> int:
    """Give this process ``cores // local_processes`` intra-op threads (at least 1) unless
    OMP_NUM_THREADS says otherwise, as torchrun does; returns the thread count. p processes each
    with one thread per core oversubscribe the cores, and the threads' spin-waits made 4 MB shm
    all-reduces 30x slower, and a tp=2 training step 13x slower, on 2 cores."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_processes)))
    return torch.get_num_threads()

def _pack(value: Any) -> bytes:
    """Serialise a result with torch.save: tensors put on a multiprocessing queue as they are would
    travel as shared-memory handles that die with the child."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _child(rank: int, world_size: int, port: int, backend: str, comm_timeout: float, check: bool,
           fn: Callable[..., Any], args: tuple, transport: str | None, host_id: str | None, results: Any) -> None:
    try:
        import torch.distributed as dist

        from . import init

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if host_id is not None:
            os.environ["MESHTRAIN_HOST_ID"] = host_id
        share_cores(world_size)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=comm_timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=comm_timeout))
        if transport is not None:  # None: torch.distributed only; fn calls init_process_group itself
            init(transport=transport, timeout=comm_timeout, check=check)
        out = fn(rank, *args)
        results.send((rank, "ok", _pack(out)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        try:
            payload: Any = exc
            import pickle

            pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            payload = None
        results.send((rank, "err", (payload, traceback.format_exc())))
    finally:
        try:
            import torch.distributed as dist

            from . import destroy

            destroy()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def spawn(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
          backend: str = "gloo", comm_timeout: float = 30.0, check: bool = True,
          transport: str | None = "torch", host_ids: list[str] | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` fresh processes; return results in rank order.

    The ranks are forked from a server that imported torch once (``worker_processes``), under
    this process's environment at the call. ``fn`` must be importable (a module-level function).
    ``timeout`` bounds the whole run; ``comm_timeout`` bounds each collective inside it;
    ``transport`` is passed to ``init`` (torch, shm or auto; None: only torch.distributed is
    initialised, as torchrun leaves a program that calls ``init_process_group``); ``host_ids`` gives each rank a host
    id (``MESHTRAIN_HOST_ID``), so that ``auto`` treats groups of ranks as hosts (shm inside, gloo
    between) on one machine.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=comm_timeout))
    # One pipe per child, not a multiprocessing.Queue: a Queue's named semaphores sit in /dev/shm
    # until the garbage collector finds the queue, which an exception's traceback can delay.
    pipes = [mp.Pipe(duplex=False) for _ in range(world_size)]
    procs = [worker_processes.start(_child, (r, world_size, store.port, backend, comm_timeout, check, fn, args,
                                             transport, None if host_ids is None else host_ids[r]),
                                    handles=(pipes[r][1],), name=f"meshtrain-rank{r}")
             for r in range(world_size)]
    for _, w in pipes:
        w.close()  # the children hold the write ends; EOF on a read end means that child is gone
    readers = {pipes[r][0]: r for r in range(world_size)}
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            ready = connection.wait(list(readers), timeout=0.2)
            if not ready:
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in out]
                    raise RankFailure(f"ranks {missing} did not finish within {timeout:g}s") from None
                continue
            conn = ready[0]
            try:
                rank, status, value = conn.recv()
            except EOFError:  # it exited without reporting
                r = readers[conn]
                procs[r].join(timeout=5)
                grace = min(deadline, time.monotonic() + DEATH_GRACE_S)
                for other in procs:  # the survivors get a moment to notice and report (or finish)
                    other.join(timeout=max(grace - time.monotonic(), 0))
                raise RankFailure(f"rank {r} died with exit code {procs[r].exitcode} "
                                  f"before reporting a result") from None
            del readers[conn]
            if status == "err":
                exc, tb = value
                if isinstance(exc, BaseException):
                    if exc.args and isinstance(exc.args[0], str):
                        exc.args = (f"[rank {rank}] {exc.args[0]}",) + exc.args[1:]
                    raise exc from RankFailure(f"rank {rank} failed:\n{tb}")
                raise RankFailure(f"rank {rank} failed:\n{tb}")
            out[rank] = _unpack(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for r, _ in pipes:
            r.close()
        del store
    return [out[r] for r in range(world_size)]
