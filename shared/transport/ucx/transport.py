"""UCX transport (ucxx): the fast data plane; RDMA and GPU memory on clusters, TCP here.

Configuration, measured on these 2-core machines (docs/benchmarks-log.md has the table):
endpoints have peer-failure error handling ON, so a SIGKILLed peer surfaces as an
exception within ~5-15 ms instead of a hang. With error handling on UCX uses no shared
memory (cma has no peer-failure support; posix's is off by default, see below), so data
moves over TCP; the TCP segment size of
1 MiB switches large messages to UCX's zero-copy rendezvous, and the `blocking` progress
mode (the worker's event fd in the asyncio loop, no polling thread) gives another 2-3x:
together ~2-3.8 GB/s for 16 MiB against ~0.6 with defaults. Error handling OFF with `cma`
is faster (5-7 GB/s) but not safe: a sender dying mid-transfer makes UCX abort the
*receiving* process. `posix` shared memory with UCX_POSIX_ERROR_HANDLING=y keeps error
handling and is ~2x faster than TCP here, but a sender killed mid-transfer left the
receiver's worker wedged (busy forever, no further transfers) in ~1 of 4 kills. Every
UCX_* environment variable set by an operator (e.g. UCX_TLS=rc on InfiniBand) overrides
these defaults.

The protocol is `shared/transport/session.py`'s; each of its sends is one tagged UCX
message on a listener endpoint (payloads land straight in the handler's buffer), one
transfer per endpoint at a time; a small pool of endpoints per peer gives concurrency.
Nothing waits by spinning (`shared/transport/ucx/waits.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

from shared.errors import WireFormatError
from shared.tasks import cancel_and_wait
from shared.transport.admission import AdmissionLimits, Connection, ConnectionTable
from shared.transport.base import ReceiveHandler
from shared.transport.frames import PREFIX, TransferHeader
from shared.transport.pool import PeerPool, send_pooled
from shared.transport.session import serve_frame
from shared.transport.ucx import fixes, waits

log = logging.getLogger("tandem.transport.ucx")

DEFAULT_OPTIONS = {"TLS": "tcp", "TCP_TX_SEG_SIZE": "1M", "TCP_RX_SEG_SIZE": "1M"}
_initialised = False


def _ucxx() -> Any:
    """Import and initialise ucxx once per process (it has one context and worker)."""
    global _initialised
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx  # ~0.6 s: only processes that use UCX pay it

    if not _initialised:
        fixes.apply()
        fixes.after_progress.append(waits.notices.check)
        mode = os.environ.get("UCXPY_PROGRESS_MODE", "blocking")
        ucxx.init(options=dict(DEFAULT_OPTIONS), env_takes_precedence=True, progress_mode=mode)
        _initialised = True
    return ucxx


def _errors() -> tuple[type[BaseException], ...]:
    from ucxx.exceptions import UCXError

    return (UCXError, OSError, ConnectionError, WireFormatError)


# ucxx operations whose caller was cancelled (a deadline) before UCX finished with them.
_orphans: set[asyncio.Future[Any]] = set()


async def _guarded(op: Coroutine[Any, Any, Any]) -> None:
    """Run one ucxx send or receive so that cancelling the caller does not drop it.

    UCX cannot cancel a posted operation; it holds a raw pointer to the buffer until the
    operation completes (or the endpoint's abort cancels it). Cancelling the coroutine that
    awaits it used to free the buffer and the request while UCX could still write into
    them: a receive landing in freed memory corrupted the heap and the process crashed
    later, somewhere else (seen as a segfault in msgpack encoding). The operation runs as
    its own task instead, which keeps both alive; a cancelled caller leaves it in
    `_orphans` until it ends (the caller's `abort()` of the endpoint ends it).
    """
    task = asyncio.ensure_future(op)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        _orphans.add(task)
        task.add_done_callback(_retire)  # at once if it is done already
        raise


def _retire(task: asyncio.Future[Any]) -> None:
    _orphans.discard(task)
    if not task.cancelled():
        task.exception()  # its caller is gone: the error is nobody's to raise


async def settle_orphans(timeout: float) -> int:
    """Wait (bounded) for operations left by cancelled callers to end; how many remain."""
    if _orphans:
        await asyncio.wait(set(_orphans), timeout=timeout)
    return len(_orphans)


class EndpointChannel:
    """A Channel over a ucxx endpoint: each send is one tagged message."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep

    async def recv_into(self, buf: memoryview) -> None:
        await _guarded(waits.recv(self.ep, buf))

    async def send(self, data: bytes | memoryview) -> None:
        await _guarded(waits.send(self.ep, memoryview(data).cast("B")))

    async def recv_parts(self, parts: list[memoryview], arrived: Callable[[int], None]) -> None:
        """Receives posted WINDOW ahead (UCX matches them in posting order), so later parts
        land while `arrived` checks earlier ones."""
        await _in_order(lambda buf: waits.recv(self.ep, buf), parts, arrived)

    async def send_parts(self, parts: list[memoryview]) -> None:
        await _in_order(lambda buf: waits.send(self.ep, buf), parts, None)


# Parts of one transfer posted at once: enough to keep data moving while `arrived` checks
# the earliest, few enough that a 4 GiB transfer is not ~1,000 posted requests (each
# checked after every progress of the worker while it waits).
WINDOW = 8


async def _in_order(
    post: Callable[[memoryview], Coroutine[Any, Any, Any]],
    parts: list[memoryview],
    arrived: Callable[[int], None] | None,
) -> None:
    """Post an operation per part, at most WINDOW ahead of the earliest unfinished one, and
    await them in order. If this ends early (an error, a deadline), the ones still running
    stay referenced in `_orphans`, as in `_guarded`: UCX still holds their buffers."""
    ops: list[asyncio.Future[Any]] = []
    try:
        for i in range(len(parts)):
            while len(ops) < min(len(parts), i + WINDOW):
                ops.append(asyncio.ensure_future(post(parts[len(ops)])))
            await asyncio.shield(ops[i])
            if arrived is not None:
                arrived(i)
    except BaseException:
        for op in ops:
            if op.done():
                _retire(op)  # its error, if any, is this one's or moot
            else:
                _orphans.add(op)
                op.add_done_callback(_retire)
        raise


async def _connect(peer: str) -> Any:
    host, _, port = peer.removeprefix("ucx://").rpartition(":")
    return await _ucxx().create_endpoint(host, int(port), endpoint_error_handling=True)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _abort(ep: Any) -> None:
    with contextlib.suppress(*_errors()):
        ep.abort()


class UcxTransport:
    name = "ucx"

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
        # ucxx tells a listener nothing of a peer's address: strangers share one bucket
        self.connections = ConnectionTable(limits)
        self._listener: Any = None
        self._handler: ReceiveHandler | None = None
        # an endpoint whose peer died since it was pooled: UCX marked it closed
        self._pool: PeerPool[Any] = PeerPool(
            max_conns_per_peer, _connect, _abort, usable=lambda ep: not ep.closed
        )
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"ucx://{self.host}:{self.port}"

    async def start(self, handler: ReceiveHandler) -> None:
        ucxx = _ucxx()
        self._handler = handler

        async def on_connect(ep: Any) -> None:
            task = asyncio.current_task()
            entry = self.connections.admit("", task.cancel if task else ep.abort)
            if entry is None or task is None:
                _abort(ep)
                return
            self._tasks.add(task)
            try:
                await self._serve(ep, entry)
            finally:
                self._tasks.discard(task)

        self._listener = ucxx.create_listener(on_connect, port=self.port or None)
        self.port = int(self._listener.port)
        if self.host not in ("0.0.0.0", "::"):  # noqa: S104 (a comparison, not a bind)
            log.warning(
                "the UCX data port %d listens on every interface (ucxx's listener takes no "
                "address); %s is only the address peers are told. Firewall the port, or use "
                "--transport tcp, which binds to it (docs/security.md)", self.port, self.host,
            )  # fmt: skip

    async def _serve(self, ep: Any, entry: Connection) -> None:
        assert self._handler is not None
        errors = _errors()
        quiet: tuple[type[BaseException], ...] = (*errors, TimeoutError)
        table = self.connections
        try:
            while True:
                prefix = memoryview(bytearray(PREFIX.size))
                try:  # a peer's idle endpoint waits here; a stranger's only so long
                    async with asyncio.timeout(table.idle_deadline(entry)):
                        await waits.until_message(ep)
                        await EndpointChannel(ep).recv_into(prefix)
                except quiet:
                    return  # the peer closed or died between transfers, or never spoke
                if not await serve_frame(
                    EndpointChannel(ep), prefix, self._handler, self.frame_timeout, errors,
                    lambda exc: f"truncated: peer lost mid-transfer ({type(exc).__name__})",
                    header_timeout=table.header_deadline(entry),
                    admitted=lambda: table.prove(entry),
                ):  # fmt: skip
                    return
        finally:
            table.remove(entry)
            with contextlib.suppress(*errors):
                ep.abort()

    async def send(
        self, peer: str, header: TransferHeader, payload: memoryview, timeout: float
    ) -> None:
        await send_pooled(
            self._pool, EndpointChannel, peer, header, payload, timeout, _errors(), _describe
        )

    async def close(self) -> None:
        self._pool.close()
        await cancel_and_wait(*self._tasks)
        left = await settle_orphans(2.0)  # the endpoints are aborted: they end now
        if left:
            log.warning("%d UCX operations still pending at close", left)
        for _ in range(3):  # ucxx retires its handler records a loop turn after they end
            await asyncio.sleep(0)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
