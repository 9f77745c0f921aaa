"""Background writes of KV blocks to the kvcache service, bounded and never in the way.

Prefill and decode nodes hand over blocks they filled and go on: the engine never waits on
cache I/O. Pending bytes are bounded; past the bound new blocks are dropped (counted), since
a block missing from the cache only costs a later recompute.

Writes are paced: a put carries at most `max_put_bytes`, and with a `rate` the next put waits
until the bytes so far would have taken that long at that rate. On a small machine the
engine's step shares the cores with the copy, checksums and sends of a put (here) and with
the kvcache node receiving it; one put of a whole wave's prompt blocks (hundreds of MB)
stalled every stream's next token for over a second, where the same bytes spread over
several steps cost each step a little.

Each batch written is a `kv.checkpoint` span (blocks, bytes, stored), linked to the spans
of the requests whose blocks it carries, so a request's trace leads to its checkpoints.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext

from shared.kvclient.client import KVCacheClient
from shared.tasks import WakeLoop
from shared.telemetry.tracing import tracer

log = logging.getLogger("tandem.kv_uploader")
TRACER = tracer("kv_uploader")
MAX_LINKS = 64  # of one checkpoint span: the requests it covers, bounded

MAX_BLOCKS_PER_PUT = 256
MAX_PUT_BYTES = 8 << 20  # per put unless told otherwise (at least one block)


class BlockUploader:
    def __init__(
        self,
        client: KVCacheClient,
        max_pending_bytes: int = 256 << 20,
        max_put_bytes: int = MAX_PUT_BYTES,
        rate: float = 0.0,
    ) -> None:
        """`rate`: bytes per second the puts are paced to (0: as fast as they go)."""
        if max_put_bytes <= 0 or rate < 0:
            raise ValueError("max_put_bytes must be positive and rate at least 0")
        self.client = client
        self.max_pending_bytes = max_pending_bytes
        self.max_put_bytes = max_put_bytes
        self.rate = rate
        self._free_at = 0.0  # monotonic time the next put may start at (with a rate)
        self.queue: deque[tuple[bytes, bytes | memoryview]] = deque()
        # (first, end) positions in the stream of queued blocks → called once all are stored
        self._after: deque[tuple[int, int, Callable[[], None]]] = deque()
        self._queued_total = 0  # blocks ever queued
        self._done_total = 0  # blocks ever taken off the queue
        self._failed_end = 0  # end position of the latest batch that failed
        self.pending_bytes = 0
        self.stored = 0
        self.dropped = 0
        self._loop = WakeLoop(self._round)
        self._idle = asyncio.Event()
        self._idle.set()
        # (first, end) positions of a submission's blocks → the requests they belong to: a
        # batch's span links every request with a block in it, however submissions split
        self._links: deque[tuple[int, int, list[SpanContext]]] = deque()

    def submit(
        self,
        hashes: Sequence[bytes],
        blocks: Sequence[bytes | memoryview],
        requests: Sequence[SpanContext] = (),
        on_stored: Callable[[], None] | None = None,
    ) -> int:
        """Queue blocks for storing; returns how many were accepted. `requests`: the span
        contexts of the requests the blocks belong to (linked from the checkpoint span).
        `on_stored`: called (on the event loop) once all of them are stored; not if any of
        them was dropped or failed."""
        accepted = 0
        for h, b in zip(hashes, blocks, strict=True):
            if self.pending_bytes + len(b) > self.max_pending_bytes:
                self.dropped += 1
                continue
            self.queue.append((h, b))
            self.pending_bytes += len(b)
            accepted += 1
        first = self._queued_total
        self._queued_total += accepted
        if on_stored is not None and accepted == len(hashes):
            self._after.append((first, self._queued_total, on_stored))
        valid = [c for c in requests if c.is_valid][:MAX_LINKS]
        if valid and accepted:
            self._links.append((first, self._queued_total, valid))
        if accepted:
            self._idle.clear()
            self._loop.wake()
        return accepted

    def start(self) -> BlockUploader:
        self._loop.start()
        return self

    async def _round(self) -> None:
        """Everything queued, a put at a time, paced to `rate` if set."""
        while self.queue:
            if self.rate and (wait := self._free_at - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            batch, nbytes = self._next_batch()
            links = self._batch_links(self._done_total, self._done_total + len(batch))
            if self.rate:  # the next put waits until these bytes' share of time is over
                self._free_at = max(self._free_at, time.monotonic()) + nbytes / self.rate
            with TRACER.start_as_current_span(
                "kv.checkpoint",
                context=trace.set_span_in_context(trace.INVALID_SPAN),  # a trace of its own
                links=links,
                attributes={"tandem.blocks": len(batch), "tandem.bytes": nbytes},
            ) as span:
                try:
                    stored = await self.client.store([h for h, _ in batch], [b for _, b in batch])
                    self.stored += stored
                    span.set_attribute("tandem.stored", stored)
                except Exception as exc:  # the client logs node failures; a bug guard
                    log.warning("storing %d blocks failed: %r", len(batch), exc)
                    span.record_exception(exc)
                    stored = 0
            self.pending_bytes -= nbytes
            self._batch_done(len(batch), stored == len(batch))
        self._idle.set()

    def _next_batch(self) -> tuple[list[tuple[bytes, bytes | memoryview]], int]:
        """The next put's blocks, up to `max_put_bytes` (one block at least), and their bytes."""
        batch = [self.queue.popleft()]
        size = len(batch[0][1])
        while self.queue and len(batch) < MAX_BLOCKS_PER_PUT:
            if size + len(self.queue[0][1]) > self.max_put_bytes:
                break
            size += len(self.queue[0][1])
            batch.append(self.queue.popleft())
        return batch, size

    def _batch_links(self, start: int, end: int) -> list[Link]:
        """Links to the requests with a block in positions [start, end), at most MAX_LINKS."""
        found: dict[tuple[int, int], SpanContext] = {}
        for first, last, contexts in self._links:
            if first >= end:
                break
            if last > start:
                for ctx in contexts:
                    if len(found) < MAX_LINKS:
                        found[(ctx.trace_id, ctx.span_id)] = ctx
        while self._links and self._links[0][1] <= end:  # wholly in this batch or before
            self._links.popleft()
        return [Link(c) for c in found.values()]

    def _batch_done(self, size: int, ok: bool) -> None:
        self._done_total += size
        if not ok:
            self._failed_end = self._done_total
        while self._after and self._after[0][1] <= self._done_total:
            first, _, callback = self._after.popleft()
            if first >= self._failed_end:  # no failed batch ended inside its range
                callback()

    async def drain(self, timeout: float) -> bool:
        """Wait until everything queued was handed over (or `timeout`); True if it was."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        await self._loop.close()
