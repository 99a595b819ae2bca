"""User-level point-to-point: send / recv / isend / irecv, with global ranks like torch.distributed."""

from __future__ import annotations

import torch

from ..errors import CollectiveTimeout
from .collectives import _check_tensor, _group
from .communicator import Group
from .runner import p2p_tag
from .transport.base import PeerTimeout
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
            err = CollectiveTimeout(f"{self.description} timed out after {self._timeout:g}s: {exc}. "
                                    "Check that the peer posts the matching send/recv with the same tag.")
            self._finish(exc=err)
            return True
        except BaseException as exc:  # noqa: BLE001
            self._finish(exc=exc)
            return True
        self._finish(self._inner._result)
        return True


def _prep(tensor: torch.Tensor, peer: int, group: Group | None, tag: int, what: str) -> tuple[Group, int]:
    g = _group(group)
    check_dtype(_check_tensor(tensor).dtype)
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous (call .contiguous() first)")
    g.check_root(peer, "peer rank")
    if peer == g.comm.rank:
        raise ValueError(f"{what}: rank {peer} cannot {what} to itself")
    if g.rank < 0:
        raise ValueError(f"rank {g.comm.rank} is not in group {g.gid} (ranks {g.ranks})")
    return g, p2p_tag(g.gid, tag)


def isend(tensor: torch.Tensor, dst: int, group: Group | None = None, tag: int = 0) -> Work:
    """Start sending ``tensor`` to global rank ``dst``; keep it unchanged until the Work is done."""
    g, t = _prep(tensor, dst, group, tag, "send")
    return _TimedWork(g.comm.transport.isend(tensor, dst, t), g.timeout, f"send to rank {dst} (tag {tag})")


def irecv(tensor: torch.Tensor, src: int, group: Group | None = None, tag: int = 0) -> Work:
    """Start receiving into ``tensor`` from global rank ``src``."""
    g, t = _prep(tensor, src, group, tag, "recv")
    return _TimedWork(g.comm.transport.irecv(tensor, src, t), g.timeout, f"recv from rank {src} (tag {tag})")


def send(tensor: torch.Tensor, dst: int, group: Group | None = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until it is handed over."""
    isend(tensor, dst, group, tag).wait()


def recv(tensor: torch.Tensor, src: int, group: Group | None = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from global rank ``src``; returns ``src`` like torch.distributed."""
    irecv(tensor, src, group, tag).wait()
    return src
