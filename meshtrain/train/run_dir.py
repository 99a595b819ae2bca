"""The run directory is owned by one run at a time, and it is self-contained.

Ownership: ``claim`` refuses a folder that holds a previous run's files unless the run continues it
(``checkpoint.resume``) or ``overwrite = true`` (which deletes those files first), then takes the
folder's lock, ``RUN_DIR/meshtrain.lock``: a file created with O_CREAT | O_EXCL (atomic on local
filesystems and NFSv3+) that holds the holder's host, pid and start time, so a second run into the
folder is refused by name, also from another host sharing it. Its holder touches it every
``LOCK_BEAT_S``: a lock left by a dead process of this host, or one from another host that stays
untouched for ``LOCK_STALE_BEATS`` beats, is stale and taken over. ``meshtrain train``'s launcher holds the lock for its ranks (threads or
processes); under torchrun, rank 0 of the job holds it (``launch.worker``).

Self-contained: rank 0 writes ``tokenizer.json`` (with a ``tokenizer_config.json`` naming its
end-of-text token) and ``data.json`` (the corpus's absolute path, size and fingerprint) into the run
directory, every checkpoint carries a copy of the tokenizer files (``copy_tokenizer``, called by the
commit) and the description in its ``extra``, and a resumed run uses its checkpoint's tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import procfs
from ..errors import ConfigError

if TYPE_CHECKING:
    from .config import Config
    from .data import Corpus
    from .tokenizer import Tokenizer

LOCK = "meshtrain.lock"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DATA_FILE = "data.json"
SIGNS = ("config.toml", "metrics.jsonl", "summary.json")
"""Files whose presence means the folder holds a run (with the checkpoint directory, if not empty)."""
RUN_FILES = (*SIGNS, "loss.png", "load_balance.png", "tensorboard", "flight", "elastic", DATA_FILE, *TOKENIZER_FILES,
             "configs", "logs")  # (run_records: earlier segments' configs, failed workers' tracebacks)
"""What a run writes besides its checkpoints: what ``overwrite = true`` deletes (nothing else)."""
LOCK_BEAT_S = 1.0
"""The holder touches its lock this often: a lock left untouched for ``LOCK_STALE_BEATS`` beats was
left by a run that ended (killed, its host lost), whichever host it ran on. Judged by watching the
file's mtime from here, so the hosts' clocks need not agree."""
LOCK_STALE_BEATS = 3
_READ_TRIES = 20  # a lock just created by O_EXCL is empty until its holder writes it: retry a moment


def previous_run(config: "Config") -> list[str]:
    """The names of a previous run's files in ``config.out`` (empty if there are none)."""
    out = Path(config.out)
    found = [name for name in SIGNS if (out / name).exists()]
    ckpt = out / config.checkpoint.dir
    if ckpt.is_dir() and any(ckpt.iterdir()):
        found.append(config.checkpoint.dir.rstrip("/") + "/")
    return found


def _inside(path: str, folder: Path) -> bool:
    p, f = Path(path).expanduser().resolve(), folder.expanduser().resolve()
    return p == f or f in p.parents


def check_reusable(config: "Config", torchrun: bool = False) -> None:
    """``ConfigError`` unless ``config.out`` may be trained into: it holds no previous run, or the
    run resumes (``checkpoint.resume``, or elastic, which resumes "auto"), or ``overwrite`` is set
    (and does not delete what the run resumes from, nor, under torchrun, what a restarted attempt
    would need). Reads only."""
    out, resume = Path(config.out), config.checkpoint.resume
    if config.overwrite:
        if resume and resume != "auto" and _inside(resume, out):
            raise ConfigError(f"overwrite = true would delete {out}'s checkpoints, but checkpoint.resume = "
                              f"{resume!r} is one of them; drop --overwrite=true to continue that run, or resume "
                              f"from a checkpoint outside {out}")
        if torchrun and (config.elastic.enabled or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0):
            raise ConfigError(f"overwrite = true cannot be used with torchrun --max-restarts or elastic.enabled: "
                              f"every restarted attempt would delete what the one before saved; empty the folder "
                              f"first (rm -r {out}) and drop --overwrite=true")
        return
    found = previous_run(config)
    if not found or config.elastic.enabled or resume == "auto" or (resume and _inside(resume, out)):
        return
    via = f"resuming from {resume}, outside it, " if resume else ""
    raise ConfigError(f"run directory {out} already holds a run ({', '.join(found)}); {via}a new run there would "
                      f"append to its metrics.jsonl and replace its checkpoints. Continue it with "
                      f"--checkpoint.resume=auto, start it again with --overwrite=true (deletes those files), "
                      f"or choose another --out")


# ------------------------------------------------------------------------------------------- lock

def _holder() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "started_s": time.time(), "command": " ".join(sys.argv), "job": os.environ.get("TORCHELASTIC_RUN_ID")}


def _read(path: Path) -> dict[str, Any] | None:
    """The holder a lock names; None if the lock is gone; {} if it stays unreadable."""
    for _ in range(_READ_TRIES):
        try:
            holder = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(holder, dict) and "pid" in holder:
                return holder
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return {}


@dataclass
class RunLock:
    """A held run-directory lock; ``release`` removes it (if still this holder's) and the run
    directory if this claim created it and nothing was written there."""

    path: Path
    holder: dict[str, Any]
    created: bool
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        threading.Thread(target=self._beat, name="meshtrain-run-lock", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(LOCK_BEAT_S):  # the run lives: its lock says so (``_not_refreshed``)
            try:
                os.utime(self.path)
            except OSError:  # removed (released, or by hand): nothing more to say
                return

    def release(self) -> None:
        """Remove the lock if it still names this holder, and an empty folder this claim made."""
        self._stop.set()
        if _read(self.path) == self.holder:
            self.path.unlink(missing_ok=True)
        if self.created:
            try:
                self.path.parent.rmdir()  # only if empty: a run that wrote nothing leaves nothing
            except OSError:
                pass


def _refusal(out: Path, path: Path, holder: dict[str, Any], here: str) -> ConfigError:
    if not holder:
        return ConfigError(f"run directory {out} is locked by {path}, which names no holder (a run just starting, "
                           f"or a damaged file); if no run uses {out}, remove it: rm {path}")
    command = f": {holder['command']}" if holder.get("command") else ""
    who = f"pid {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')}{command})"
    if holder.get("host") == here:
        return ConfigError(f"run directory {out} is in use by another run: {who} holds {path}; wait for it to "
                           f"end, stop it (kill {holder.get('pid')}), or choose another --out")
    return ConfigError(f"run directory {out} is in use by another run: {who} holds {path} and still refreshes it "
                       f"(every {LOCK_BEAT_S:g} s while its run lives); wait for it to end, stop it on host "
                       f"{holder.get('host')}, or choose another --out")


def _not_refreshed(path: Path) -> bool:
    """True if the lock's mtime stays the same for ``LOCK_STALE_BEATS`` of its holder's beats."""
    try:
        before = path.stat().st_mtime_ns
        time.sleep(LOCK_BEAT_S * LOCK_STALE_BEATS)
        return path.stat().st_mtime_ns == before
    except FileNotFoundError:
        return False  # released meanwhile: the caller tries again


def _stale(path: Path, holder: dict[str, Any], here: str, own_job: bool) -> str | None:
    """Why ``holder`` may be taken over (None: it may not)."""
    if holder.get("host") == here and not procfs.alive(int(holder.get("pid", 0))):
        return "left by a process of this host that no longer runs"
    if holder.get("host") != here and _not_refreshed(path):
        return f"its holder has not refreshed it for {LOCK_BEAT_S * LOCK_STALE_BEATS:g} s (its run ended)"
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if own_job and job and holder.get("job") == job:
        return f"left by an earlier attempt of this torchrun job ({job})"
    return None


def acquire(out: str | Path, own_job: bool = False) -> RunLock:
    """Take ``out``'s lock (creating ``out``), or raise ``ConfigError`` naming its holder. A stale
    lock (``_stale``; ``own_job``: an attempt of this torchrun job that resumes may take over one of
    an earlier attempt) is moved aside and taken over, with a note on stderr."""
    out = Path(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path, here, me = out / LOCK, socket.gethostname(), _holder()
    for _ in range(3):  # a takeover races other takers at most a few times
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None:  # released meanwhile
                continue
            why = _stale(path, holder, here, own_job) if holder else None
            if why is None:
                raise _refusal(out, path, holder, here) from None
            aside = path.with_name(f"{LOCK}.stale-{os.getpid()}")
            try:
                os.rename(path, aside)  # atomic: of several takers one moves it, the others retry
            except FileNotFoundError:
                continue
            if _read(aside) != holder:  # another taker's fresh lock was moved: put it back, retry
                try:
                    os.link(aside, path)
                except FileExistsError:
                    pass
                aside.unlink(missing_ok=True)
                continue
            aside.unlink(missing_ok=True)
            print(f"# note: taking over the lock {path} of pid {holder.get('pid')} on {holder.get('host')} "
                  f"(started {holder.get('started')}): {why}", file=sys.stderr, flush=True)
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        return RunLock(path, me, created)
    raise ConfigError(f"could not take the lock {path}: other runs kept taking it over; start again")


def claim(config: "Config", torchrun: bool = False) -> RunLock:
    """Check that ``config.out`` may be trained into (``check_reusable``), take its lock, and with
    ``overwrite`` delete the previous run's files (``RUN_FILES`` and the checkpoint directory);
    returns the lock, which the caller releases when the run ends, however it ends."""
    check_reusable(config, torchrun)
    own_job = torchrun and bool(config.checkpoint.resume or config.elastic.enabled)
    lock = acquire(config.out, own_job)
    try:
        check_reusable(config, torchrun)  # again, now that no other run can write there
        if config.overwrite:
            out = Path(config.out)
            for name in (*RUN_FILES, config.checkpoint.dir):
                p = out / name
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                elif p.exists() or p.is_symlink():
                    p.unlink()
    except BaseException:
        lock.release()
        raise
    return lock


# -------------------------------------------------------------------------------- self-contained

def absolute_paths(config: "Config") -> None:
    """Make ``out``, ``data.path``, ``data.tokenizer`` and a ``checkpoint.resume`` path absolute
    (in place), so config.toml and the checkpoints mean the same from any working directory."""
    def absolute(p: str) -> str:
        return str(Path(p).expanduser().absolute()) if p else p

    config.out = absolute(config.out)
    config.data.path, config.data.tokenizer = absolute(config.data.path), absolute(config.data.tokenizer)
    if config.checkpoint.resume != "auto":
        config.checkpoint.resume = absolute(config.checkpoint.resume)


def resumed_checkpoint(config: "Config") -> Path | None:
    """The step directory the run will resume from (None: it starts fresh, or there is none)."""
    from .checkpoint import latest_checkpoint
    from .checkpoint_io import METADATA

    want = config.checkpoint.resume or ("auto" if config.elastic.enabled else "")
    if not want:
        return None
    path = latest_checkpoint(str(Path(config.out) / config.checkpoint.dir)) if want == "auto" else want
    if path and os.path.isdir(path) and not os.path.isfile(os.path.join(path, METADATA)):
        path = latest_checkpoint(path)  # a checkpoints root
    return Path(path) if path else None


def _a_copy(tokenizer: str) -> bool:
    """Whether ``data.tokenizer`` names a checkpoint's copy (set by ``use_checkpoint_tokenizer``)."""
    from .checkpoint_io import STEP_RE

    p = Path(tokenizer)
    return p.name == TOKENIZER_FILES[0] and STEP_RE.match(p.parent.name) is not None


def use_checkpoint_tokenizer(config: "Config") -> None:
    """A resumed run with the ``[data]`` settings of its checkpoint's run tokenises with the
    tokenizer the checkpoint carries, not with what the cache holds now (a BPE trained again):
    point ``data.tokenizer`` at it (in place). Nothing if the checkpoint has none, or the settings
    differ (a changed vocabulary then fails the load, naming it)."""
    from .checkpoint_io import METADATA

    step = resumed_checkpoint(config)
    if step is None or not (step / TOKENIZER_FILES[0]).is_file():
        return
    try:
        saved = dict(json.loads((step / METADATA).read_text(encoding="utf-8"))["extra"]["config"]["data"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    now = dataclasses.asdict(config.data)
    if not now["tokenizer"] and _a_copy(saved.get("tokenizer") or ""):  # resumed before, then given as at first
        saved["tokenizer"] = ""
    if now == saved or (_a_copy(now["tokenizer"]) and {**now, "tokenizer": ""} == {**saved, "tokenizer": ""}):
        config.data.tokenizer = str((step / TOKENIZER_FILES[0]).absolute())


def describe(corpus: "Corpus", tokenizer: "Tokenizer", run_dir: str | Path) -> dict[str, Any]:
    """What the checkpoints' ``extra`` records of the data and tokenizer: the corpus's absolute path,
    kind, file count, bytes and fingerprint (sizes and mtimes: cheap), and the tokenizer's sha256,
    vocabulary and end-of-text id, with the run directory whose tokenizer files each checkpoint copies."""
    data = {"path": str(corpus.root), "name": corpus.name, "kind": corpus.kind, "files": len(corpus.files),
            "bytes": corpus.size_bytes, "max_bytes": corpus.max_bytes, "fingerprint": corpus.fingerprint}
    tok = {"sha256": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
           "source": str(tokenizer.path) if tokenizer.path else None,
           "run_dir": str(Path(run_dir).absolute())}
    return {"data": data, "tokenizer": tok}


def write_run_files(run_dir: str | Path, tokenizer: "Tokenizer", described: dict[str, Any]) -> None:
    """Rank 0: ``tokenizer.json`` (its canonical JSON, whose sha256 is ``Tokenizer.fingerprint``),
    ``tokenizer_config.json`` and ``data.json`` in the run directory."""
    from .checkpoint_io import replace_durable
    from .hf import _write_tokenizer_config

    run = Path(run_dir)
    replace_durable(str(run / TOKENIZER_FILES[0]), tokenizer.backend.to_str().encode())
    # beside it, the source's tokenizer_config.json (its eos_token, ...) or one naming the end-of-text token
    if tokenizer.path is None or tokenizer.path.parent.resolve() != run.resolve():
        _write_tokenizer_config(tokenizer.path or run / TOKENIZER_FILES[0], run)
    replace_durable(str(run / DATA_FILE), json.dumps(described, indent=1).encode())


def copy_tokenizer(extra: Any, step_tmp: str) -> None:
    """Copy the run's tokenizer files into a checkpoint being committed (its temp dir), when its
    ``extra`` names the run (``describe``); called by the commit, before the commit marker."""
    from .checkpoint_io import write_durable

    tok = extra.get("tokenizer") if isinstance(extra, dict) else None
    run = tok.get("run_dir") if isinstance(tok, dict) else None
    for name in TOKENIZER_FILES if run else ():
        src = Path(run) / name
        if src.is_file():
            write_durable(os.path.join(step_tmp, name), src.read_bytes())


__all__ = ["LOCK", "RUN_FILES", "RunLock", "previous_run", "check_reusable", "acquire", "claim", "absolute_paths",
           "resumed_checkpoint", "use_checkpoint_tokenizer", "describe", "write_run_files", "copy_tokenizer"]
