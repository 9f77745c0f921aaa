"""Choose the data-plane transport by configuration (`--transport`, TANDEM_TRANSPORT)."""

from __future__ import annotations

from shared.transport.base import Transport
from shared.transport.tcp import TcpTransport

TRANSPORTS = ("ucx", "tcp")


def make_transport(kind: str, host: str = "127.0.0.1", port: int = 0) -> Transport:
    if kind == "tcp":
        return TcpTransport(host=host, port=port)
    if kind == "ucx":
        from shared.transport.ucx import UcxTransport  # imports ucxx (~0.6 s) only when used

        return UcxTransport(host=host, port=port)
    raise ValueError(f"unknown transport {kind!r} (expected one of {', '.join(TRANSPORTS)})")
