"""Choose the data-plane transport by configuration (`--transport`, TANDEM_TRANSPORT)."""

from __future__ import annotations

import socket

from shared.errors import TandemError
from shared.transport.base import Transport
from shared.transport.kinds import TRANSPORTS
from shared.transport.tcp import TcpTransport


def resolve_host(host: str) -> str:
    """`auto` is this host's own address (a container's IP under compose, where replicas
    cannot be given one each); anything else is used as given."""
    if host != "auto":
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise TandemError(f"--data-host auto: cannot resolve this host's address: {exc}") from exc


def make_transport(kind: str, host: str = "127.0.0.1", port: int = 0) -> Transport:
    host = resolve_host(host)
    if kind == "tcp":
        return TcpTransport(host=host, port=port)
    if kind == "ucx":
        # imports ucxx (~0.6 s) only when used
        from shared.transport.ucx.transport import UcxTransport

        return UcxTransport(host=host, port=port)
    raise ValueError(f"unknown transport {kind!r} (expected one of {', '.join(TRANSPORTS)})")
