"""One rank's view of a world: its transport, groups, monitor, and the default-binding rules."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from .algorithms.base import BufferPool
from .deadlock import WaitState
from .monitor import Monitor
from .transport.base import Transport, capabilities, on_shared_memory
from .work import Work

MAX_GROUPS = 1024  # group ids are packed into p2p tags


class _GroupWork(Work):
    """An async collective's handle: a thread blocked in its wait counts as its rank being blocked
    for the deadlock check (comm/deadlock.py); a rank whose async calls are only in flight may
    still be computing, and issue the calls its peers wait for."""

    def __init__(self, description: str, monitor: Monitor) -> None:
        super().__init__(description)
        self._monitor = monitor

    def _progress(self, timeout: float | None) -> bool:
        if timeout == 0 or self._done.is_set():
            return super()._progress(timeout)
        with self._monitor.waiting():
            return super()._progress(timeout)


class Group:
    """An ordered set of global ranks that run collectives together (like a ProcessGroup).

    Every rank of the world creates every group, in the same order, so group ids agree. A rank
    outside the group holds a Group with ``rank == -1`` and may not call collectives on it.
    """

    def __init__(self, comm: "Communicator", gid: int, ranks: Sequence[int], timeout: float,
                 torch_group: Any = None) -> None:
        self.comm = comm
        self.gid = gid
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(comm.rank) if comm.rank in self.ranks else -1
        self.timeout = timeout
        self.torch_group = torch_group
        self.pool = BufferPool()
        self.cost_model: Any = None  # fitted lazily by meshtrain.comm.select
        self.board: Any = None  # the check board (comm/check_board.py), built on the first checked call
        self.board_built = False
        self.board_usable: bool | None = None  # check_board.checks_first, asked once
        self._hosts: list[str] | None = None
        self._shared: bool | None = None
        self.choices: dict[tuple, str] = {}  # select.choose's answers, by call and inputs
        self.tuner: Any = None  # online selection (comm/tune.py): made on the first auto call, False if off
        self._seq = 0
        self._cal_seq = 0
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._last: Work | None = None

    def __repr__(self) -> str:
        return f"Group(id={self.gid}, ranks={self.ranks}, rank={self.rank})"

    @property
    def hosts(self) -> list[str]:
        """Host id of each group rank."""
        if self._hosts is None:  # asked on every call; the world's hosts never change
            self._hosts = [self.comm.hosts[r] for r in self.ranks]
        return self._hosts

    @property
    def on_shared_memory(self) -> bool:
        """True if the group's ranks share this host's memory on a transport with shared buffers."""
        if self._shared is None:
            self._shared = on_shared_memory(self.comm.transport, self.ranks)
        return self._shared

    def next_seq(self) -> int:
        """Sequence number of the next collective on this group (same on every member)."""
        with self._lock:
            self._seq += 1
            return self._seq

    def group_rank(self, global_rank: int) -> int:
        """Position of a global rank in this group; ValueError if it is not a member."""
        if global_rank not in self.ranks:
            raise ValueError(f"rank {global_rank} is not in group {self.gid} (ranks {self.ranks})")
        return self.ranks.index(global_rank)

    def check_root(self, root: int, what: str = "root") -> int:
        """Validate a root given as a global rank; return its group rank."""
        if not isinstance(root, int) or root not in self.ranks:
            raise ValueError(
                f"invalid {what} {root!r}: it must be a global rank of group {self.gid}, "
                f"one of {self.ranks}"
            )
        return self.ranks.index(root)

    def submit(self, fn: Callable[[], Any], description: str) -> Work:
        """Run ``fn`` on this group's worker thread, after every earlier async op of the group."""
        work = _GroupWork(description, self.comm.monitor)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"meshtrain-g{self.gid}")
            self._last = work

        def run() -> None:
            try:
                work._finish(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                work._finish(exc=exc)

        self._executor.submit(run)
        return work

    def drain(self) -> None:
        """Wait until every async op submitted on this group has finished (errors stay in their Work)."""
        last = self._last
        if last is not None and not last._done.is_set():
            with self.comm.monitor.waiting():  # blocked, for the deadlock check
                last._done.wait()

    def close(self) -> None:
        """Stop the worker thread and drop the check board."""
        if self.board is not None:
            self.board.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class Communicator:
    """A rank's transport plus its groups, monitor and settings; the world is group 0."""

    def __init__(self, transport: Transport, *, timeout: float = 300.0, check: bool = True,
                 hosts: Sequence[str] | None = None, flight_recorder: int = 256,
                 torch_world: Any = None, node_size: int | None = None) -> None:
        self.transport = transport
        self.node_size = node_size  # hierarchical algorithm: ranks per node (None: by host)
        # What algorithm="auto" resolves to where this name is valid for the op and group (see
        # select.preferred); None: the cost model. Every rank must set it alike (the metadata
        # check names the ranks whose algorithms then differ).
        self.preferred_algorithm: str | None = None
        # Whether auto learns from its calls (comm/tune.py): None = MESHTRAIN_AUTO_TUNE, else on for
        # process transports other than NCCL. Every rank must set it alike.
        self.tune: bool | None = None
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.timeout = timeout
        self.check = check
        self.monitor = Monitor(self.rank, flight_recorder)
        if hosts is None:
            hosts = transport.exchange("hosts", list(range(self.world_size)), transport.host_id(), timeout)
        self.hosts = list(hosts)
        self.world = Group(self, 0, range(self.world_size), timeout, torch_world)
        self.groups: list[Group] = [self.world]
        self.liveness: Any = None  # the heartbeat monitor of a process world (comm.init)
        # init_process_group: every group also gets its torch.distributed twin, so that the
        # program's torch.distributed calls (and its libraries') on those groups stay valid.
        self.torch_twins = False
        self._check_thread: ThreadPoolExecutor | None = None
        self._check_lock = threading.Lock()

    def wait_state(self) -> WaitState:
        """What this rank waits for now (``deadlock.WaitState``): its calls in flight, the calls it
        has issued on each of its groups, the seconds since it last completed one."""
        return self.monitor.wait_state({g.gid: g._seq for g in list(self.groups) if g.rank >= 0})

    def check_thread(self) -> ThreadPoolExecutor:
        """The thread that runs metadata checks beside native ops (``runner``), made on first use."""
        with self._check_lock:
            if self._check_thread is None:
                self._check_thread = ThreadPoolExecutor(1, thread_name_prefix="meshtrain-check")
            return self._check_thread

    def new_group(self, ranks: Sequence[int] | None = None, timeout: float | None = None) -> Group:
        """Create a group of global ``ranks`` (all ranks of the world must call this, in order)."""
        if ranks is None:
            ranks = list(range(self.world_size))
        ranks = list(ranks)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.world_size]
        if not ranks or bad or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"invalid group ranks {ranks}: give distinct ranks in 0..{self.world_size - 1}"
                + (f" ({bad} out of range)" if bad else "")
            )
        if len(self.groups) >= MAX_GROUPS:
            raise ValueError(f"too many groups: meshtrain.comm supports at most {MAX_GROUPS}")
        torch_group = None
        if capabilities(self.transport).native_collectives or self.torch_twins:  # torch's own group
            import torch.distributed as dist

            torch_group = dist.new_group(sorted(ranks))
        g = Group(self, len(self.groups), ranks, timeout or self.timeout, torch_group)
        self.groups.append(g)
        return g

    def close(self) -> None:
        """Stop worker threads and close the transport."""
        for g in self.groups:
            g.close()
        if self._check_thread is not None:
            self._check_thread.shutdown(wait=False, cancel_futures=True)
            self._check_thread = None
        self.transport.close()


class _Helper(threading.local):
    on = False  # a class default: a thread not marked is its rank's own


_helper = _Helper()


def mark_helper_thread() -> None:
    """Mark the calling thread as a helper of its rank (data parallelism's bucket worker): a call
    it is blocked in does not make the rank count as blocked for the deadlock check
    (comm/deadlock.py), since the rank's own thread may be computing meanwhile and issue later
    the very calls its peers wait for."""
    _helper.on = True


def on_helper_thread() -> bool:
    """True on a thread ``mark_helper_thread`` marked."""
    return _helper.on


class _ThreadComm(threading.local):
    comm: "Communicator | None" = None  # a class default: a miss costs no AttributeError


_thread = _ThreadComm()
_process: dict[str, Communicator | None] = {"comm": None}


def current() -> Communicator:
    """The communicator bound to this thread (run_local) or this process (init)."""
    comm = _thread.comm or _process["comm"]
    if comm is None:
        raise RuntimeError(
            "meshtrain.comm is not initialised: call meshtrain.comm.init() in each process "
            "(under torchrun), or run your function with meshtrain.comm.run_local(world_size, fn)"
        )
    return comm


def bind_thread(comm: Communicator | None) -> None:
    """Make ``comm`` the default communicator of the calling thread."""
    _thread.comm = comm


def bind_process(comm: Communicator | None) -> None:
    """Make ``comm`` the default communicator of the process."""
    _process["comm"] = comm
