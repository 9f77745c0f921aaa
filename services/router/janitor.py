"""The journal's janitor: requests of a dead router that nobody resumes are cancelled.

Every router runs one. An entry whose router has left the registry (or is this process's
earlier life: the id is the same, the request is not streaming here) is an orphan; once
it has been one for the lease (counted from its router's last heartbeat when known, and
never from before this janitor started, so that a restarted router gives its clients the
full lease to reconnect), every node drops its attempt and the entry goes. Its KV blocks
are then free within the lease; a resume inside the lease takes the entry away first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.router.parts import RouterParts

log = logging.getLogger("tandem.router.janitor")
STRAY_AFTER = 30.0  # seconds a checkpoint record no journal entry names is kept


class Janitor:
    def __init__(self, parts: RouterParts, lease: float = 5.0, interval: float = 1.0) -> None:
        self.parts = parts
        self.lease = lease
        self.interval = interval
        self.started = time.time()
        self.orphaned: dict[str, float] = {}  # request id → when its lease started

    def _owner_alive(self, router_id: str, rid: str) -> bool:
        if router_id == self.parts.config.node_id:
            return rid in self.parts.inflight
        return router_id in self.parts.nodes.nodes

    async def sweep(self) -> int:
        """One pass over the journal; returns how many requests it cancelled."""
        now = time.time()
        expired = 0
        seen = set()
        entries, records = await self.parts.journal.scan()
        await self._drop_stray_records(records, {e.attempt_id for e, _ in entries}, now)
        for entry, revision in entries:
            rid = entry.request_id
            if self._owner_alive(entry.router_id, rid):
                continue
            seen.add(rid)
            last_beat = self.parts.nodes.left_at.get(entry.router_id, entry.updated_at)
            since = self.orphaned.setdefault(rid, max(self.started, min(last_beat, now)))
            if now - since < self.lease:
                continue
            if not await self.parts.journal.delete_if(rid, revision, entry.attempt_id):
                continue  # resumed (claimed) meanwhile
            await self.parts.dispatch.cancel(rid, entry.attempt_id, "not resumed within the lease")
            self.parts.metrics.expired.inc()
            expired += 1
            log.warning(
                "%s: router %s is gone and no client resumed it within %.0fs: cancelled",
                rid, entry.router_id, self.lease,
            )  # fmt: skip
        for gone in list(self.orphaned):
            if gone not in seen:
                del self.orphaned[gone]
        return expired

    async def _drop_stray_records(self, records: list[str], live: set[str], now: float) -> None:
        """Checkpoint records of attempts no entry names (a record written just as its
        request finished) go once they are old enough not to be a request starting now."""
        for attempt in records:
            if attempt in live:
                continue
            record = await self.parts.journal.checkpoint(attempt)
            if record is None or now - record.timestamp > STRAY_AFTER:
                await self.parts.journal.delete_checkpoint(attempt)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sweep()
            except Exception as exc:  # NATS away: try again next round
                log.debug("journal sweep failed: %r", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
