"""Per-request token streams: NATS token subject in, ordered deltas out.

Deltas carry a per-request sequence number (the index of the token they bring: the prefill
node sends 0, the decode node 1, 2, ...). Out-of-order deltas wait in a small buffer,
duplicates (a redelivered prefill job, a resumed decode) are dropped, so the client sees
each token exactly once and in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.router.trim import tail_of
from shared.bus.client import Bus
from shared.bus.messages import TokenDelta, decode
from shared.bus.topology import token_subject
from shared.errors import WireFormatError

log = logging.getLogger("tandem.router.streams")

MAX_BUFFERED = 4096  # deltas held while waiting for a gap to fill
# In-order deltas the client has not taken yet. A client that stops reading leaves its
# response's writes blocked while the nodes keep generating: past this, the stream ends with
# an error, and the relay then cancels the request on every node (its KV blocks freed).
MAX_QUEUED = 1024
# Deltas are published at most once (core NATS): a NATS restart or a cut link can lose
# some while later ones arrive. A gap unfilled this long means lost, not late: resume.
HOLE_WAIT = 1.0
TICK = 0.25  # how often a waiting stream looks for a gap


class StreamTimeout(Exception):
    pass


class RequestStream:
    def __init__(self, bus: Bus, request_id: str, output_ids: list[int] | None = None) -> None:
        """`output_ids`: tokens generated before (a resumed request): the stream starts after."""
        self.bus = bus
        self.request_id = request_id
        self.subject = token_subject(request_id)
        self.token_ids: list[int] = list(output_ids or [])  # of every in-order delta
        self.next_seq = len(self.token_ids)
        self.pending: dict[int, TokenDelta] = {}
        self.queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self.sub: Subscription | None = None
        self.duplicates = 0
        self.node_id = ""  # the node that sent the latest in-order delta
        self.last_delta_at = time.monotonic()  # when the latest in-order delta arrived
        self.itl: float | None = None  # moving average of the gap between decode steps
        self.hole_since: float | None = None  # a later delta is here, an earlier one not
        # The node the current attempt streams from once resumed: only a gap it leaves is a
        # loss (the node left behind may still send late deltas, ahead of the new one's).
        self.sender: str | None = None
        # The current handoff (a failover starts a new one): an error from an earlier
        # handoff's job is stale, the request lives on.
        self.handoff = 0
        self.stale_errors = 0
        self.stale_tokens = 0  # deltas of a superseded handoff, dropped
        self.overflowed = False  # MAX_QUEUED reached: the stream ends with an error
        self.ended = False  # the finished delta is in order (queued for the client)

    async def open(self) -> RequestStream:
        assert self.bus.nc is not None
        self.sub = await self.bus.nc.subscribe(self.subject, cb=self._on_msg)
        return self

    async def _on_msg(self, msg: Msg) -> None:
        if msg.subject != self.subject:  # delivered here by a JetStream consumer made to
            self.bus.count_drop(msg.subject, "not this stream's subject")  # forge tokens
            return
        try:
            delta = decode(msg.data, TokenDelta)
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            return
        if delta.error is not None:
            if delta.handoff is not None and delta.handoff != self.handoff:
                self.stale_errors += 1
                log.info("%s: dropped an error of superseded handoff %d: %s",
                         self.request_id, delta.handoff, delta.error)  # fmt: skip
                return
            self.queue.put_nowait(delta)  # errors jump the order: the request is over
            return
        if delta.handoff is not None and delta.handoff != self.handoff:
            self.stale_tokens += 1  # a node this request failed over from, still running
            return
        # Deltas are ordered by token index, not counted: one may bring several tokens.
        # One that overlaps what was delivered is cut to what is new (dropped whole if it
        # cannot be cut exactly: trim.py).
        first = delta.first_seq
        if first < self.next_seq <= delta.seq and (cut := tail_of(delta, self.next_seq)):
            delta, first = cut, self.next_seq
        if first < self.next_seq or first in self.pending:
            self.duplicates += 1
            return
        if len(self.pending) >= MAX_BUFFERED:
            return
        self.pending[first] = delta
        while self.next_seq in self.pending:
            ready = self.pending.pop(self.next_seq)
            self.next_seq = ready.seq + 1
            self.token_ids.extend(ready.token_ids)
            now = time.monotonic()
            if self.node_id == ready.node_id and self.next_seq > 2:  # a decode step's gap
                gap = now - self.last_delta_at
                self.itl = gap if self.itl is None else 0.8 * self.itl + 0.2 * gap
            self.node_id = ready.node_id
            self.last_delta_at = now
            self.ended = self.ended or ready.finished
            self._deliver(ready)
        if not self.pending:
            self.hole_since = None
        elif (
            self.hole_since is None
            and first in self.pending  # it skipped ahead
            and self.sender in (None, delta.node_id)  # and it is the current attempt's
        ):
            self.hole_since = time.monotonic()

    def _deliver(self, delta: TokenDelta) -> None:
        """Queue an in-order delta for the client; past MAX_QUEUED, an error once instead."""
        if self.overflowed:
            return
        if self.queue.qsize() >= MAX_QUEUED:
            self.overflowed = True
            error = f"the client did not read its stream ({MAX_QUEUED} deltas undelivered)"
            self.queue.put_nowait(TokenDelta(attempt_id=delta.attempt_id, error=error))
            return
        self.queue.put_nowait(delta)

    async def deltas(
        self,
        first_timeout: float,
        stall_timeout: float,
        lost: asyncio.Event | None = None,
        resume: Callable[[str], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Ordered deltas until one is finished or carries an error.

        A stall (no token within the timeout) or `lost` being set (the node streaming this
        request died) calls `resume(reason)`; when it returns True the stream waits on, for
        the resumed request's first token, else StreamTimeout is raised.
        """
        timeout = first_timeout
        while True:
            delta = await self._next(timeout, lost)
            if not isinstance(delta, TokenDelta):
                if delta == "hole":
                    reason = f"deltas after #{self.next_seq - 1} were lost"
                elif lost and lost.is_set():
                    reason = "its decode node was lost"
                else:
                    reason = f"no token for {timeout:.0f}s"
                if lost is not None:
                    lost.clear()
                self.hole_since = None
                if resume is not None and await resume(reason):
                    timeout = first_timeout
                    continue
                raise StreamTimeout(f"{reason} (request {self.request_id})")
            yield delta
            if delta.finished or delta.error is not None:
                return
            timeout = stall_timeout

    async def _next(self, timeout: float, lost: asyncio.Event | None) -> TokenDelta | str | None:
        """The next delta; None on timeout or when `lost` is set first; "hole" when a gap
        in the sequence stayed unfilled for HOLE_WAIT."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.queue.empty():
                return self.queue.get_nowait()
            now = time.monotonic()
            if lost is not None and lost.is_set():
                return None
            if self.hole_since is not None and now - self.hole_since > HOLE_WAIT:
                return "hole"
            if now >= deadline:
                return None
            get = asyncio.ensure_future(self.queue.get())
            waiters: set[asyncio.Future[object]] = {get}  # type: ignore[arg-type]
            lost_wait = asyncio.ensure_future(lost.wait()) if lost is not None else None
            if lost_wait is not None:
                waiters.add(lost_wait)  # type: ignore[arg-type]
            try:
                await asyncio.wait(
                    waiters, timeout=min(TICK, deadline - now), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                if lost_wait is not None:
                    lost_wait.cancel()
                if not get.done():
                    get.cancel()
            if get.done() and not get.cancelled():
                return get.result()

    async def close(self) -> None:
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception as exc:  # connection closing: the server drops the interest
                log.debug("unsubscribe of %s failed: %s", self.request_id, exc)
            self.sub = None
