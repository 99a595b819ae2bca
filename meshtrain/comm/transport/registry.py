"""The transport registry: one ``TransportSpec`` per transport holds every fact known of it by name.

Each transport module registers its own entry (``register``) when it is imported. Whatever asks
about a transport by name reads the entry instead of comparing names: ``init`` and ``run_local``
(what to build, threads or processes, what ``auto`` takes), the config's and the bench CLIs'
validation, the cost model before calibration, the algorithms only that transport offers.

Only ``local`` is imported with ``meshtrain.comm``; the torch.distributed and shared-memory
transports (``torchdist``, ``shm``) are imported on the first question that needs every entry (a
listing, or a name not registered yet). Adding a transport: a ``Transport`` subclass and one
``register(TransportSpec(...))`` beside it (docs/comm.md, "Adding a transport").
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .base import Transport

# The modules of this package that register the built-in entries, imported on first need.
BUILTIN_MODULES = ("local", "torchdist", "shm")
AUTO = "auto"  # not a transport: init() picks one of the registered ones (``auto_choice``)
ANY_BACKEND = "*"  # in ``auto_backends``: every backend that no other entry claims


@dataclass(frozen=True)
class Capabilities:
    """What a transport offers beyond tagged point-to-point messages. The library asks these
    instead of comparing transport names."""

    native_collectives: bool = False
    """It runs torch.distributed's own collectives (the algorithm "native")."""
    shared_memory: bool = False
    """Ranks on one host share buffers: the "shm" collectives and symmetric memory run there."""
    cpu_only: bool = True
    """It moves CPU tensors only (shared memory is host memory)."""
    ranks_are_threads: bool = False
    """Ranks are threads of one process: ``run_local`` builds it, ``init`` refuses it (and no
    implicit calibration: a ping-pong between threads measures the GIL)."""


@dataclass(frozen=True)
class Setup:
    """What a transport's constructor is given: this rank's place and how to reach the others."""

    rank: int
    world_size: int
    timeout: float
    """Seconds to reach the other ranks (``init``'s ``init_timeout``)."""
    store: Any = None
    """Processes: torch.distributed's default store (``init`` has initialised the process group)."""
    world: Any = None
    """Threads: the ``LocalWorld`` that ``run_local``'s threads share (its ``abort`` wakes every
    rank when one fails)."""
    spans_hosts: bool = False
    """Chosen by ``transport="auto"``: reach ranks on other hosts too (shm routes them to gloo)."""


# alpha (s per message), beta (s per byte sent), gamma (s per byte reduced): a network link's, the
# torch transport's default, taken by an entry that names none and by a kind not registered.
LINK_COSTS = (300e-6, 1 / 0.8e9, 1 / 4e9)


@dataclass(frozen=True)
class TransportSpec:
    """One transport's registry entry."""

    name: str
    """The name in configs (``comm.transport``), CLIs (``--transport``) and ``Transport.kind``."""
    build: Callable[[Setup], "Transport"]
    """Builds this rank's transport: ``init`` calls it for processes, ``run_local`` per thread."""
    capabilities: Capabilities = Capabilities()
    cost_model: tuple[float, float, float] = LINK_COSTS
    """alpha, beta, gamma before calibration (``select.default_model``; threads never calibrate implicitly)."""
    algorithms: tuple[str, ...] = ()
    """Algorithm names (the dispatch table's, and the bench's) that run on this transport only."""
    config_hint: str = ""
    """How a config selects it, for errors about its algorithms (default: ``comm.transport = NAME``)."""
    auto_backends: tuple[str, ...] = ()
    """torch.distributed backends for which ``transport="auto"`` takes it (``ANY_BACKEND``: any other)."""

    @property
    def threads(self) -> bool:
        """True if its ranks are threads of one process (``run_local``), else processes (``init``)."""
        return self.capabilities.ranks_are_threads

    @property
    def hint(self) -> str:
        """``config_hint``, or the plain config line that selects it."""
        return self.config_hint or f"comm.transport = {self.name!r}"


_SPECS: dict[str, TransportSpec] = {}
_loaded = False
_lock = threading.RLock()  # a rank thread asking mid-load must wait for every built-in entry


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    with _lock:
        if not _loaded:
            for module in BUILTIN_MODULES:  # each registers its entry as it is imported
                importlib.import_module(f"{__package__}.{module}")
            _loaded = True


def register(spec: TransportSpec, replace: bool = False) -> TransportSpec:
    """Add ``spec`` under its name (returned, so a module can keep it). ValueError for "auto" or a
    name another entry holds, unless ``replace``."""
    if spec.name == AUTO or not spec.name:
        raise ValueError(f"{spec.name!r} cannot name a transport")
    held = _SPECS.get(spec.name)
    if held is not None and held != spec and not replace:
        raise ValueError(f"transport {spec.name!r} is already registered ({held}); pass replace=True")
    _SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove the entry ``name`` (no error if absent)."""
    _SPECS.pop(name, None)


def find(name: str) -> TransportSpec | None:
    """The entry ``name``, or None. The built-in modules are imported only on a miss."""
    spec = _SPECS.get(name)
    if spec is None and not _loaded:
        _load_builtins()
        spec = _SPECS.get(name)
    return spec


def get(name: str) -> TransportSpec:
    """The entry ``name``; ValueError naming the registered transports if there is none."""
    spec = find(name)
    if spec is None:
        raise ValueError(f"unknown transport {name!r}: the registered transports are {', '.join(names())}")
    return spec


def specs() -> list[TransportSpec]:
    """Every entry, sorted by name."""
    _load_builtins()
    return [_SPECS[n] for n in sorted(_SPECS)]


def names(threads: bool | None = None) -> list[str]:
    """The registered names, sorted; ``threads``: only those whose ranks are threads (True) or
    processes (False)."""
    return [s.name for s in specs() if threads is None or s.threads == threads]


def runs_as_threads(name: str) -> bool:
    """True if ``name`` is a registered transport whose ranks are threads ("auto" never is)."""
    spec = find(name) if name != AUTO else None
    return spec is not None and spec.threads


def auto_choice(backend: str) -> TransportSpec:
    """The entry ``init(transport="auto")`` takes under torch.distributed ``backend``: the one that
    claims it in ``auto_backends``, else the one that claims ``ANY_BACKEND``."""
    claims = [s for s in specs() if backend in s.auto_backends and not s.threads]
    claims = claims or [s for s in specs() if ANY_BACKEND in s.auto_backends and not s.threads]
    if not claims:
        raise ValueError(f"no registered transport serves transport='auto' on backend {backend!r}")
    return claims[0]


def auto_names(backend: str) -> tuple[str, ...]:
    """The transports ``auto`` can give a run on ``backend`` ("auto": it depends on the machine,
    so every entry ``auto`` ever takes)."""
    if backend == AUTO:
        return tuple(s.name for s in specs() if s.auto_backends and not s.threads)
    return (auto_choice(backend).name,)


def capabilities_of(kind: str) -> Capabilities:
    """The capabilities of the transport kind ``kind`` (none for a kind not registered)."""
    spec = find(kind)
    return spec.capabilities if spec is not None else Capabilities()


def capabilities(transport: Any) -> Capabilities:
    """The capabilities of ``transport`` (an instance, or anything with its ``kind``)."""
    return capabilities_of(getattr(transport, "kind", ""))


__all__ = ["Capabilities", "Setup", "TransportSpec", "LINK_COSTS", "ANY_BACKEND", "AUTO", "register", "unregister",
           "find", "get", "specs", "names", "runs_as_threads", "auto_choice", "auto_names", "capabilities",
           "capabilities_of"]
