"""Background writes of running sequences' partial last blocks (tails) to the kvcache service.

After each step the engine hands over, for every sequence whose KV grew, the rows the step
added to its tail (a piece), or the whole tail when a new block starts. Only the latest
state of a request matters: a pending piece is merged into what is pending for it, a whole
tail replaces it, and writes run one batch at a time. When the store is slower than the
steps, puts are merged, never piled up, and the decode loop never waits. When the store
cannot use a piece (its node was down, or lost the earlier rows), the engine is asked for
the whole tail next time (`on_lost`). A request that ends here is forgotten.

Puts start at most once per `interval` seconds. What a tail put costs hardly depends on its
size (a NATS request and a data-plane transfer, on this node and on the kvcache node), so on
two cores putting after every ~0.1 s step took 6-12% of decode throughput; waiting merges
the steps in between into one put. The price is at most the tokens of one interval
recomputed by a resume, instead of one (a short prefill of a few tokens costs about what one
token does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from shared.kv.tail import TailBlock, continues
from shared.kvclient.client import KVCacheClient
from shared.tasks import WakeLoop

log = logging.getLogger("tandem.decode.tails")

MAX_TAILS_PER_PUT = 256
MAX_PUT_BYTES = 16 << 20  # whole tails after a kvcache restart: a few puts, not one huge


def extend(tail: TailBlock, piece: TailBlock) -> TailBlock | None:
    """`tail` with `piece`'s rows appended, if `piece` continues exactly it: how a pending
    tail takes in the next step's piece before it is put."""
    if not continues(tail, piece):
        return None
    data = bytes(tail.data) + bytes(piece.data)
    return TailBlock(tail.request_id, tail.start, tail.parent, piece.token_ids, data, tail.first)


class TailUploader:
    def __init__(self, client: KVCacheClient, interval: float = 0.0) -> None:
        self.client = client
        self.interval = interval
        self.latest: dict[str, TailBlock] = {}
        self.stored = 0
        self.skipped = 0  # merged into or replaced by a newer one before being written
        self.lost = 0  # not stored whole: sent again whole
        self.on_lost: Callable[[list[str]], None] = lambda request_ids: None
        self._loop = WakeLoop(self._round, min_interval=interval)

    def submit(self, tails: list[TailBlock]) -> None:
        for tail in tails:
            pending = self.latest.pop(tail.request_id, None)
            if pending is not None:
                self.skipped += 1
                if tail.first:
                    merged = extend(pending, tail)
                    if merged is None:  # the engine hands pieces over in order: a bug guard
                        self._lost([tail.request_id])
                        continue
                    tail = merged
            self.latest[tail.request_id] = tail
        if tails:
            self._loop.wake()

    def forget(self, request_id: str) -> None:
        self.latest.pop(request_id, None)

    def _lost(self, request_ids: list[str]) -> None:
        """Ask for these tails whole; pieces pending for them would be lost as well."""
        for rid in request_ids:
            pending = self.latest.get(rid)
            if pending is not None and pending.first:
                del self.latest[rid]
        self.lost += len(request_ids)
        self.on_lost(request_ids)

    def start(self) -> TailUploader:
        self._loop.start()
        return self

    async def _round(self) -> None:
        """The tails pending now (pieces submitted while the round waited for its interval
        merged in); what arrives during the round waits for the next (it woke the loop)."""
        due = set(self.latest)
        while due & self.latest.keys():
            batch = self._next_batch(due)
            try:
                lost = await self.client.store_tails(batch)
            except Exception as exc:  # the client logs node failures; a bug guard
                log.warning("storing %d tails failed: %r", len(batch), exc)
                lost = [t.request_id for t in batch]
            self.stored += len(batch) - len(lost)
            if lost:
                self._lost(lost)

    def _next_batch(self, due: set[str]) -> list[TailBlock]:
        """The oldest pending tails of `due` (taken out of it), up to a put's count and
        bytes (at least one)."""
        batch: list[TailBlock] = []
        size = 0
        for rid in [r for r in self.latest if r in due][:MAX_TAILS_PER_PUT]:
            size += len(self.latest[rid].data)
            if batch and size > MAX_PUT_BYTES:
                break
            due.discard(rid)
            batch.append(self.latest.pop(rid))
        return batch

    async def close(self) -> None:
        await self._loop.close()
