"""Plain asyncio TCP transport: the fallback data plane and the baseline UCX must beat.

The protocol is `shared/transport/session.py`'s; here it runs on pooled TCP connections,
with payloads received by `sock_recv_into` straight into the handler's buffer. A connection
whose stream position is in doubt (error, cancel, deadline) is closed, never reused. The
listener bounds what connections that know no secret may hold
(`shared/transport/admission.py`) and survives every accept error.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from shared.errors import WireFormatError
from shared.tasks import cancel_and_wait
from shared.transport.admission import AcceptBackoff, AdmissionLimits, Connection, ConnectionTable
from shared.transport.base import ReceiveHandler
from shared.transport.frames import PREFIX, TransferHeader
from shared.transport.pool import PeerPool, send_pooled
from shared.transport.session import serve_frame

log = logging.getLogger("tandem.transport.tcp")

SOCKET_BUFFER = 4 << 20


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)


class PeerClosed(ConnectionError):
    def __init__(self, got: int, want: int) -> None:
        super().__init__(f"peer closed after {got} of {want} bytes")
        self.got = got


async def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    loop = asyncio.get_running_loop()
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise PeerClosed(got, len(view))
        got += n


class SocketChannel:
    """A Channel over a non-blocking socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def recv_into(self, buf: memoryview) -> None:
        await _recv_exact(self.sock, buf)

    async def send(self, data: bytes | memoryview) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def recv_parts(self, parts: list[memoryview], arrived: Callable[[int], None]) -> None:
        for i, part in enumerate(parts):  # a stream: the kernel buffers the next meanwhile
            await _recv_exact(self.sock, part)
            arrived(i)

    async def send_parts(self, parts: list[memoryview]) -> None:
        for part in parts:
            await self.send(part)


class TcpTransport:
    name = "tcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_conns_per_peer: int = 4,
        frame_timeout: float = 30.0,
        limits: AdmissionLimits | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.frame_timeout = frame_timeout
        self.connections = ConnectionTable(limits)
        self.backoff = AcceptBackoff()
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._pool = PeerPool(max_conns_per_peer, _connect, socket.socket.close)
        self._handler: ReceiveHandler | None = None

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    async def start(self, handler: ReceiveHandler) -> None:
        self._handler = handler
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._spawn(self._accept_loop())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        """Accept until closed, whatever accept raises (EMFILE, ENOBUFS, ...): a listener
        that ended on one error would leave the node deaf to KV for good."""
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(self._listener)
            except OSError as exc:
                out_of_fds = exc.errno in (errno.EMFILE, errno.ENFILE)
                freed = out_of_fds and self.connections.evict_oldest()  # a stranger's goes
                log.warning(
                    "accept failed (%s)%s; retrying in %.2fs",
                    exc, ", closed the oldest stranger" if freed else "", self.backoff.next,
                )  # fmt: skip
                await self.backoff.failed()
                continue
            self.backoff.ok()
            try:
                _tune(conn)
            except OSError:
                conn.close()
                continue
            serving: list[asyncio.Task[None]] = []  # evicting cancels it; its finally closes
            entry = self.connections.admit(str(address[0]), _canceller(serving))
            if entry is None:
                conn.close()
                continue
            serving.append(asyncio.ensure_future(self._serve(conn, entry)))
            self._tasks.add(serving[0])
            serving[0].add_done_callback(self._tasks.discard)
            # Also here, not only in _serve's `finally`: a task evicted before it first ran
            # never enters _serve, and its socket would stay open.
            serving[0].add_done_callback(functools.partial(_close_when_done, conn))

    async def _serve(self, conn: socket.socket, entry: Connection) -> None:
        assert self._handler is not None
        handler = self._handler
        table = self.connections
        try:
            while True:
                prefix = memoryview(bytearray(PREFIX.size))
                try:  # a peer's idle connection waits here; a stranger's only so long
                    async with asyncio.timeout(table.idle_deadline(entry)):
                        await _recv_exact(conn, prefix)
                except PeerClosed as exc:
                    if exc.got:
                        handler.failed(None, f"truncated: {exc}")
                    return
                except (OSError, TimeoutError):
                    return
                if not await serve_frame(
                    SocketChannel(conn), prefix, handler, self.frame_timeout, (OSError,),
                    lambda exc: f"truncated: {exc}",  # includes the peer closing mid-frame
                    header_timeout=table.header_deadline(entry),
                    admitted=lambda: table.prove(entry),
                ):  # fmt: skip
                    return
        finally:
            table.remove(entry)
            conn.close()

    async def send(
        self, peer: str, header: TransferHeader, payload: memoryview, timeout: float
    ) -> None:
        errors = (ConnectionError, OSError, WireFormatError)
        await send_pooled(self._pool, SocketChannel, peer, header, payload, timeout, errors)

    async def close(self) -> None:
        await cancel_and_wait(*self._tasks)
        if self._listener is not None:
            self._listener.close()
        self._pool.close()


def _close_when_done(conn: socket.socket, _: asyncio.Task[None]) -> None:
    conn.close()  # closing twice is harmless


def _canceller(tasks: list[asyncio.Task[None]]) -> Callable[[], None]:
    """Cancels the task that `tasks` holds by then (the connection's serving task)."""

    def cancel() -> None:
        tasks[0].cancel()

    return cancel


async def _connect(peer: str) -> socket.socket:
    host, _, port = peer.removeprefix("tcp://").rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    _tune(sock)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    except BaseException:
        sock.close()
        raise
    return sock
