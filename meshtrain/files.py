"""Files every layer writes the same way: where meshtrain caches what it measures or builds
(``cache_dir``), and writes that a reader, or a crash, never sees half done (``atomic_path``,
``write_atomic``, ``write_json_atomic``). The standard library only, so that any layer, ``comm``
included, may import it."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Iterator


def cache_dir() -> Path:
    """``$MESHTRAIN_CACHE_DIR`` if it is set and not empty, else ``~/.cache/meshtrain``: where the
    tokenizers, token files and this host's calibrations are kept."""
    return Path(os.environ.get("MESHTRAIN_CACHE_DIR") or Path.home() / ".cache" / "meshtrain")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside ``path`` for a writer that writes through its own function
    (matplotlib's ``savefig``, ``torch.save``): ``PATH.tmpPID-TID``, so no other process or thread
    writing ``path`` at the same time shares it. When the block ends it is renamed onto ``path`` in
    one step (a reader sees the old file or the new one); on an exception it is removed. The
    directory must exist."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}-{threading.get_ident()}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace ``path`` by ``data`` through ``atomic_path``: bytes as they are, a str as UTF-8
    text. The directory must exist."""
    with atomic_path(path) as tmp:
        if isinstance(data, bytes):
            with open(tmp, "wb") as f:
                f.write(data)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(data)


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int = 1) -> None:
    """Replace ``path`` by ``obj`` as JSON through ``atomic_path``, creating its directory if
    needed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(obj, indent=indent))
