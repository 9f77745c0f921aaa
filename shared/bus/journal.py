"""The request journal: request id → JournalEntry in a file-backed JetStream KV bucket.

It outlives any one router: after a router restart, the entries say which requests were in
flight, on which nodes, and how many tokens each client already received.
"""

from __future__ import annotations

import contextlib
import time

from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from shared.bus.client import Bus
from shared.bus.messages import JournalEntry, decode, encode
from shared.bus.topology import JOURNAL_BUCKET
from shared.errors import WireFormatError


class RequestJournal:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.kv: KeyValue | None = None

    async def start(self) -> RequestJournal:
        assert self.bus.js is not None
        self.kv = await self.bus.js.key_value(JOURNAL_BUCKET)
        return self

    async def put(self, entry: JournalEntry) -> None:
        assert self.kv is not None
        stamped = JournalEntry(
            request_id=entry.request_id,
            state=entry.state,
            router_id=entry.router_id,
            prefill_node=entry.prefill_node,
            decode_node=entry.decode_node,
            tokens_delivered=entry.tokens_delivered,
            updated_at=time.time(),
        )
        await self.kv.put(entry.request_id, encode(stamped))

    async def get(self, request_id: str) -> JournalEntry | None:
        assert self.kv is not None
        try:
            entry = await self.kv.get(request_id)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return decode(entry.value, JournalEntry)
        except WireFormatError as exc:
            self.bus.count_drop(f"$KV.{JOURNAL_BUCKET}.{request_id}", str(exc))
            return None

    async def delete(self, request_id: str) -> None:
        assert self.kv is not None
        with contextlib.suppress(KeyNotFoundError):
            await self.kv.delete(request_id)

    async def entries(self) -> list[JournalEntry]:
        assert self.kv is not None
        try:
            keys = await self.kv.keys()
        except NoKeysError:
            return []
        out = []
        for key in keys:
            entry = await self.get(key)
            if entry is not None:
                out.append(entry)
        return out
