"""What every collective call does before it reaches an algorithm: resolve the group, validate the
tensors, pick the algorithm and describe the call for the metadata check.

Shared by the front ends (``collectives``, ``personalized``, ``fusion``, ``p2p``, ``symmetric``);
it imports none of them, so any of them may import it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from . import select, tune
from .algorithms import algorithms_for, native
from .communicator import Group, current
from .device import on_host
from .transport.base import capabilities
from .types import ReduceOp


def from_torch_group(pg: Any) -> Group:
    """The meshtrain group standing for torch.distributed ProcessGroup ``pg``: the world for torch's
    default group, else the group made by ``meshtrain.comm.new_group`` whose torch sub-group (or
    whose ranks, in order) it is. ValueError if there is none (new_group is collective, so it cannot
    be made here)."""
    import torch.distributed as tdist

    if not isinstance(pg, tdist.ProcessGroup):
        raise ValueError(f"invalid group {pg!r}: pass a group made by meshtrain.comm.new_group(), or None")
    comm = current()
    for g in comm.groups:
        if g.torch_group is pg:
            return g
    if tdist.is_initialized() and pg is tdist.group.WORLD and tdist.get_world_size() == comm.world_size:
        return comm.world
    ranks = tdist.get_process_group_ranks(pg) if tdist.is_initialized() else None
    for g in comm.groups:
        if ranks is not None and g.ranks == ranks:
            return g
    raise ValueError(f"the torch.distributed group {pg!r} (ranks {ranks}) has no meshtrain.comm group: create it "
                     "with meshtrain.comm.new_group(ranks) on every rank and pass that")


def resolve_group(group: Any) -> Group:
    """The meshtrain group a call runs on: the world for None, the meshtrain group of a
    torch.distributed ProcessGroup; ValueError if this rank is not a member."""
    if group is None:
        return current().world
    if not isinstance(group, Group):  # a torch.distributed ProcessGroup maps to its meshtrain group
        group = from_torch_group(group)  # ValueError if it has none
    if group.rank < 0:  # checked first: a non-member must not even join the algorithm choice
        raise ValueError(f"rank {group.comm.rank} is not a member of group {group.gid} (ranks {group.ranks}); "
                         "only members may call its collectives")
    return group


def check_tensor(t: Any, g: Group, what: str = "tensor") -> torch.Tensor:
    """``t`` if it is a tensor that ``g``'s transport can move; TypeError/ValueError naming ``what``
    if not."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not on_host(t):
        _check_device(t, g, what)
    return t


def _check_device(t: torch.Tensor, g: Group, what: str) -> None:
    """The shm transport moves bytes through host shared memory: a GPU tensor there would cost a
    hidden device-to-host copy per step at best, so it is refused, with the fix. The transport is
    the group's: a call may come from a thread with no communicator bound (DataParallel's bucket
    worker, autograd's device thread on a GPU), so the thread's is not asked."""
    if capabilities(g.comm.transport).cpu_only:
        raise ValueError(
            f"{what} is on {t.device}, but the shm transport moves CPU tensors through shared memory: "
            f"for GPU tensors use init(transport='torch') over an NCCL process group (transport "
            f"'auto' does so when CUDA is available), or pass a CPU tensor (tensor.cpu())")


def check_list(lst: Any, g: Group, like: torch.Tensor, name: str) -> None:
    """Check that ``lst`` holds one tensor per member of ``g``, each with ``like``'s numel and dtype."""
    if not isinstance(lst, (list, tuple)) or len(lst) != g.size:
        got = len(lst) if isinstance(lst, (list, tuple)) else type(lst).__name__
        raise ValueError(f"{name} must be a list of {g.size} tensors (the group size), got {got}")
    for i, t in enumerate(lst):
        check_tensor(t, g, f"{name}[{i}]")
        if t.numel() != like.numel() or t.dtype != like.dtype:
            raise ValueError(
                f"{name}[{i}] has {t.numel()} elements of {t.dtype}; every entry must match "
                f"the tensor ({like.numel()} elements of {like.dtype})"
            )


def choose_algorithm(g: Group, op: str, algorithm: str, nbytes: int, dtype: torch.dtype | None = None) -> str:
    """The algorithm that runs ``op``: for "auto", the static choice (``select.choose``; never
    torch's own collective for a ``dtype`` it cannot move), or where the group learns, the choice
    its calls measured fastest (``tune``), else ``algorithm`` if the group's transport offers
    it (``algorithms_for``), else ValueError listing those it does."""
    if algorithm == "auto":
        native_ok = dtype not in native.NO_NATIVE
        tuner = g.tuner if g.tuner is not None else tune.of(g)
        if not tuner or op not in tune.TUNED_OPS:
            return select.choose(g, op, nbytes, native_ok=native_ok)
        # the static choice only where a slot is new: a kept choice is a lookup
        return tuner.pick(op, nbytes, dtype, lambda: select.candidates(
            g, op, nbytes, native_ok, select.choose(g, op, nbytes, native_ok=native_ok)))
    valid = algorithms_for(op, g.comm.transport.kind)
    if algorithm not in valid:
        hint = " ('native' needs the torch transport)" if algorithm == "native" else ""
        raise ValueError(f"unknown algorithm {algorithm!r} for {op}{hint}: use one of {valid} or 'auto'")
    return algorithm


def call_meta(shapes: Sequence[Sequence[int]], dtype: torch.dtype, algorithm: str, **extra: Any) -> dict[str, Any]:
    """The call's description that every member must agree on (the runner's metadata check)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    # tuples, so that the runner's fingerprint memo can key on the items (JSON writes them as lists)
    return dict(shapes=tuple(map(tuple, shapes)), dtype=name, algorithm=algorithm, **extra)


_DTYPE_NAMES: dict[torch.dtype, str] = {}  # "float32" for torch.float32: str() and replace cost ~1 us a call


def finish_avg(buf: torch.Tensor, op: ReduceOp, p: int) -> None:
    """AVG is reduced as a sum (no transport averages); divide by the group size ``p`` at the end."""
    if op is ReduceOp.AVG:
        buf.div_(p)
