"""``NullDist``: torch.distributed with communication that costs nothing, for the compute floor of
``meshtrain bench compat --layouts ... --floor``.

Group queries and creation, and ``broadcast_object_list`` (the loop's config, before any timed
step), are torch.distributed's own. The data calls return at once: collectives leave their tensors
as they are, a receive zero-fills its buffer (the write a real receive would make, with values that
keep the arithmetic finite). So no rank ever waits for another, and every rank computes all of its
step all of the time: a step then takes the whole job's computation divided by the cores it shares,
which no communication library can beat on this host. The losses are meaningless.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as _dist

_FREE = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")


class _Done:
    """A Work that has already finished."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        """Nothing to wait for."""
        return True

    def is_completed(self) -> bool:
        """Always finished."""
        return True


class NullDist:
    """Stands for ``torch.distributed``: ``_FREE`` collectives and ``batch_isend_irecv`` do no
    communication (see the module's docstring); every other name is torch.distributed's."""

    def __getattr__(self, name: str) -> Any:
        if name in _FREE:
            return lambda *args, async_op=False, **kwargs: _Done() if async_op else None
        return getattr(_dist, name)

    @staticmethod
    def batch_isend_irecv(ops: list[Any]) -> list[_Done]:
        """Zero-fill every receive buffer; send nothing."""
        for op in ops:
            if op.op is _dist.irecv:
                op.tensor.zero_()
        return [_Done() for _ in ops]
