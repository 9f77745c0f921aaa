"""Background writes of KV blocks to the kvcache service, bounded and never in the way.

Prefill and decode nodes hand over blocks they filled and go on: the engine never waits on
cache I/O. Pending bytes are bounded; past the bound new blocks are dropped (counted), since
a block missing from the cache only costs a later recompute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence

from shared.kvclient import KVCacheClient

log = logging.getLogger("tandem.kv_uploader")

MAX_BLOCKS_PER_PUT = 256


class BlockUploader:
    def __init__(self, client: KVCacheClient, max_pending_bytes: int = 256 << 20) -> None:
        self.client = client
        self.max_pending_bytes = max_pending_bytes
        self.queue: deque[tuple[bytes, bytes | memoryview]] = deque()
        self.pending_bytes = 0
        self.stored = 0
        self.dropped = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def submit(self, hashes: Sequence[bytes], blocks: Sequence[bytes | memoryview]) -> int:
        """Queue blocks for storing; returns how many were accepted."""
        accepted = 0
        for h, b in zip(hashes, blocks, strict=True):
            if self.pending_bytes + len(b) > self.max_pending_bytes:
                self.dropped += 1
                continue
            self.queue.append((h, b))
            self.pending_bytes += len(b)
            accepted += 1
        if accepted:
            self._idle.clear()
            self._wake.set()
        return accepted

    def start(self) -> BlockUploader:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                batch = [
                    self.queue.popleft() for _ in range(min(MAX_BLOCKS_PER_PUT, len(self.queue)))
                ]
                try:
                    self.stored += await self.client.store(
                        [h for h, _ in batch], [b for _, b in batch]
                    )
                except Exception as exc:  # the client logs node failures; this is a bug guard
                    log.warning("storing %d blocks failed: %r", len(batch), exc)
                self.pending_bytes -= sum(len(b) for _, b in batch)
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Wait until everything queued was handed over (or `timeout`); True if it was."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
