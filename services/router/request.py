"""One request on its way to its client: everything about it in one object.

A `ServedRequest` is made by admission (a new request) or by a resume (a stream picked up
after its router died) and handed to the relay, which streams it to the client. It holds
the request as parsed, the shape of its response, its current attempt (through its
failover state), its token stream and its journal writer; the router's tables and policies
stay with the router's parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import msgspec

from services.router.failover import Failover
from services.router.streams import RequestStream
from services.router.validation import ParsedRequest
from shared.bus.ids import RequestId
from shared.bus.journal import RequestJournal
from shared.bus.messages import JournalEntry, PrefillJob

log = logging.getLogger("tandem.router")

JOURNAL_EVERY = 16  # delivered tokens between journal updates (one KV block)


class JournalWriter:
    """Writes the request's delivered tokens to the journal every block, one write at a time."""

    def __init__(self, journal: RequestJournal, entry: JournalEntry) -> None:
        self.journal = journal
        self.entry = entry
        self.written = len(entry.output_ids)
        self.task: asyncio.Task[None] | None = None

    def delivered(self, token_ids: list[int]) -> None:
        if len(token_ids) - self.written < JOURNAL_EVERY or self.task is not None:
            return
        self.written = len(token_ids)
        self.entry = msgspec.structs.replace(
            self.entry, state="decoding", output_ids=list(token_ids)
        )
        self.task = asyncio.create_task(self._write(self.entry))

    async def settle(self) -> None:
        """Let a write in flight land first: else it could re-create a deleted entry."""
        if self.task is not None:
            with contextlib.suppress(Exception):
                await self.task

    async def _write(self, entry: JournalEntry) -> None:
        try:
            await asyncio.wait_for(self.journal.put(entry), 2.0)
        except Exception as exc:  # a later write or the delete at the end catches up
            log.warning("journal update of %s failed: %r", entry.request_id, exc)
        finally:
            self.task = None


@dataclass
class ResponseShape:
    """What the response looks like to its client."""

    endpoint: str  # completions | chat | resume (a metrics label)
    created: int  # unix seconds, in every chunk
    resumable: bool = False  # events carry `id: <seq>` lines (opt-in: naive readers break)


@dataclass
class ServedRequest:
    rid: RequestId  # what the client knows (the response id)
    parsed: ParsedRequest
    shape: ResponseShape
    stream: RequestStream
    journal: JournalWriter
    failover: Failover  # holds the current attempt (`job`), which a failover replaces
    route: str  # local | disaggregated | resumed
    blocks: int  # KV blocks the request can come to fill
    start: float  # monotonic
    skip_through: int = -1  # deltas up to this seq were delivered already (a resumed stream)
    # One of a request's `n` choices (services/router/choices.py): its index, the id the
    # client knows (the first choice's), and set at its first token from its decode node
    # (which then holds its prompt's KV, for the later choices to share; a prefill node
    # sends the first token before the KV).
    choice: int = 0
    shared_id: str = ""
    kv_placed: asyncio.Event | None = None

    @property
    def response_id(self) -> str:
        """The id in the client's events and body."""
        return self.shared_id or self.rid

    @property
    def job(self) -> PrefillJob:
        """The current attempt."""
        return self.failover.job
