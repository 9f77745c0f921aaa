"""Background writes of running sequences' partial last blocks (tails) to the kvcache service.

After each step the engine hands over the tail of every sequence whose KV grew. Only the
latest tail of a request matters, so pending ones are replaced rather than queued, and
writes run one batch at a time: when the store is slower than the steps, tails are skipped,
never piled up, and the decode loop never waits. A request that ends here is forgotten.
"""

from __future__ import annotations

import asyncio
import logging

from shared.kv.tail import TailBlock
from shared.kvclient import KVCacheClient
from shared.tasks import cancel_and_wait

log = logging.getLogger("tandem.decode.tails")

MAX_TAILS_PER_PUT = 256


class TailUploader:
    def __init__(self, client: KVCacheClient) -> None:
        self.client = client
        self.latest: dict[str, TailBlock] = {}
        self.stored = 0
        self.skipped = 0  # replaced by a newer tail before being written
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def submit(self, tails: list[TailBlock]) -> None:
        for tail in tails:
            if self.latest.pop(tail.request_id, None) is not None:
                self.skipped += 1
            self.latest[tail.request_id] = tail
        if tails:
            self._wake.set()

    def forget(self, request_id: str) -> None:
        self.latest.pop(request_id, None)

    def start(self) -> TailUploader:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.latest:
                batch = [self.latest.pop(rid) for rid in list(self.latest)[:MAX_TAILS_PER_PUT]]
                try:
                    self.stored += await self.client.store_tails(batch)
                except Exception as exc:  # the client logs node failures; a bug guard
                    log.warning("storing %d tails failed: %r", len(batch), exc)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
