"""A torch.distributed ProcessGroup (gloo on CPU, NCCL on GPU) as a meshtrain transport.

Point-to-point goes through the group's own send/recv (gloo matches same-tag messages in order).
``exchange`` goes through the group's TCPStore (``rendezvous.store_all_gather``: one key per rank,
one blocking multi_get, a timeout names the ranks whose key is absent). Each rank deletes its
previous key once everyone has posted the next one (3 round trips per exchange).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from ...errors import CollectiveError, LaunchError
from ..liveness import naming_bound
from ..work import Work
from .base import PeerTimeout, Transport, p2p_timeout
from .registry import Capabilities, Setup, TransportSpec, register
from .rendezvous import set_store_timeout, store_all_gather

_FOREVER = datetime.timedelta(days=365)


def _peer_failure(exc: BaseException, peer: int, what: str, liveness: Any = None) -> BaseException:
    text = str(exc)
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        return PeerTimeout(f"{what} rank {peer} timed out", [peer])
    # A closed connection says only that the peer is gone; the heartbeats say why: its error, or
    # which rank behind it was lost. Wait for them up to their loss bound, as a native collective's
    # closed connection does (runner.named_peer_loss): the peer may be a sibling that its agent
    # stopped because another rank of its host was killed, and only the heartbeats, once the killed
    # rank's beat is stale, name the one that was lost first.
    why = liveness.why(peer, wait=naming_bound()) if liveness is not None else None
    return CollectiveError(
        f"{what} rank {peer} failed: {text.splitlines()[0] if text else type(exc).__name__} "
        + (f"-- {why}" if why else f"(rank {peer} has probably exited or crashed; see its log)")
    )


class _TorchP2PWork(Work):
    def __init__(self, transport: "TorchTransport", work, peer: int, what: str, out: torch.Tensor | None) -> None:
        super().__init__(f"{what} rank {peer}")
        self._t, self._w, self._peer, self._what, self._out = transport, work, peer, what, out
        self._bound: float | None = None

    def bound(self, timeout: float, description: str) -> "_TorchP2PWork":
        """Make every wait end by ``timeout`` seconds, failing the work with a CollectiveTimeout
        that names ``description`` (a user's send/recv, ``p2p``): what ``p2p._TimedWork`` does for
        other transports, without a second Work and wait in the path. In a 2-rank ping-pong each
        layer there sits on both ranks' critical path and costs several times its own length."""
        self._bound, self.description = timeout, description
        return self

    def _progress(self, timeout: float | None) -> bool:
        if self._done.is_set():
            return True
        if timeout == 0 and not self._w.is_completed():
            return False
        bound = self._bound
        if bound is not None:
            timeout = bound if timeout is None else min(timeout, bound)
        try:
            with self._t.while_blocked():
                self._w.wait(_FOREVER if timeout is None else datetime.timedelta(seconds=timeout))
        except Exception as exc:  # gloo raises RuntimeError for timeouts and closed connections
            err = _peer_failure(exc, self._peer, self._what, self._t.liveness)
            if bound is not None and isinstance(err, PeerTimeout):
                err = p2p_timeout(self.description, bound, err)
            self._finish(exc=err)
            raise err from None
        self._finish(self._out)
        return True


class TorchTransport(Transport):
    """Wraps the default (or a given) torch.distributed process group and its store."""

    kind = "torch"

    def __init__(self, store: dist.Store, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._pg = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._store = dist.PrefixStore("meshtrain", store)
        self._owner = threading.get_ident()
        self._per_thread = threading.local()  # each thread's store connection and the timeout set on it
        self.backend = str(dist.get_backend(group))
        self._last_key: dict[str, str] = {}
        self._stale: list[str] = []  # keys whose deletion was deferred (``exchange(defer_delete=)``)
        # Entered around every blocking wait (gloo, the store): the shm transport that routes
        # other-host peers here sets it, to keep its own messages moving meanwhile.
        self.while_blocked: Callable[[], ContextManager[None]] = contextlib.nullcontext
        self.liveness: Any = None  # comm.init sets the heartbeat monitor (names why a peer is gone)

    @property
    def store(self) -> dist.Store:
        """This thread's connection to the store (the creating thread's is the one it was given).
        A TCPStore client has one socket, and a blocking read holds it: a data-parallel worker's
        metadata exchange waited behind the training thread's exchange of another group, on
        every rank at once, so both stayed blocked until the timeout (cross-host MoE with
        buckets reduced during backward). A thread of its own is a connection of its own."""
        s = getattr(self._per_thread, "store", None)
        if s is None:
            s = self._store if threading.get_ident() == self._owner else self._store.clone()
            self._per_thread.store, self._per_thread.timeout = s, None
        return s

    # The ProcessGroup's own send/recv: dist.isend's Python checks and logging wrappers cost
    # tens of microseconds per message, and an algorithm posts several messages per step.
    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        try:
            work = self._pg.send([tensor], dst, tag)
        except RuntimeError as exc:  # the connection to dst is already closed
            raise _peer_failure(exc, dst, "send to", self.liveness) from None
        return _TorchP2PWork(self, work, dst, "send to", tensor)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        try:
            work = self._pg.recv([tensor], src, tag)
        except RuntimeError as exc:
            raise _peer_failure(exc, src, "recv from", self.liveness) from None
        return _TorchP2PWork(self, work, src, "recv from", tensor)

    def exchange(self, key: str, ranks: Sequence[int], payload: str, timeout: float,
                 defer_delete: bool = False) -> list[str]:
        """All-gather ``payload`` through the store. ``defer_delete`` leaves the previous key's
        deletion (a round trip) to ``delete_stale``: the check beside a native op
        (runner._native_checked_beside) deletes after its verdict, off the op's critical path."""
        own = f"x/{key}/{self.rank}"
        try:
            store = self.store
            if self._per_thread.timeout != timeout:
                set_store_timeout(store, timeout)
                self._per_thread.timeout = timeout
            values = store_all_gather(store, f"x/{key}", self.rank, ranks, payload,
                                      blocked=self.while_blocked)
            # Once everyone posted this key, everyone has finished reading the previous one.
            group_prefix = key.rsplit("/", 1)[0]
            prev = self._last_key.get(group_prefix)
            self._last_key[group_prefix] = own
            if prev is not None:
                if defer_delete:
                    self._stale.append(prev)
                else:
                    self.store.delete_key(prev)
            return values
        except PeerTimeout:
            raise
        except Exception as exc:
            why = self.liveness.why(None) if self.liveness is not None else None
            raise CollectiveError(
                f"lost the rendezvous store while exchanging {key!r}: {exc} "
                + (f"-- {why}" if why else "(the store lives in the process of rank 0 or in the torchrun agent: is it alive?)")
            ) from None

    def delete_stale(self) -> None:
        """Delete the exchange keys left by deferred exchanges."""
        while self._stale:
            self.store.delete_key(self._stale.pop())

    def host_id(self) -> str:
        return host_identity()


def host_identity() -> str:
    """hostname + boot id: equal on two processes iff they run on one host (and can share
    /dev/shm). ``MESHTRAIN_HOST_ID`` overrides it, to simulate several hosts on one machine."""
    override = os.environ.get("MESHTRAIN_HOST_ID")
    if override:
        return override
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def connect_store(host: str, port: int, world_size: int, is_master: bool, timeout: float,
                  multi_tenant: bool = False) -> dist.TCPStore:
    """torch's TCPStore (server on the master rank, client elsewhere), given up on after ``timeout``.

    A client that reaches a program other than a store (something else holds MASTER_PORT) waits
    in torch's handshake with no timeout of its own, so the store is built on a daemon thread and
    abandoned, with an error naming the address, if it is not ready in time.
    """
    if not is_master:
        _await_listener(host, port, timeout)
    box: dict[str, object] = {}

    def build() -> None:
        try:
            box["store"] = dist.TCPStore(host, port, world_size, is_master=is_master,
                                         timeout=datetime.timedelta(seconds=timeout), multi_tenant=multi_tenant)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=build, name="meshtrain-store-connect", daemon=True)
    thread.start()
    thread.join(timeout + 5.0)  # torch's own connect retries time out at ``timeout``; allow it to say so first
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    if "store" not in box:
        rank = os.environ.get("RANK", "?")
        raise LaunchError(
            f"rank {rank} could not reach the rendezvous store at {host}:{port} (MASTER_ADDR:MASTER_PORT) within "
            f"{timeout:g}s: something answers on that port but it is not a torch.distributed store. Another program "
            f"probably holds the port: pick a free one (torchrun --master-port=PORT, or MASTER_PORT) or stop the "
            f"program that holds it")
    return box["store"]  # type: ignore[return-value]


def _await_listener(host: str, port: int, timeout: float) -> None:
    """Wait until something accepts TCP connections at host:port, or fail in one line naming it
    (torch's client would log a retry and a C++ stack for every attempt before its own timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 1.0), 0.05)).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"rank {os.environ.get('RANK', '?')} could not reach the rendezvous store at {host}:{port} "
                    f"(MASTER_ADDR:MASTER_PORT) within {timeout:g}s: nothing answers there. Check the address and "
                    f"port (torchrun --rdzv-endpoint / --master-addr / --master-port) and that the first host's agent "
                    f"(or rank 0) is running and reachable from this host") from None
            time.sleep(0.1)


_ROUND = [""]  # the store prefix of this process's elastic round ("" outside torchrun)


def round_prefix() -> str:
    """The store prefix every worker of this elastic round shares ("" when not under torchrun)."""
    return _ROUND[0]


def elastic_round(store: dist.Store, rank: int, world: int, timeout: float) -> int:
    """A number all workers of one torchrun round agree on, new for every round.

    TORCHELASTIC_RESTART_COUNT is not one: an agent whose workers were healthy restarts them
    without counting it when another host's agent restarts after a failure (a membership
    change), so the hosts' workers would disagree. Each rank instead bumps its own counter in
    the store once per start; a rank that lags (its predecessor died before getting here)
    catches up to the highest, and the round is the value once every rank's counter holds it.
    """
    keys = [f"meshtrain/round/{r}" for r in range(world)]
    store.add(keys[rank], 1)
    deadline = time.monotonic() + timeout
    while True:
        values = [store.add(k, 0) for k in keys]  # add 0 reads a counter (0 while absent)
        top = max(values)
        if values[rank] < top:
            store.add(keys[rank], top - values[rank])
        elif all(v == top for v in values):
            return top
        elif time.monotonic() > deadline:
            missing = [r for r, v in enumerate(values) if v < top]
            raise PeerTimeout(f"ranks {missing} never arrived at the start of elastic round {top}", missing,
                              never_arrived=True)
        else:
            time.sleep(0.01)


def init_torch_distributed(backend: str | None, timeout: float,
                           init_timeout: float | None = None) -> tuple[dist.Store, None]:
    """Initialise torch.distributed from torchrun's environment unless it already is.

    Returns the default store. Uses torch's own TCPStore; meshtrain has no store. ``init_timeout``
    (default ``timeout``) bounds reaching the store and the other ranks; ``timeout`` is the
    process group's, which bounds gloo's own collectives.
    """
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ValueError(
                f"meshtrain.comm.init() needs torchrun's environment but {', '.join(missing)} "
                "is not set: launch with `torchrun --nproc_per_node N script.py`, or use "
                "meshtrain.comm.run_local(world_size, fn) for ranks as threads"
            )
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        rank, world, host, port = _launch_env()
        # Under torchrun the agent hosts the store; otherwise rank 0 does (as env:// would).
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store: dist.Store = connect_store(host, port, world,
                                          is_master=not agent_store and rank == 0,
                                          timeout=timeout if init_timeout is None else init_timeout,
                                          multi_tenant=not agent_store)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # Under the elastic agent the store outlives a failed attempt: gloo would read the dead
            # workers' addresses from it and fail to connect. Key everything by the round.
            _ROUND[0] = f"meshtrain/round_{elastic_round(store, rank, world, init_timeout or timeout)}"
            store = dist.PrefixStore(_ROUND[0], store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store(), None


def _launch_env() -> tuple[int, int, str, int]:
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, checked at once so that a bad value fails in
    one line naming it on every host, not as a connect timeout or a traceback from the store."""
    def integer(name: str, lo: int, hi: int) -> int:
        raw = os.environ[name]
        try:
            value = int(raw)
        except ValueError:
            value = lo - 1
        if not lo <= value <= hi:
            raise LaunchError(f"{name}={raw!r} is not an integer in {lo}..{hi}: fix the launcher's "
                                  f"{'--master-port / --rdzv-endpoint' if name == 'MASTER_PORT' else name}")
        return value

    world = integer("WORLD_SIZE", 1, 1 << 24)
    rank = integer("RANK", 0, world - 1)
    port = integer("MASTER_PORT", 1, 65535)
    host = os.environ["MASTER_ADDR"]
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise LaunchError(
            f"MASTER_ADDR={host!r} does not resolve on {socket.gethostname()} ({exc.args[-1]}): torchrun's agents "
            f"advertise their hostname unless given an address, so where hostnames do not resolve give every "
            f"host's torchrun --local-addr ADDRESS (an address of that host the others can reach; 127.0.0.1 for "
            f"hosts simulated on one machine), or fix name resolution") from None
    return rank, world, host, port


def _build(setup: Setup) -> TorchTransport:
    """The transport of torch.distributed's default group (``init`` has initialised it)."""
    return TorchTransport(setup.store)


SPEC = register(TransportSpec(
    name=TorchTransport.kind, build=_build,  # cost_model: the registry's LINK_COSTS
    capabilities=Capabilities(native_collectives=True, cpu_only=False),
    algorithms=("native",),
    config_hint="comm.transport = 'torch', or 'auto' with nccl",
    # NCCL's collectives run on the GPU; meshtrain's own over NCCL's send/recv only add launches
    auto_backends=("nccl",),
))
