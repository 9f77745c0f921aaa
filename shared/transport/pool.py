"""Connections a transport keeps per peer, and a send over one: both backends' pooling,
written once.

A transport sends one transfer at a time per connection and keeps a few connections per
peer for concurrency. A connection is returned to its peer's idle list only after a
transfer ended cleanly; one whose stream position is in doubt (error, cancel, deadline) is
discarded, never reused. The backend supplies how to connect, whether an idle connection
is still usable, and how to discard one (close a socket, abort a UCX endpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

from shared.transport.base import TransferError, TransferRejected
from shared.transport.frames import TransferHeader
from shared.transport.session import Channel, send_transfer

Conn = TypeVar("Conn")


class PeerPool(Generic[Conn]):
    """Idle connections per peer, and at most `max_per_peer` transfers to a peer at once."""

    def __init__(
        self,
        max_per_peer: int,
        connect: Callable[[str], Awaitable[Conn]],
        discard: Callable[[Conn], None],
        usable: Callable[[Conn], bool] = lambda conn: True,
    ) -> None:
        self.max_per_peer = max_per_peer
        self.idle: dict[str, list[Conn]] = defaultdict(list)
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._connect = connect
        self._discard = discard
        self._usable = usable

    async def checkout(self, peer: str) -> Conn:
        """The most recently returned usable idle connection to `peer`, or a new one."""
        idle = self.idle[peer]
        while idle:
            conn = idle.pop()
            if self._usable(conn):
                return conn
            self._discard(conn)
        return await self._connect(peer)

    @contextlib.asynccontextmanager
    async def lease(self, peer: str) -> AsyncIterator[Conn]:
        """A connection to `peer` for one transfer, within the peer's slots; back to the
        idle list if the body ends cleanly, discarded if it raises (or is cancelled)."""
        slots = self._slots.setdefault(peer, asyncio.Semaphore(self.max_per_peer))
        async with slots:
            conn = await self.checkout(peer)
            reusable = False
            try:
                yield conn
                reusable = True
            finally:
                if reusable:
                    self.idle[peer].append(conn)
                else:
                    self._discard(conn)

    def close(self) -> None:
        """Discard every idle connection."""
        for conns in self.idle.values():
            for conn in conns:
                self._discard(conn)
        self.idle.clear()


async def send_pooled(
    pool: PeerPool[Conn],
    channel: Callable[[Conn], Channel],
    peer: str,
    header: TransferHeader,
    payload: memoryview,
    timeout: float,
    errors: tuple[type[BaseException], ...],
    describe: Callable[[BaseException], str] = str,
) -> None:
    """One transfer over a pooled connection to `peer`, as `Transport.send` promises: a
    missed deadline or one of the backend's `errors` (worded by `describe`) raises
    TransferError, a refusal TransferRejected; both carry the request and transfer ids."""
    ids = {"request_id": header.request_id, "transfer_id": header.transfer_id}
    try:
        async with asyncio.timeout(timeout), pool.lease(peer) as conn:
            ok, reason = await send_transfer(channel(conn), header, payload, peer)
    except TimeoutError as exc:  # before `errors`: TimeoutError is an OSError
        reason = f"transfer to {peer} missed its {timeout}s deadline"
        raise TransferError(reason, **ids) from exc
    except errors as exc:
        raise TransferError(f"transfer to {peer} failed: {describe(exc)}", **ids) from exc
    if not ok:
        raise TransferRejected(reason, **ids)
