"""The pieces under the shm transport: /dev/shm segments, process liveness, and the waiting policy.

Segments are plain files in /dev/shm opened with ``os.open`` (mode 0600) and mapped with ``mmap``,
not ``multiprocessing.shared_memory``: that class registers every segment with Python's
resource_tracker, which warns about, and unlinks, segments it believes leaked when any process
that merely attached to them exits. Every name starts with ``meshtrain.<pid of the owner>.``, so
whoever finds a name whose owner is dead (a survivor, or the next start) can remove it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import sys
import threading
import time
from typing import Callable, Iterable

import numpy as np
import torch

from .base import usable_cores

SHM_DIR = os.environ.get("MESHTRAIN_SHM_DIR", "/dev/shm")
PREFIX = "meshtrain."

# Waiting policy, measured on 2 cores with 2 and 4 ranks (docs/benchmarks.md, "Waiting"):
# spin for up to SPIN_S (a peer on another core answers within microseconds; adaptive, and off
# when ranks outnumber cores), then sched_yield until YIELD_S (hands the core to a runnable
# peer), then sleep in the kernel on the awaited counter (a futex its owner wakes), so a long
# wait costs no CPU. Without futexes (not Linux) the sleeps are timed, growing to MAX_SLEEP_S.
SPIN_S = float(os.environ.get("MESHTRAIN_SHM_SPIN_US", "50")) * 1e-6
_spin = [SPIN_S, SPIN_S]  # [current, cap]: halves after a wait spinning did not satisfy, doubles after a quick one
YIELD_S = float(os.environ.get("MESHTRAIN_SHM_YIELD_US", "200")) * 1e-6
MAX_SLEEP_S = 1e-3
LIVENESS_PERIOD_S = 0.05


def segment_path(name: str) -> str:
    """Absolute path of segment ``name``."""
    return os.path.join(SHM_DIR, name)


class Segment:
    """A file in /dev/shm mapped into this process (created by its owner, opened by peers)."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.mm = mm
        self.size = len(mm)
        self.owner = owner
        self.u8 = torch.frombuffer(mm, dtype=torch.uint8) if self.size else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        """Create ``name`` with ``size`` zero bytes, mode 0600; it appears complete or not at all."""
        path = segment_path(name)
        tmp = path + ".tmp"
        for stale in (tmp, path):  # same pid as ours: left by a dead process whose pid we reuse
            try:
                os.unlink(stale)
            except FileNotFoundError:
                pass
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            _reserve(fd, size, path)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        os.replace(tmp, path)  # atomic: a peer never maps a half-sized file
        return cls(name, mm, owner=True)

    @classmethod
    def open(cls, name: str) -> "Segment | None":
        """Map an existing segment; None if it does not exist (yet)."""
        try:
            fd = os.open(segment_path(name), os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def i64(self, offset: int, count: int) -> np.ndarray:
        """``count`` int64 counters at byte ``offset`` (numpy: a scalar load costs ~100 ns)."""
        return np.frombuffer(self.mm, dtype=np.int64, count=count, offset=offset)

    def unlink(self) -> None:
        """Remove the name (the mapping stays valid until every process drops it)."""
        try:
            os.unlink(segment_path(self.name))
        except FileNotFoundError:
            pass


def _reserve(fd: int, size: int, path: str) -> None:
    """Take the segment's pages now: a full /dev/shm then fails here with a message instead of
    killing the process with SIGBUS at its first write into a page tmpfs cannot supply."""
    if not hasattr(os, "posix_fallocate") or size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            return  # a file system without fallocate: pages come on first write, as before
        raise OSError(errno.ENOSPC, f"{SHM_DIR} is full: no room for the {size} bytes of {path}. Give "
                                    f"it more space (docker run --shm-size, or a larger tmpfs) or free some") from None


def free_bytes() -> int:
    """Bytes an unprivileged process may still put into SHM_DIR."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def alive(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie (a killed, not yet reaped child)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: existence only
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def list_segments() -> list[str]:
    """Names of every meshtrain segment in /dev/shm (of any process)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except OSError:
        return []


def segments_of(pids: Iterable[int]) -> list[str]:
    """Names of the meshtrain segments in /dev/shm owned by one of ``pids`` (a name starts with its
    owner's pid), so a check of one job's leftovers ignores other jobs sharing /dev/shm."""
    wanted = tuple(f"{PREFIX}{pid}." for pid in pids)
    return [n for n in list_segments() if n.startswith(wanted)] if wanted else []


def remove_segments_of(pids: Iterable[int]) -> list[str]:
    """Unlink every meshtrain segment owned by one of ``pids``; returns the names removed."""
    removed = []
    for name in segments_of(pids):
        try:
            os.unlink(segment_path(name))
            removed.append(name)
        except OSError:
            pass
    return removed


def remove_stale_segments() -> list[str]:
    """Unlink the segments of meshtrain processes that are gone (killed before they cleaned up)."""
    dead = set()
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    for name in names:
        if name.startswith(PREFIX):
            try:
                pid = int(name.split(".")[1])
            except (IndexError, ValueError):
                continue
            if pid != os.getpid() and not alive(pid):
                dead.add(pid)
    return remove_segments_of(dead) if dead else []


def block(done: Callable[[], bool], deadline: float | None, on_timeout: Callable[[], None],
          check_peers: Callable[[], None], sleep_on: Callable[[], tuple[int, int] | None] | None = None) -> None:
    """Wait until ``done()``: spin, then yield, then sleep (see SPIN_S). ``on_timeout`` raises once
    ``deadline`` (time.monotonic) passes; ``check_peers`` runs every LIVENESS_PERIOD_S while asleep
    and raises if a peer died, so a dead peer is reported long before the deadline. ``sleep_on``
    gives (address, expected low 32 bits) of a counter to sleep on in the kernel (a futex) until
    its owner bumps it and wakes us (``futex_wake``); without it the sleeps are timed."""
    t0 = time.monotonic()
    next_check = t0 + LIVENESS_PERIOD_S
    spin = _spin[0]
    while not done():
        now = time.monotonic()
        spent = now - t0
        if spent < spin:
            continue
        if deadline is not None and now >= deadline:
            on_timeout()
            return
        if spent < YIELD_S:
            os.sched_yield()
            continue
        if now >= next_check:
            check_peers()
            next_check = now + LIVENESS_PERIOD_S
        target = sleep_on() if sleep_on is not None and _futex is not None else None
        if target is None:
            time.sleep(min(MAX_SLEEP_S, spent / 16))
        elif target[0]:  # the timeout bounds a wake-up lost to a race (see ShmArea.publish)
            futex_wait(target[0], target[1], LIVENESS_PERIOD_S / 5)
    # Spinning pays only while the peer runs on another core; when ranks share cores (or another
    # job holds one) the peer cannot progress while we spin, so spin less after each miss.
    spent = time.monotonic() - t0
    _spin[0] = min(_spin[1], max(spin * 2, 1e-6)) if spent < max(spin, 20e-6) else spin / 2


def _load_futex() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux") or os.environ.get("MESHTRAIN_SHM_FUTEX", "1") == "0":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int]
        return fn
    except (OSError, AttributeError):
        return None


_futex = _load_futex()
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine, 202)
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not the _PRIVATE variants: the words live in shared mappings


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(addr: int, expected: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``expected`` (at most ``timeout`` s)."""
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    _futex(_SYS_FUTEX, addr, FUTEX_WAIT, ctypes.c_int32(expected & 0xFFFFFFFF).value, ctypes.byref(ts), None, 0)


def futex_wake(addr: int) -> None:
    """Wake every process sleeping in ``futex_wait`` on ``addr``."""
    if _futex is not None:
        _futex(_SYS_FUTEX, addr, FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (a locked instruction): orders a store before a later load, which
    x86 otherwise may reorder. Used between 'publish my counter' and 'is anyone asleep?'."""
    with _fence_lock:
        pass


def _store_fence() -> None:
    """Orders a store before a later store: x86 never reorders those (TSO), so there it is nothing."""


store_fence = _store_fence if platform.machine().lower() in ("x86_64", "amd64", "i686", "i386") else fence


def oversubscribed(ranks_here: int) -> None:
    """Turn spinning off when this host runs more ranks than this process may use cores."""
    if ranks_here > usable_cores():
        _spin[:] = [0.0, 0.0]
