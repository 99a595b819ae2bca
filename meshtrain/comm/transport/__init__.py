"""Point-to-point transports. Collectives are built on top of these in ``meshtrain.comm.algorithms``.
Each transport registers one ``TransportSpec`` (``registry.py``), which everything else asks."""

from .base import PeerTimeout, Transport
from .local import LocalTransport, LocalWorld
from .registry import Setup, TransportSpec, register

__all__ = ["Transport", "PeerTimeout", "LocalTransport", "LocalWorld", "TransportSpec", "Setup", "register"]
