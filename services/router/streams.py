"""Per-request token streams: NATS token subject in, ordered deltas out.

Deltas carry a per-request sequence number (the index of the token they bring: the prefill
node sends 0, the decode node 1, 2, ...). Out-of-order deltas wait in a small buffer,
duplicates (a redelivered prefill job, a resumed decode) are dropped, so the client sees
each token exactly once and in order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.bus.client import Bus
from shared.bus.messages import TokenDelta, decode
from shared.bus.topology import token_subject
from shared.errors import WireFormatError

log = logging.getLogger("tandem.router.streams")

MAX_BUFFERED = 4096  # deltas held while waiting for a gap to fill


class StreamTimeout(Exception):
    pass


class RequestStream:
    def __init__(self, bus: Bus, request_id: str) -> None:
        self.bus = bus
        self.request_id = request_id
        self.next_seq = 0
        self.pending: dict[int, TokenDelta] = {}
        self.queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self.sub: Subscription | None = None
        self.duplicates = 0

    async def open(self) -> RequestStream:
        assert self.bus.nc is not None
        self.sub = await self.bus.nc.subscribe(token_subject(self.request_id), cb=self._on_msg)
        return self

    async def _on_msg(self, msg: Msg) -> None:
        try:
            delta = decode(msg.data, TokenDelta)
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            return
        if delta.error is not None:
            self.queue.put_nowait(delta)  # errors jump the order: the request is over
            return
        if delta.seq < self.next_seq or delta.seq in self.pending:
            self.duplicates += 1
            return
        if len(self.pending) >= MAX_BUFFERED:
            return
        self.pending[delta.seq] = delta
        while self.next_seq in self.pending:
            ready = self.pending.pop(self.next_seq)
            self.next_seq += 1
            self.queue.put_nowait(ready)

    async def deltas(self, first_timeout: float, stall_timeout: float) -> AsyncIterator[TokenDelta]:
        """Ordered deltas until one is finished or carries an error; StreamTimeout on stalls."""
        timeout = first_timeout
        while True:
            try:
                delta = await asyncio.wait_for(self.queue.get(), timeout)
            except TimeoutError as exc:
                raise StreamTimeout(
                    f"no token for {timeout:.0f}s (request {self.request_id})"
                ) from exc
            yield delta
            if delta.finished or delta.error is not None:
                return
            timeout = stall_timeout

    async def close(self) -> None:
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception as exc:  # connection closing: the server drops the interest
                log.debug("unsubscribe of %s failed: %s", self.request_id, exc)
            self.sub = None
