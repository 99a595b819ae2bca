"""Point-to-point transports. Collectives are built on top of these in ``meshtrain.comm.algorithms``."""

from .base import PeerTimeout, Transport
from .local import LocalTransport, LocalWorld

__all__ = ["Transport", "PeerTimeout", "LocalTransport", "LocalWorld"]
