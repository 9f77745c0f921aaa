"""Background writes of KV blocks to the kvcache service, bounded and never in the way.

Prefill and decode nodes hand over blocks they filled and go on: the engine never waits on
cache I/O. Pending bytes are bounded; past the bound new blocks are dropped (counted), since
a block missing from the cache only costs a later recompute.

Each batch written is a `kv.checkpoint` span (blocks, bytes, stored), linked to the spans
of the requests whose blocks it carries, so a request's trace leads to its checkpoints.
"""

from __future__ import annotations

import asyncio
import logging
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


class BlockUploader:
    def __init__(self, client: KVCacheClient, max_pending_bytes: int = 256 << 20) -> None:
        self.client = client
        self.max_pending_bytes = max_pending_bytes
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
        """Everything queued, a put at a time."""
        while self.queue:
            batch = [self.queue.popleft() for _ in range(min(MAX_BLOCKS_PER_PUT, len(self.queue)))]
            links = self._batch_links(self._done_total, self._done_total + len(batch))
            nbytes = sum(len(b) for _, b in batch)
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
            self.pending_bytes -= sum(len(b) for _, b in batch)
            self._batch_done(len(batch), stored == len(batch))
        self._idle.set()

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
