"""User-level point-to-point: send / recv / isend / irecv, with global ranks like torch.distributed."""

from __future__ import annotations

import torch

from .call import check_tensor, resolve_group
from .communicator import Group
from .runner import p2p_tag
from .transport.base import PeerTimeout, p2p_timeout
from .types import check_dtype
from .work import Work


class _TimedWork(Work):
    """Wraps a transport Work so waits without a timeout still end at the group's timeout."""

    def __init__(self, inner: Work, timeout: float, what: str) -> None:
        super().__init__(what)
        self._inner, self._timeout = inner, timeout

    def _progress(self, timeout: float | None) -> bool:
        if self._done.is_set():
            return True
        try:
            if timeout == 0:
                if not self._inner.is_completed():
                    return False
            self._inner.wait(self._timeout if timeout is None else min(timeout, self._timeout))
        except PeerTimeout as exc:
            err = p2p_timeout(self.description, self._timeout, exc)
            self._finish(exc=err)
            return True
        except BaseException as exc:  # noqa: BLE001
            self._finish(exc=exc)
            return True
        self._finish(self._inner._result)
        return True


def _prep(tensor: torch.Tensor, peer: int | None, group: Group | None, tag: int, what: str,
          group_peer: int | None = None) -> tuple[Group, int, int]:
    """(group, transport tag, global peer rank) of a send/recv, or the error that names the fix."""
    g = resolve_group(group)
    peer = _peer(g, peer, group_peer, "dst" if what == "send" else "src")
    check_dtype(check_tensor(tensor, g).dtype)
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous (call .contiguous() first)")
    g.check_root(peer, "peer rank")
    if peer == g.comm.rank:
        raise ValueError(f"{what}: rank {peer} cannot {what} to itself")
    if g.rank < 0:
        raise ValueError(f"rank {g.comm.rank} is not in group {g.gid} (ranks {g.ranks})")
    return g, p2p_tag(g.gid, tag), peer


def _peer(g: Group, peer: int | None, group_peer: int | None, name: str) -> int:
    """The global rank of ``peer`` (global) or ``group_peer`` (a rank of ``g``), as torch's
    ``group_dst`` / ``group_src``: exactly one of them."""
    if peer is not None and group_peer is not None:
        raise ValueError(f"Can't specify both {name} and group_{name}: {name} is a global rank, group_{name} "
                         f"a rank of the group; pass one")
    if group_peer is not None:
        if not 0 <= group_peer < g.size:
            raise ValueError(f"group_{name} = {group_peer} is not a rank of group {g.gid} (size {g.size}); use "
                             f"0..{g.size - 1}")
        return g.ranks[group_peer]
    if peer is None:
        hint = " (meshtrain has no receive from any source: name the sender)" if name == "src" else ""
        raise ValueError(f"Must specify {name} or group_{name}{hint}")
    return peer


def isend(tensor: torch.Tensor, dst: int | None = None, group: Group | None = None, tag: int = 0,
          group_dst: int | None = None) -> Work:
    """Start sending ``tensor`` to global rank ``dst`` (or ``group``'s rank ``group_dst``); keep it
    unchanged until the Work is done."""
    g, t, dst = _prep(tensor, dst, group, tag, "send", group_dst)
    return _timed(g.comm.transport.isend(tensor, dst, t), g.timeout, f"send to rank {dst} (tag {tag})")


def irecv(tensor: torch.Tensor, src: int | None = None, group: Group | None = None, tag: int = 0,
          group_src: int | None = None) -> Work:
    """Start receiving into ``tensor`` from global rank ``src`` (or ``group``'s rank ``group_src``)."""
    g, t, src = _prep(tensor, src, group, tag, "recv", group_src)
    return _timed(g.comm.transport.irecv(tensor, src, t), g.timeout, f"recv from rank {src} (tag {tag})")


def _timed(work: Work, timeout: float, what: str) -> Work:
    """``work`` with waits that end at the group's ``timeout``: bounded by the transport's work
    itself where it can (the torch transport's), else wrapped in a ``_TimedWork``."""
    bound = getattr(work, "bound", None)
    return bound(timeout, what) if bound is not None else _TimedWork(work, timeout, what)


def send(tensor: torch.Tensor, dst: int | None = None, group: Group | None = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to global rank ``dst`` (or ``group_dst`` of ``group``) and wait until it is
    handed over."""
    isend(tensor, dst, group, tag, group_dst).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group: Group | None = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from global rank ``src`` (or ``group_src`` of ``group``); returns the
    sender's global rank like torch.distributed."""
    g = resolve_group(group)
    src = _peer(g, src, group_src, "src")
    irecv(tensor, src, g, tag).wait()
    return src
