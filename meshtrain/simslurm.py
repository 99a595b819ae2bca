"""A real Slurm cluster of simulated hosts on one machine, to run ``meshtrain launch --emit slurm``'s
scripts under ``sbatch`` in the tests.

``SimulatedSlurm(root, n_nodes)`` starts, all under ``root`` and all on 127.0.0.1:

* ``munged`` with a fresh key and its own socket (Slurm's ``AuthInfo=socket=...``);
* ``slurmctld`` in a UTS namespace whose hostname is the controller's name;
* one ``slurmd`` per node, each as ``simhosts`` makes a host: its own UTS namespace with the node's
  name as hostname, a private tmpfs on /dev/shm, its own port, spool directory, pid and log file.
  Every node's ``NodeAddr`` is 127.0.0.1; a hosts file naming every node as 127.0.0.1 is bind-mounted
  over /etc/hosts inside the nodes' mount namespaces only (the machine's own file is never touched),
  so the job script's ``scontrol show hostnames`` names, torchrun's and gloo's lookups resolve there.

Leaving the ``with`` block (or ``stop()``) cancels the jobs, kills every daemon (by its pid file,
and every process left in a node's namespace: job steps outlive their slurmd) and removes ``root``::

    with SimulatedSlurm(tmp_path / "slurm", 2) as cluster:
        job = cluster.sbatch(script, cwd=tmp_path, env=env)
        assert cluster.wait(job, 120)["JobState"] == "COMPLETED"

Needs root, util-linux's ``unshare``, and Debian's ``slurm-wlm`` and ``munge`` packages:
``unavailable()`` says why not, for ``pytest.skip``. The plugins are the ones that need nothing
of the machine (no cgroups, no accounting database): proctrack/linuxproc, task/none.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Mapping

from .simhosts import _UNSHARE, _alive, _ns, free_port, namespaces_unavailable

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun")
CONTROLLER = "simctld"  # slurmctld's hostname (it must match SlurmctldHost)
# a longer root (a deep pytest tmp_path under CI's temp dir) is replaced by a short one in /tmp: the
# daemons' Unix sockets live under it, and a socket's path is at most 108 bytes
MAX_ROOT = 48
# $1 hostname, $2 hosts file ('' for none), then the daemon's command line (exec'd: its pid is ours)
_WRAPPER = """
echo "$1" > /proc/sys/kernel/hostname || exit 125
mount -t tmpfs -o size=2g,mode=1777 simslurm-shm /dev/shm || exit 125
if [ -n "$2" ]; then mount --bind "$2" /etc/hosts || exit 125; fi
shift 2
exec "$@"
"""
_FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
             "PREEMPTED"}


def unavailable() -> str | None:
    """None if this machine can run a simulated Slurm, else the reason it cannot."""
    reason = namespaces_unavailable()
    if reason:
        return reason
    missing = [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return (f"a simulated Slurm needs {', '.join(missing)} (Debian: apt-get install -y slurm-wlm munge; "
                f".ci/run installs them)")
    return None


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmError(RuntimeError):
    """The simulated cluster did not come up, or a Slurm command failed; the message holds the logs."""


class SimulatedSlurm:
    """munged, slurmctld and ``n_nodes`` slurmd (``sim0``, ``sim1``, ...; ``cpus`` each) under ``root``
    (or, where its path is longer than ``MAX_ROOT``, a short directory in /tmp, removed by ``stop``).

    The daemons start in the constructor; once it returns, every node is idle. ``env()`` is the
    environment for Slurm's commands (``SLURM_CONF``); a job gets the submitter's environment.
    """

    def __init__(self, root: str | os.PathLike, n_nodes: int = 2, cpus: int = 2, start_timeout: float = 30.0) -> None:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.root = Path(root).resolve()
        if len(str(self.root)) > MAX_ROOT:  # munged's and slurmd's Unix sockets live under it: 108 bytes at most
            self.root = Path(tempfile.mkdtemp(prefix="meshtrain-slurm-", dir="/tmp"))
        self.nodes = [f"sim{k}" for k in range(n_nodes)]
        self.cpus = cpus
        self._procs: dict[str, subprocess.Popen] = {}
        self._mnt: dict[str, str | None] = {}  # each node's mount namespace, to find its job steps
        try:
            self._write_files()
            self._start(start_timeout)
        except BaseException:
            self.stop()
            raise

    # -- set-up -----------------------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        """The cluster's slurm.conf."""
        return self.root / "slurm.conf"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with ``SLURM_CONF`` pointing at the cluster."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def _write_files(self) -> None:
        r = self.root
        for d in ("munge", "ctld", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True, mode=0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (r / "hosts").write_text("127.0.0.1 localhost " + " ".join(self.nodes) + "\n")
        ports = [free_port() for _ in range(len(self.nodes) + 1)]
        lines = [
            "ClusterName=meshsim", f"SlurmctldHost={CONTROLLER}(127.0.0.1)", f"SlurmctldPort={ports[0]}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={r / 'ctld'}", f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            # nothing of the machine: no cgroups, no accounting database
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/builtin",
            # start a batch job at once, not after the default 3 s batch_sched_delay
            "SchedulerParameters=batch_sched_delay=0",
            # the declared CPUs need not be the machine's; a node that restarts comes back by itself
            "SlurmdParameters=config_overrides", "ReturnToService=2",
            # short waits: a cancelled step is SIGKILLed 2 s after SIGTERM; a finished job stays listed 5 min
            "KillWait=2", "MinJobAge=300", "MessageTimeout=10", "SlurmdTimeout=30", "InactiveLimit=0",
        ]
        for name, port in zip(self.nodes, ports[1:]):
            lines.append(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={name} Port={port} CPUs={self.cpus} "
                         f"State=UNKNOWN")
        lines.append(f"PartitionName=sim Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, hostname: str | None, argv: list[str], hosts: bool = False) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        cmd = argv if hostname is None else [*_UNSHARE, "sh", "-c", _WRAPPER, "simslurm", hostname,
                                              str(self.root / "hosts") if hosts else "", *argv]
        with log:
            self._procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                 env=self.env(), start_new_session=True)

    def _start(self, timeout: float) -> None:
        r, deadline = self.root, time.monotonic() + timeout
        m = r / "munge"
        self._spawn("munged", None, [_which("munged"), "-F", "--force", f"--socket={m / 'munge.socket'}",
                                     f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                                     f"--log-file={r / 'log' / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        self._await(lambda: (m / "munge.socket").exists(), deadline, "munged to open its socket")
        self._spawn("slurmctld", CONTROLLER, [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._await(lambda: self._scontrol("ping").returncode == 0, deadline, "slurmctld to answer")
        own = _ns(os.getpid())
        for name in self.nodes:
            self._spawn(name, name, [_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)], hosts=True)
        for name in self.nodes:  # unshare(2) runs just after exec: wait until the process has left our namespace
            p = self._procs[name]
            self._await(lambda: _ns(p.pid) != own or p.poll() is not None, deadline, f"{name} to unshare")
            self._mnt[name] = _ns(p.pid) if p.poll() is None else None
        self._await(self._all_idle, deadline, "every node to register idle")

    def _await(self, ready, deadline: float, what: str) -> None:
        while not ready():
            dead = [n for n, p in self._procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else "timed out"
                raise SlurmError(f"simulated Slurm: waiting for {what}: {why}\n{self.logs()}")
            time.sleep(0.05)

    def _all_idle(self) -> bool:
        r = self._run(["sinfo", "-h", "-N", "-o", "%N %t"])
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return r.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)

    # -- commands ---------------------------------------------------------------------------------

    def _run(self, argv: list[str], timeout: float = 15, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env())
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(argv, 124, "", f"{argv[0]} timed out after {exc.timeout}s")

    def _scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return self._run(["scontrol", *args])

    def sbatch(self, script: str | os.PathLike, cwd: str | os.PathLike, env: Mapping[str, str] | None = None) -> str:
        """Submit ``script`` from ``cwd`` with ``env`` (plus ``SLURM_CONF``) as the job's environment;
        returns the job id. ``SlurmError`` if sbatch refuses it."""
        r = self._run(["sbatch", "--parsable", str(script)], cwd=cwd, env=self.env(env))
        if r.returncode != 0:
            raise SlurmError(f"sbatch {script} failed (exit {r.returncode}): {r.stderr.strip()}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, NodeList, ...); {} if unknown."""
        r = self._scontrol("show", "job", "-o", job_id)
        if r.returncode != 0:
            return {}
        return dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)

    def wait(self, job_id: str, timeout: float, states: frozenset[str] | set[str] = frozenset(_FINISHED)
             ) -> dict[str, str]:
        """Poll until the job's state is one of ``states`` (default: finished); its fields. After
        ``timeout`` seconds the job is cancelled and ``TimeoutError`` raised with the logs."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                self.scancel(job_id)
                raise TimeoutError(f"job {job_id} still {info.get('JobState', 'unknown')} after {timeout:g}s; "
                                   f"cancelled\n{self.logs()}")
            time.sleep(0.1)

    def scancel(self, job_id: str) -> None:
        """Cancel the job (SIGTERM to its steps, SIGKILL ``KillWait`` seconds later)."""
        self._run(["scancel", job_id])

    def logs(self, chars: int = 2000) -> str:
        """The last ``chars`` characters of every daemon's log, for failure messages."""
        out = []
        for f in sorted((self.root / "log").glob("*")) if (self.root / "log").is_dir() else []:
            out.append(f"----- {f.name} -----\n{f.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    # -- tear-down --------------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Every live process of the cluster: the daemons (ours, and by pid file) and whatever runs in a
        node's mount namespace (slurmstepd and the job's processes, which outlive their slurmd)."""
        pids = {p.pid for p in self._procs.values() if p.poll() is None}
        for f in [self.root / "slurmctld.pid", self.root / "munge" / "munged.pid", *self.root.glob("slurmd-*.pid")]:
            try:
                pid = int(f.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if _alive(pid) and str(self.root) in _cmdline(pid):  # not a reused pid of someone else
                pids.add(pid)
        namespaces = {ns for ns in self._mnt.values() if ns is not None}
        if namespaces and any(p.poll() is None for n, p in self._procs.items() if n in self._mnt):
            # (only while a namespace's slurmd lives: a dead namespace's number is reused at once)
            for name in os.listdir("/proc"):
                if name.isdigit() and _ns(int(name)) in namespaces:
                    pids.add(int(name))
        return sorted(p for p in pids if _alive(p))

    def stop(self, keep: bool = False) -> None:
        """Cancel every job, kill every process of the cluster, wait for their end and remove
        ``root`` (unless ``keep``). Safe to call twice, and on a half-started cluster."""
        if self.conf.exists() and any(p.poll() is None for p in self._procs.values()):
            self._run(["scancel", "--full", "--quiet", "--user=root"], timeout=5)
        for _ in range(50):  # again until none is left: a step may fork while we look
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in self._procs.values():
                p.poll()
            time.sleep(0.05)
        for p in self._procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "SimulatedSlurm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
