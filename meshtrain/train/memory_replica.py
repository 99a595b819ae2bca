"""Each rank's last step state kept in host memory, on its own host and on a peer host, so an elastic
restart after a crash resumes from there instead of the last disk checkpoint (Gemini, SOSP'23).

With ``[elastic] enabled = true`` and ``memory_every = K`` (default 1), after every K-th step each
rank snapshots its checkpoint shard (the pieces ``save_checkpoint`` writes for it: ``collect_pieces``,
copied) and a background thread writes it, in the checkpoint's own shard format, to a directory
of its host's ``/dev/shm`` (tmpfs: it outlives the worker process, not the host) and sends it over
a gloo group of its own to a rank of the next host (host h -> h + 1 mod hosts, the same local
index), which keeps it in its host's ``/dev/shm``. One host lost loses no rank's shard: the ranks
that ran there have their copy on the next host, the others kept theirs.

Layout, per host: ``/dev/shm/meshtrain-mem-<run id>/g<start>-w<world>/step-N/rank-R/``
(``rank-R.safetensors``, ``rank-R.json``, rank 0's ``meta.json``). The run id is made once per run
directory (``RUN_DIR/elastic/replicas-id``), so a new run in a directory emptied by hand never
resumes an older run's replicas. ``g...`` is one world's generation (its rank numbers mean nothing
to another world); a rank's directory appears by a rename once complete. At the next step boundary
the ranks report the newest step they finished in the all-reduce that already carries the stop
flag (``elastic.agree_at_boundary``); only steps older than the newest one every rank finished are
removed, so the newest complete step (and the one being written) is kept. The copy of step N runs
while step N + 1 trains, and no rank starts step N + 2 before every rank has finished it: a crash
replays one step at most (two if it strikes at a step boundary while a copy is still in flight).

On (re)start every rank lists what its host holds; the ranks all-gather the lists and take the
newest step newer than the latest disk checkpoint for which every rank of its world survived
somewhere (``choose``). Its holders copy the shards into ``step-N.tmp`` of the checkpoint dir and
rank 0 commits it as an ordinary checkpoint (``commit_shards``), which the usual resharding load
then reads. Otherwise (none complete, or the copy fails) the disk checkpoint is loaded. Then the
old generations are removed. A run that ends (or stops on SIGTERM, with a checkpoint) removes its
directory on every host; a crashed, abandoned job leaves it (``rm -rf /dev/shm/meshtrain-mem-*``).

``MESHTRAIN_REPLICA_DIR`` replaces ``/dev/shm`` (tests). Ranks as threads keep the local copy only.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import secrets
import shutil
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .. import comm
from ..errors import CheckpointError
from ..files import write_atomic
from .checkpoint import agree_or_raise, checkpoint_meta, collect_pieces, commit_shards, latest_checkpoint
from .checkpoint_io import STEP_RE, step_dir_name, to_json, write_durable, write_rank_shard

PREFIX = "meshtrain-mem-"
"""The name of a run's replica directory in /dev/shm starts so (``tests/conftest.py`` looks for it)."""
META = "meta.json"
"""Rank 0's replica holds metadata.json less the shards' part (``checkpoint_meta``)."""
ID_FILE = "elastic/replicas-id"
"""The run directory's file naming its replica directories (``run_id``)."""
_GEN = re.compile(r"^g([0-9a-f]+)-w(\d+)$")
_RANK = re.compile(r"^rank-(\d{5,})$")
_FILE = re.compile(r"^(rank-\d{5,}\.(safetensors|json)|meta\.json)$")



def run_id(run_dir: str | os.PathLike) -> str:
    """The run's replica id, made by its first world and kept in ``RUN_DIR/elastic/replicas-id``: a
    new run in a directory emptied by hand gets a new one, so it never resumes another run's replicas."""
    path = Path(run_dir) / ID_FILE
    with contextlib.suppress(OSError):
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, secrets.token_hex(6))
    return path.read_text().strip()


def replica_dir(rid: str, base: str | None = None) -> Path:
    """This host's replica directory of the run whose ``run_id`` is ``rid``, in ``base`` (default
    ``MESHTRAIN_REPLICA_DIR`` or /dev/shm)."""
    return Path(base or os.environ.get("MESHTRAIN_REPLICA_DIR") or "/dev/shm") / f"{PREFIX}{rid}"


def ring_partners(hosts: Sequence[str]) -> dict[int, int]:
    """{rank: the rank of the next host it sends its copy to}: host h's i-th rank -> host h + 1's
    (i mod its ranks)-th, hosts in the order of their first rank; {} on one host (no peer)."""
    order = list(dict.fromkeys(hosts))
    if len(order) < 2:
        return {}
    ranks = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    out = {}
    for r, h in enumerate(hosts):
        nxt = ranks[order[(order.index(h) + 1) % len(order)]]
        out[r] = nxt[ranks[h].index(r) % len(nxt)]
    return out


# -- what a host holds, and the step to resume from ----------------------------------------------


def inventory(host_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """What ``host_dir`` holds: one ``{"gen", "world", "step", "ranks"}`` per generation and step,
    ``ranks`` the complete rank directories (a rank being written is a ``.rank-R.tmp``, skipped)."""
    out = []
    root = Path(host_dir)
    for g in sorted(root.iterdir()) if root.is_dir() else []:
        m = _GEN.match(g.name)
        for s in sorted(g.iterdir()) if m and g.is_dir() else []:
            n = STEP_RE.match(s.name)
            ranks = sorted(int(k.group(1)) for k in map(_RANK.match, os.listdir(s)) if k) if n else []
            if ranks:
                out.append({"gen": g.name, "world": int(m.group(2)), "step": int(n.group(1)), "ranks": ranks})
    return out


def choose(reports: Sequence[Mapping[str, Any]], disk_step: int) -> dict[str, Any] | None:
    """The step to resume from memory: the newest step newer than ``disk_step`` for which every
    rank of the world that wrote it survived in some host's memory (``reports``: each new rank's
    ``inventory``, under ``"holdings"``); ties go to the newer generation. None: resume from disk."""
    union: dict[tuple[str, int, int], set[int]] = {}
    for rep in reports:
        for h in rep["holdings"]:
            union.setdefault((h["gen"], int(h["world"]), int(h["step"])), set()).update(h["ranks"])
    done = [(step, gen, world) for (gen, world, step), ranks in union.items()
            if step > disk_step and ranks >= set(range(world))]
    if not done:
        return None
    step, gen, world = max(done)
    return {"gen": gen, "world": world, "step": step}


def holders(reports: Sequence[Mapping[str, Any]], choice: Mapping[str, Any]) -> dict[int, int]:
    """{old rank: the new rank that copies its shard}: one of the ranks whose host holds it,
    spread by old rank (every rank computes the same from the same reports)."""
    out = {}
    for old in range(choice["world"]):
        cands = [new for new, rep in enumerate(reports) if any(
            h["gen"] == choice["gen"] and h["step"] == choice["step"] and old in h["ranks"] for h in rep["holdings"])]
        out[old] = cands[old % len(cands)]
    return out


def all_gather_json(obj: Any, device: torch.device | str = "cpu") -> list[Any]:
    """Collective over the world: every rank's ``obj`` (JSON), in rank order; nothing unpickled."""
    data = json.dumps(obj).encode()
    words = torch.zeros((len(data) + 7) // 8, dtype=torch.int64)
    words.view(torch.uint8)[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    world = comm.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    comm.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
    n = max(int(s) for s in sizes)
    outs = [torch.zeros((n + 7) // 8, dtype=torch.int64, device=device) for _ in range(world)]
    padded = torch.zeros((n + 7) // 8, dtype=torch.int64)
    padded[:words.numel()] = words
    comm.all_gather(outs, padded.to(device))
    return [json.loads(o.cpu().view(torch.uint8)[:int(s)].numpy().tobytes()) for o, s in zip(outs, sizes)]


# -- a rank's replica as one buffer (the peer copy) ------------------------------------------------


def pack_dir(path: str | os.PathLike) -> torch.Tensor:
    """A rank directory's files as one uint8 tensor: u64 header length, JSON ``{"files": [[name,
    size], ...]}``, then the bytes (read straight into the tensor)."""
    names = sorted(os.listdir(path))
    sizes = [os.path.getsize(os.path.join(path, n)) for n in names]
    head = json.dumps({"files": [[n, s] for n, s in zip(names, sizes)]}).encode()
    buf = torch.empty(8 + len(head) + sum(sizes), dtype=torch.uint8)
    view = memoryview(buf.numpy())
    view[:8 + len(head)] = struct.pack("<Q", len(head)) + head
    at = 8 + len(head)
    for n, s in zip(names, sizes):
        with open(os.path.join(path, n), "rb") as f:
            if f.readinto(view[at:at + s]) != s:
                raise CheckpointError(f"replica file {path}/{n} changed while it was read")
        at += s
    return buf


def unpack_dir(buf: torch.Tensor, path: str | os.PathLike) -> None:
    """Write ``pack_dir``'s buffer as files into ``path``; only replica file names are accepted."""
    view = memoryview(buf.numpy())
    (n,) = struct.unpack("<Q", view[:8])
    at = 8 + n
    for name, size in json.loads(bytes(view[8:at]))["files"]:
        if not _FILE.match(name):
            raise CheckpointError(f"a peer sent a replica file named {name!r}, which is not a shard, sidecar or "
                                  f"{META}; is another program using the replica group?")
        with open(os.path.join(path, name), "wb") as f:
            f.write(view[at:at + size])
        at += size


# -- the keeper ------------------------------------------------------------------------------------


class MemoryReplicas:
    """One rank's part: snapshots at step boundaries, the background writes and sends, the restore
    at start-up and the clean-up at the end. Construction is collective (an all-gather of what each
    host holds; across hosts, a gloo group). ``base``: where the host's memory is (/dev/shm)."""

    def __init__(self, run_dir: str | os.PathLike, ckpt_root: str | os.PathLike, every: int, model: Any,
                 device: torch.device | str = "cpu", timeout_s: float = 300.0, base: str | None = None) -> None:
        self.every, self.model, self.device = every, model, device
        self.rank, self.world = comm.get_rank(), comm.get_world_size()
        hosts = list(comm.current().hosts)
        self.first_on_host = hosts.index(hosts[self.rank]) == self.rank
        first = all_gather_json({"id": run_id(run_dir) if self.rank == 0 else None, "gen": f"g{time.time_ns():x}"},
                                device)[0]  # rank 0's: the run's id, and its start names this world's generation
        self.dir, self.gen = replica_dir(first["id"], base), f"{first['gen']}-w{self.world}"
        # peers only where the world is a torch.distributed one (ranks as threads share one memory)
        procs = dist.is_available() and dist.is_initialized() and dist.get_world_size() == self.world
        partners = ring_partners(hosts) if procs else {}
        self.partner = partners.get(self.rank)
        self.sources = sorted(r for r, p in partners.items() if p == self.rank)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) if partners \
            else None  # its own connections: the copies never queue behind (or among) training's collectives
        disk = latest_checkpoint(str(ckpt_root))
        self.reports = all_gather_json({"holdings": inventory(self.dir),
                                        "disk": int(STEP_RE.match(Path(disk).name).group(1)) if disk else 0}, device)
        self.restored: int | None = None
        self.done, self.error, self.off = 0, None, False
        # the cost: seconds of the training thread (snapshots, waits) and of the background copies
        self.stats = {"snapshots": 0, "main_s": 0.0, "background_s": 0.0, "bytes": 0}
        self._thread: threading.Thread | None = None

    # -- start-up ------------------------------------------------------------------------------

    def restore(self, ckpt_root: str | os.PathLike, keep: int, use: bool = True) -> int | None:
        """Collective. With ``use``, materialise the newest complete in-memory step newer than the
        latest disk checkpoint as a committed checkpoint in ``ckpt_root`` (so ``latest`` names it)
        and return its step; None: resume from disk. Then remove the older generations."""
        choice = choose(self.reports, int(self.reports[0]["disk"])) if use else None
        if choice is not None:
            try:
                self._materialise(str(ckpt_root), choice, keep)
                self.restored = choice["step"]
            except CheckpointError as exc:  # raised on every rank alike (agree_or_raise): all go to disk
                if self.rank == 0:
                    shutil.rmtree(os.path.join(ckpt_root, step_dir_name(choice["step"])) + ".tmp", ignore_errors=True)
                    print(f"meshtrain: the in-memory replicas of step {choice['step']} could not be used ({exc}); "
                          f"resuming from the disk checkpoint", file=sys.stderr, flush=True)
        if self.first_on_host and self.dir.is_dir():  # every rank has read its host's list (the all-gather)
            for g in self.dir.iterdir():
                if g.name != self.gen:
                    shutil.rmtree(g, ignore_errors=True)
        return self.restored

    def _materialise(self, root: str, choice: Mapping[str, Any], keep: int) -> None:
        """The chosen step's shards, copied by their holders into ``step-N.tmp``, committed by rank 0."""
        step, by = choice["step"], holders(self.reports, choice)
        final = os.path.join(root, step_dir_name(step))
        tmp = final + ".tmp"
        err: BaseException | None = None
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
        except OSError as exc:
            err = exc
        agree_or_raise(self.model, err, "restore from memory")
        try:
            for old in [o for o, new in by.items() if new == self.rank]:
                src = self.dir / choice["gen"] / step_dir_name(step) / f"rank-{old:05d}"
                for name in os.listdir(src):  # the meta goes beside the shards, read by rank 0 below
                    _copy_durable(src / name, os.path.join(tmp, "replica-" + name if name == META else name))
        except BaseException as exc:  # noqa: BLE001 - every rank must learn of it (see agree_or_raise)
            err = exc
        agree_or_raise(self.model, err, "restore from memory")
        try:
            if self.rank == 0:
                meta_path = os.path.join(tmp, "replica-" + META)
                meta = json.loads(Path(meta_path).read_text())
                os.remove(meta_path)
                commit_shards(root, tmp, final, meta, keep)
        except BaseException as exc:  # noqa: BLE001
            err = exc
        agree_or_raise(self.model, err, "restore from memory")

    # -- training --------------------------------------------------------------------------------

    def wait(self) -> int:
        """The newest step this rank finished keeping (0: none yet; -1: a copy failed, replicas
        are off). Joins the copy in flight: call it at the step boundary, before the all-reduce."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.stats["main_s"] += time.perf_counter() - t0
        return -1 if self.off or self.error is not None else self.done

    def snapshot(self, step: int, acked: int, optimizer: Any, extra: Callable[[], dict[str, Any]]) -> None:
        """At the boundary after ``step`` (``acked``: the newest step every rank finished, from the
        all-reduce): every ``every`` steps copy this rank's shard and keep it in the background."""
        if acked < 0 and not self.off:  # some rank's copy failed: a later step could never be complete
            self.off = True
            if self.error is None and self.rank == 0:
                print("meshtrain: in-memory replicas are off for the rest of this world (a rank could not keep "
                      "its copy; its message is above): a crash resumes from the disk checkpoint",
                      file=sys.stderr, flush=True)
        if self.off or step % self.every:
            return
        t0 = time.perf_counter()
        pieces, scalars, groups = collect_pieces(self.model, optimizer, snapshot=True)
        meta = checkpoint_meta(step, self.model, optimizer is not None, groups, to_json(extra())) \
            if self.rank == 0 else None
        self._thread = threading.Thread(target=self._keep, args=(step, acked, pieces, scalars, meta),
                                        name="meshtrain-replica", daemon=True)
        self._thread.start()
        self.stats["main_s"] += time.perf_counter() - t0

    def _rank_dir(self, step: int, rank: int) -> Path:
        return self.dir / self.gen / step_dir_name(step) / f"rank-{rank:05d}"

    def _store(self, step: int, rank: int, write: Callable[[str], None]) -> Path:
        """Write a rank's replica through ``write(dir)`` into ``.rank-R.tmp``, then rename it."""
        final = self._rank_dir(step, rank)
        tmp = final.with_name(f".{final.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(str(tmp))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        return final

    def _prune(self, acked: int) -> None:
        """Remove this rank's copies (its own, and those it received) of steps before ``acked``."""
        gen = self.dir / self.gen
        for s in sorted(gen.iterdir()) if gen.is_dir() else []:
            m = STEP_RE.match(s.name)
            if m and int(m.group(1)) < acked:
                for r in [self.rank, *self.sources]:
                    shutil.rmtree(s / f"rank-{r:05d}", ignore_errors=True)
                with contextlib.suppress(OSError):  # another local rank's copies may still be there
                    s.rmdir()

    def _keep(self, step: int, acked: int, pieces: Any, scalars: Any, meta: Any) -> None:
        """The background part: prune, write this rank's replica, swap copies with the peers."""
        payload, t0 = None, time.perf_counter()
        try:
            self._prune(acked)

            def write(d: str) -> None:
                write_rank_shard(d, self.rank, pieces, scalars)
                if meta is not None:
                    write_durable(os.path.join(d, META), json.dumps(meta).encode())

            local = self._store(step, self.rank, write)
            pieces = None  # the snapshot's memory goes once it is in /dev/shm
            self.stats["bytes"] = sum(f.stat().st_size for f in local.iterdir())
            payload = pack_dir(local) if self.partner is not None else None
        except BaseException as exc:  # noqa: BLE001 - reported at the next boundary (wait)
            self._fail(exc)
        try:  # the peers expect this rank's part of the swap even when its own write failed
            if self.group is not None:
                for src, buf in self._swap(step, payload):
                    self._store(step, src, lambda d, b=buf: unpack_dir(b, d))
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)
        if self.error is None:
            self.done = step
        self.stats["snapshots"] += 1
        self.stats["background_s"] += time.perf_counter() - t0

    def _swap(self, step: int, payload: torch.Tensor | None) -> list[tuple[int, torch.Tensor]]:
        """Send this rank's replica to its partner and receive those of its sources (gloo p2p on
        the replica group; an empty message when this rank has none)."""
        sends = []
        if self.partner is not None:
            n = 0 if payload is None else payload.numel()
            sends.append(dist.isend(torch.tensor([step, self.rank, n]), self.partner, group=self.group, tag=1))
            if n:
                sends.append(dist.isend(payload, self.partner, group=self.group, tag=2))
        got = []
        for src in self.sources:
            head = torch.zeros(3, dtype=torch.int64)
            dist.recv(head, src, group=self.group, tag=1)
            if int(head[0]) != step:
                raise CheckpointError(f"replica swap out of step: rank {src} sent step {int(head[0])}, this rank "
                                      f"keeps step {step}")
            if int(head[2]):
                buf = torch.empty(int(head[2]), dtype=torch.uint8)
                dist.recv(buf, src, group=self.group, tag=2)
                got.append((src, buf))
        for w in sends:
            w.wait()
        return got

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            print(f"meshtrain: [rank {self.rank}] could not keep the in-memory replica: {type(exc).__name__}: "
                  f"{exc}", file=sys.stderr, flush=True)

    # -- the end ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Collective, at the end of a run (or a stop with its checkpoint saved): join the copy in
        flight and remove the run's replica directory on every host."""
        self.wait()
        comm.barrier()  # no rank of this host still writes into its directory
        if self.first_on_host:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self.group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
            self.group = None


def _copy_durable(src: str | os.PathLike, dst: str) -> None:
    """Copy a file and fsync the copy (the checkpoint dir is a disk, unlike /dev/shm)."""
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def start(config: Any, model: Any, device: torch.device | str = "cpu") -> MemoryReplicas | None:
    """The run's replicas (collective), or None where they are off: elastic off, or
    ``elastic.memory_every = 0``."""
    e = config.elastic
    if not e.enabled or not e.memory_every:
        return None
    run_dir = Path(config.out)
    return MemoryReplicas(run_dir, run_dir / config.checkpoint.dir, e.memory_every, model, device,
                          config.comm.timeout_s)


__all__ = ["PREFIX", "META", "ID_FILE", "run_id", "replica_dir", "ring_partners", "inventory", "choose", "holders",
           "all_gather_json", "pack_dir", "unpack_dir", "MemoryReplicas", "start"]
