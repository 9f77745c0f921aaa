"""The request journal: request id → JournalEntry in a file-backed JetStream KV bucket.

It outlives any one router: after a router dies, the entries say which requests were in
flight, on which nodes, how to resume them and which tokens their clients already have.
Decode nodes add checkpoint records beside them (`ckpt.<internal id>`): how far a sequence's
KV is stored in the kvcache service, with the tokens generated up to there.
"""

from __future__ import annotations

import contextlib
import time

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared.bus.client import Bus
from shared.bus.kv_keys import live_keys
from shared.bus.messages import CheckpointRecord, JournalEntry, M, decode, encode
from shared.bus.topology import JOURNAL_BUCKET
from shared.errors import WireFormatError

CHECKPOINT_PREFIX = "ckpt."


class RequestJournal:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.kv: KeyValue | None = None

    async def start(self) -> RequestJournal:
        assert self.bus.js is not None
        self.kv = await self.bus.js.key_value(JOURNAL_BUCKET)
        return self

    async def put(self, entry: JournalEntry) -> int:
        """Write the entry (stamped now); returns its revision."""
        assert self.kv is not None
        stamped = msgspec.structs.replace(entry, updated_at=time.time())
        return int(await self.kv.put(entry.request_id, encode(stamped)))

    async def claim(self, entry: JournalEntry, revision: int) -> bool:
        """Write the entry only if the stored one is still at `revision` (two routers
        resuming one request: one wins)."""
        assert self.kv is not None
        stamped = msgspec.structs.replace(entry, updated_at=time.time())
        try:
            await self.kv.update(entry.request_id, encode(stamped), last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def _read(self, key: str, kind: type[M]) -> tuple[M, int] | None:
        assert self.kv is not None
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return decode(entry.value, kind), int(entry.revision or 0)
        except WireFormatError as exc:
            self.bus.count_drop(f"$KV.{JOURNAL_BUCKET}.{key}", str(exc))
            return None

    async def get(self, request_id: str) -> JournalEntry | None:
        found = await self._read(request_id, JournalEntry)
        return found[0] if found else None

    async def get_with_revision(self, request_id: str) -> tuple[JournalEntry, int] | None:
        return await self._read(request_id, JournalEntry)

    async def delete(self, request_id: str, attempt_id: str = "") -> None:
        """Forget a request and the checkpoint record of its current attempt (ids.py)."""
        assert self.kv is not None
        with contextlib.suppress(KeyNotFoundError):
            await self.kv.delete(request_id)
        if attempt_id:
            with contextlib.suppress(KeyNotFoundError):
                await self.kv.delete(CHECKPOINT_PREFIX + attempt_id)

    async def delete_if(self, request_id: str, revision: int, attempt_id: str = "") -> bool:
        """Delete only if the entry is still at `revision` (not claimed by a resume since)."""
        assert self.kv is not None
        try:
            await self.kv.delete(request_id, last=revision)
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            return False
        if attempt_id:
            with contextlib.suppress(KeyNotFoundError):
                await self.kv.delete(CHECKPOINT_PREFIX + attempt_id)
        return True

    async def put_checkpoint(self, record: CheckpointRecord) -> None:
        assert self.kv is not None
        stamped = msgspec.structs.replace(record, timestamp=time.time())
        await self.kv.put(CHECKPOINT_PREFIX + record.attempt_id, encode(stamped))

    async def checkpoint(self, attempt_id: str) -> CheckpointRecord | None:
        found = await self._read(CHECKPOINT_PREFIX + attempt_id, CheckpointRecord)
        return found[0] if found else None

    async def entries(self) -> list[JournalEntry]:
        """Every request entry (checkpoint records left out)."""
        return [e for e, _ in await self.entries_with_revisions()]

    async def entries_with_revisions(self) -> list[tuple[JournalEntry, int]]:
        return (await self.scan())[0]

    async def scan(self) -> tuple[list[tuple[JournalEntry, int]], list[str]]:
        """Every request entry with its revision, and the ids checkpoint records are under."""
        assert self.kv is not None
        assert self.bus.js is not None
        keys = await live_keys(self.bus.js, JOURNAL_BUCKET)
        out = []
        records = []
        for key in keys:
            if key.startswith(CHECKPOINT_PREFIX):
                records.append(key[len(CHECKPOINT_PREFIX) :])
                continue
            found = await self._read(key, JournalEntry)
            if found is not None:
                out.append(found)
        return out, records

    async def delete_checkpoint(self, attempt_id: str) -> None:
        assert self.kv is not None
        with contextlib.suppress(KeyNotFoundError):
            await self.kv.delete(CHECKPOINT_PREFIX + attempt_id)
