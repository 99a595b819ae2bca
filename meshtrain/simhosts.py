"""Several simulated hosts on one machine, to test meshtrain across hosts without a cluster.

Real hosts share neither a hostname nor /dev/shm, and ``meshtrain.comm`` tells hosts apart by
hostname + boot id (``transport.torchdist.host_identity``). Each simulated host here is one
``unshare --uts --mount --propagation private`` process that sets its own hostname (host0,
host1, ...), mounts a private tmpfs on /dev/shm and runs one ``torchrun`` agent; the agents meet
at a c10d rendezvous on 127.0.0.1. ``init(transport="auto")`` then uses shared memory inside a
simulated host and gloo between them, as it would across real hosts. Needs root (for mount) and
util-linux's ``unshare``: ``namespaces_unavailable()`` says why not, for ``pytest.skip``::

    with SimulatedHosts(2, 2, ["-m", "my.worker", "--steps=3"], tmp_path) as hosts:
        assert hosts.wait(120) == [0, 0], hosts.tails()
        assert hosts.shm_left(0) == []

``SimulatedHosts.commands`` runs a given command line on each host instead, with a given
environment (a cluster's launch command, with the variables its scheduler would set).

Things found while writing it:

* The simulated hostnames do not resolve, so each agent gets ``--local-addr 127.0.0.1`` (else
  MASTER_ADDR would be the unresolvable name), and gloo gets ``GLOO_SOCKET_IFNAME=lo`` (without
  it gloo warns and falls back to the loopback address itself).
* c10d ignores ``--node-rank``: it numbers agents by (address, pid), and every agent's address is
  127.0.0.1, so the host started first (almost always host0) gets global ranks 0..P-1.
  ``node_rank(k)`` reads what host k actually got.
* torchrun starts each worker in a session of its own, so a host's process group does not hold
  its workers. A host's processes are found by their mount namespace instead, which also finds
  workers whose agent was killed (they are re-parented outside the host's process tree), and by
  an environment variable every process of the host inherits: the kernel reuses a dead
  namespace's number at once, so the number alone could name someone else's processes later.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Mapping, Sequence

from .procfs import alive as _alive, children as _children, environ as _environ

# $1 hostname, $2 tmpfs size, $3 file for the /dev/shm listing, then the host's command line.
_WRAPPER = """
echo "$1" > /proc/sys/kernel/hostname || exit 125
mount -t tmpfs -o size="$2",mode=1777 simhost-shm /dev/shm || exit 125
left="$3"; shift 3
"$@"
rc=$?
ls -A /dev/shm > "$left.part" && mv "$left.part" "$left"
exit $rc
"""
_UNSHARE = ["unshare", "--uts", "--mount", "--propagation", "private"]


@functools.lru_cache(maxsize=1)
def namespaces_unavailable() -> str | None:
    """None if this machine can run simulated hosts, else the reason it cannot."""
    if not sys.platform.startswith("linux"):
        return f"simulated hosts need Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "simulated hosts need root: each mounts a private tmpfs on /dev/shm"
    if shutil.which("unshare") is None:
        return "simulated hosts need util-linux's `unshare`, which is not on PATH"
    probe = 'echo simprobe > /proc/sys/kernel/hostname && mount -t tmpfs simprobe /dev/shm && ' \
            'test "$(cat /proc/sys/kernel/hostname)" = simprobe && test -z "$(ls -A /dev/shm)"'
    try:
        r = subprocess.run([*_UNSHARE, "sh", "-c", probe], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`unshare` could not run: {exc}"
    if r.returncode != 0:
        return f"`unshare --uts --mount` failed here (rc {r.returncode}): {(r.stderr or r.stdout).strip()[:300]}"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:  # gone, or a zombie
        return None


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on ``port`` (IPv4 or IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


class SimulatedHosts:
    """``n_hosts`` simulated hosts, each one torchrun agent running ``worker`` on ``nproc`` ranks.

    ``worker`` is what follows torchrun's own options: ``["-m", "module", *args]`` or
    ``["script.py", *args]``. ``nproc`` is one count for every host or one per host. ``nnodes``
    is torchrun's ``--nnodes`` (default ``n_hosts``; ``"MIN:MAX"`` for an elastic job) and
    ``rdzv_conf`` adds c10d rendezvous settings to ``--rdzv-conf`` (``last_call_timeout``,
    ``keep_alive_interval``, ...). ``start_host(k)`` starts a killed host again, as a new agent
    that joins the same rendezvous (a host coming back to an elastic job). Host k
    writes ``host{k}.out`` / ``host{k}.err`` (its agent's and workers' output) and uses
    ``host{k}.tmp`` as TMPDIR, all in ``log_dir``. ``env`` is added to this process's
    environment (MESHTRAIN_HOST_ID is dropped from it: it would make every host look like one).
    The hosts start in the constructor; leaving the ``with`` block kills whatever is left.
    """

    def __init__(self, n_hosts: int, nproc: int | Sequence[int], worker: Sequence[str], log_dir: str | os.PathLike,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
                 max_restarts: int = 0, rdzv_timeout: int = 60, shm_size: str = "2g",
                 torchrun_args: Sequence[str] = (), nnodes: str | None = None,
                 rdzv_conf: Mapping[str, object] | None = None) -> None:
        self._setup(n_hosts, log_dir, cwd, shm_size)
        self._nnodes = nnodes or str(n_hosts)
        self._rdzv_conf = dict(rdzv_conf or {})
        self.nproc = [nproc] * n_hosts if isinstance(nproc, int) else list(nproc)
        if len(self.nproc) != n_hosts:
            raise ValueError(f"nproc has {len(self.nproc)} entries for {n_hosts} hosts")
        self._worker, self._extra = list(worker), list(torchrun_args)
        self._max_restarts, self._rdzv_timeout = max_restarts, rdzv_timeout
        env_all = {k: v for k, v in os.environ.items() if k != "MESHTRAIN_HOST_ID"}
        env_all.update({"GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", **(env or {})})
        own = _ns(os.getpid())
        for attempt in range(4):  # the port was free when picked; someone may take it before the agent binds it
            self.port = free_port()
            run_id = f"simhosts-{uuid.uuid4().hex[:8]}"
            self._launch([self._torchrun(k, run_id) for k in range(n_hosts)], [env_all] * n_hosts, run_id, own)
            if self._await_store() or attempt == 3:
                break
            self.kill_all()

    @classmethod
    def commands(cls, argvs: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]],
                 log_dir: str | os.PathLike, cwd: str | os.PathLike | None = None,
                 shm_size: str = "2g") -> "SimulatedHosts":
        """One simulated host per entry of ``argvs``: host k runs ``argvs[k]`` with exactly the
        environment ``envs[k]`` (nothing inherited from this process, so it must hold PATH), plus
        the host's own TMPDIR and its MESHTRAIN_SIMHOST mark, which the host needs. The commands
        choose their own rendezvous (``port`` is None, ``nproc`` []) and must use only loopback
        addresses, as the simulated hostnames do not resolve. Logs and the other methods are as
        for a constructed instance; ``agent_pid(k)`` is the command's process."""
        if len(envs) != len(argvs):
            raise ValueError(f"{len(envs)} environments for {len(argvs)} commands")
        self = cls.__new__(cls)
        self._setup(len(argvs), log_dir, cwd, shm_size)
        self.nproc, self.port = [], None
        self._launch([list(a) for a in argvs], [dict(e) for e in envs], f"simhosts-{uuid.uuid4().hex[:8]}",
                     _ns(os.getpid()))
        return self

    # -- start-up ---------------------------------------------------------------------------------

    def _setup(self, n_hosts: int, log_dir: str | os.PathLike, cwd: str | os.PathLike | None,
               shm_size: str) -> None:
        """What every form needs: the check that hosts can run here, the log directory, no hosts yet."""
        reason = namespaces_unavailable()
        if reason:
            raise RuntimeError(reason)
        self.n = n_hosts
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._cwd = os.fspath(cwd) if cwd is not None else None
        self._shm_size = shm_size
        self._procs: list[subprocess.Popen] = []
        self._mnt: list[str | None] = []  # each host's mount namespace
        self._marks: list[bytes] = []  # each host's environment mark

    def _torchrun(self, k: int, run_id: str) -> list[str]:
        """Host k's torchrun agent: c10d rendezvous on 127.0.0.1:port, then the worker."""
        # host0's agent holds the rendezvous store, as on a real cluster's first host
        conf = {"is_host": int(k == 0), "join_timeout": self._rdzv_timeout, **self._rdzv_conf}
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", self._nnodes,
                "--nproc-per-node", str(self.nproc[k]), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", run_id,
                "--rdzv-conf", ",".join(f"{key}={value}" for key, value in conf.items()),
                "--local-addr", "127.0.0.1", "--max-restarts", str(self._max_restarts),
                "--monitor-interval", "0.2", *self._extra, *self._worker]

    def _launch(self, argvs: list[list[str]], envs: list[dict[str, str]], run_id: str, own_ns: str | None) -> None:
        """Start host k running ``argvs[k]`` with ``envs[k]`` in its own namespaces."""
        self._procs, self._mnt, self._marks = [], [], []
        self._argvs, self._envs, self._run_id, self._own_ns = argvs, envs, run_id, own_ns
        for k in range(self.n):
            self._procs.append(self._spawn(k, f"{run_id}-host{k}"))
            self._marks.append(f"MESHTRAIN_SIMHOST={run_id}-host{k}".encode())
        self._mnt = [self._left_namespace(p) for p in self._procs]

    def _spawn(self, k: int, mark: str, append: bool = False) -> subprocess.Popen:
        """Host k's wrapper process (``append``: add to its logs, as a host started again does)."""
        tmp = self.log_dir / f"host{k}.tmp"
        tmp.mkdir(exist_ok=True)
        self._shm_file(k).unlink(missing_ok=True)
        mode = "ab" if append else "wb"
        # the mark is inherited by every process of the host: see _host_pids
        with open(self.log_dir / f"host{k}.out", mode) as out, open(self.log_dir / f"host{k}.err", mode) as err:
            return subprocess.Popen(
                [*_UNSHARE, "sh", "-c", _WRAPPER, "simhost", f"host{k}", self._shm_size,
                 str(self._shm_file(k)), *self._argvs[k]],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=self._cwd,
                env={**self._envs[k], "TMPDIR": str(tmp), "MESHTRAIN_SIMHOST": mark}, start_new_session=True)

    def _left_namespace(self, p: subprocess.Popen) -> str | None:
        """``p``'s mount namespace once it has left ours (unshare(2) runs just after exec)."""
        deadline = time.monotonic() + 10
        while (ns := _ns(p.pid)) == self._own_ns and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return ns if ns != self._own_ns else None

    def start_host(self, k: int) -> None:
        """Start host k again after it was killed: the same command line (for a torchrun host, a new
        agent joining the same rendezvous, as a repaired machine rejoins an elastic job), in fresh
        namespaces with a fresh /dev/shm; its output is appended to its logs."""
        if self._procs[k].poll() is None:
            raise RuntimeError(f"host{k} is still running; kill_host({k}) first")
        self._starts = getattr(self, "_starts", {})
        self._starts[k] = self._starts.get(k, 0) + 1
        mark = f"{self._run_id}-host{k}-start{self._starts[k]}"  # a new mark: the old one may name leftovers
        self._procs[k] = self._spawn(k, mark, append=True)
        self._marks[k] = f"MESHTRAIN_SIMHOST={mark}".encode()
        self._mnt[k] = self._left_namespace(self._procs[k])

    def _await_store(self, timeout: float = 60.0) -> bool:
        """Wait until host0's agent listens on the rendezvous port; False if it failed because
        the port was taken (the caller retries on another)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            agent = self.agent_pid(0)
            if agent is not None and _listening_inodes(self.port) & _socket_inodes(agent):
                return True
            if self._procs[0].poll() is not None:
                text = self.log(0).lower()
                return not ("address already in use" in text or "eaddrinuse" in text)
            time.sleep(0.05)
        return True  # not seen listening: let wait() report whatever happened

    # -- inspection -------------------------------------------------------------------------------

    def _shm_file(self, k: int) -> Path:
        return self.log_dir / f"host{k}.shm-left"

    def _host_pids(self, k: int) -> list[int]:
        """Every live process of host k: its wrapper (our child, so its pid cannot be reused while
        unreaped), and every process in its mount namespace that carries its environment mark."""
        pids = {self._procs[k].pid} if self._procs[k].poll() is None else set()
        if self._mnt[k] is not None:
            for name in os.listdir("/proc"):
                if name.isdigit() and _ns(int(name)) == self._mnt[k] and self._marks[k] in _environ(int(name)):
                    pids.add(int(name))
        return sorted(pids)

    def agent_pid(self, k: int) -> int | None:
        """The pid of host k's torchrun agent (the wrapper's child), or None once it is gone."""
        kids = _children(self._procs[k].pid) if self._procs[k].poll() is None else []
        return kids[0] if kids else None

    def worker_pids(self, k: int) -> list[int]:
        """The pids of host k's torchrun workers (the agent's children); [] before they start."""
        agent = self.agent_pid(k)
        return _children(agent) if agent is not None else []

    def node_rank(self, k: int) -> int | None:
        """The node rank host k got in the rendezvous (GROUP_RANK of its workers), once they run."""
        for pid in self.worker_pids(k):
            for item in _environ(pid):
                if item.startswith(b"GROUP_RANK="):
                    return int(item[11:])
        return None

    def log(self, k: int) -> str:
        """Host k's output so far: its stdout, then its stderr."""
        parts = [(self.log_dir / f"host{k}.{s}").read_text(errors="replace") for s in ("out", "err")]
        return parts[0] + parts[1]

    def tails(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of every host's log, for failure messages."""
        return "\n".join(f"----- host{k} (last {chars} chars) -----\n{self.log(k)[-chars:]}" for k in range(self.n))

    def shm_left(self, k: int) -> list[str]:
        """What host k's private /dev/shm held after its torchrun exited (the wrapper lists it).
        Raises FileNotFoundError if the host was killed before it could list it."""
        return self._shm_file(k).read_text().split()

    # -- control ----------------------------------------------------------------------------------

    def wait(self, timeout: float) -> list[int]:
        """Every host's exit code (torchrun's; -9 for a killed host) once all have exited. After
        ``timeout`` seconds everything is killed and TimeoutError raised with the logs' tails."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self._procs):
            if time.monotonic() > deadline:
                running = [k for k, p in enumerate(self._procs) if p.poll() is None]
                tails = self.tails()
                self.kill_all()
                raise TimeoutError(f"simulated hosts {running} still ran after {timeout:g}s; killed.\n{tails}")
            time.sleep(0.1)
        return [p.returncode for p in self._procs]

    def kill_agent(self, k: int) -> int:
        """SIGKILL host k's torchrun agent only (its workers live on); returns its pid."""
        pid = self.agent_pid(k)
        if pid is None:
            raise ProcessLookupError(f"host{k} has no running torchrun agent")
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_host(self, k: int) -> None:
        """SIGKILL every process of host k, as if the machine lost power; returns once all are dead."""
        killed: set[int] = set()
        for _ in range(100):  # again until none is left: a process may fork while we look
            pids = self._host_pids(k)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            self._procs[k].poll()
            time.sleep(0.02)
        # A dying process leaves its namespace before it is a zombie: wait for the end of each.
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in killed) and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            self._procs[k].wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass

    def kill_all(self) -> None:
        """Kill every host."""
        for k in range(len(self._procs)):
            self.kill_host(k)

    def __enter__(self) -> "SimulatedHosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
