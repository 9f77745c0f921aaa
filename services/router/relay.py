"""Relaying one request's token deltas to its client, for new and resumed requests alike.

The relay writes each delta as a server-sent event exactly as OpenAI does (one `data:` line
and a blank line), which naive SSE readers (`vllm bench serve`, hand-written clients) need.
A client that asked for a resumable stream (the `X-Tandem-Resumable: true` request header;
streams picked up through the resume endpoint always are) also gets an `id:` line per
event, the delta's sequence number, so after losing its router it can reconnect with
`Last-Event-ID` and get the rest. Every block of delivered tokens also goes to the request
journal (in the background): what another router resumes from if this one dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from services.router.errors import ApiError
from services.router.failover import Failover
from services.router.responses import chunk, completion
from services.router.streams import RequestStream, StreamTimeout
from services.router.validation import ParsedRequest
from shared.bus.messages import JournalEntry, PrefillJob, TokenDelta
from shared.telemetry.tracing import tracer

if TYPE_CHECKING:
    from services.router.app import Router

log = logging.getLogger("tandem.router")
TRACER = tracer("router")

JOURNAL_EVERY = 16  # delivered tokens between journal updates (one KV block)


@dataclass
class Relay:
    """One request on its way to the client: what the stream loop needs."""

    parsed: ParsedRequest
    rid: str  # what the client knows
    job: PrefillJob  # the current attempt (its request_id is the id nodes know)
    stream: RequestStream
    entry: JournalEntry
    endpoint: str
    created: int
    route: str
    blocks: int
    start: float  # monotonic
    skip_through: int = -1  # deltas up to this seq were delivered already (a resumed stream)
    prefill_node: str = ""  # the job was steered to this prefill node's own queue
    resumable: bool = False  # events carry `id: <seq>` lines (opt-in: naive readers break)


def sse(seq: int | None, body: object) -> bytes:
    """One server-sent event: `data: <json>` and a blank line, after `id: <seq>` if given."""
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}data: {json.dumps(body)}\n\n".encode()


class JournalWriter:
    """Writes the request's delivered tokens to the journal every block, one write at a time."""

    def __init__(self, router: Router, entry: JournalEntry) -> None:
        self.router = router
        self.entry = entry
        self.written = len(entry.output_ids)
        self.task: asyncio.Task[None] | None = None

    def delivered(self, delta: TokenDelta, token_ids: list[int]) -> None:
        if len(token_ids) - self.written < JOURNAL_EVERY or self.task is not None:
            return
        self.written = len(token_ids)
        self.entry = msgspec.structs.replace(
            self.entry,
            state="decoding",
            decode_node=delta.node_id,
            tokens_delivered=len(token_ids),
            output_ids=list(token_ids),
        )
        self.task = asyncio.create_task(self._write(self.entry))

    async def settle(self) -> None:
        """Let a write in flight land first: else it could re-create a deleted entry."""
        if self.task is not None:
            with contextlib.suppress(Exception):
                await self.task

    async def _write(self, entry: JournalEntry) -> None:
        try:
            await asyncio.wait_for(self.router.journal.put(entry), 2.0)
        except Exception as exc:  # a later write or the delete at the end catches up
            log.warning("journal update of %s failed: %r", entry.request_id, exc)
        finally:
            self.task = None


async def relay(
    router: Router, request: web.Request, r: Relay, span: trace.Span
) -> web.StreamResponse:
    """Stream (or collect) the request's deltas; errors end it with an OpenAI error body."""
    parsed, rid = r.parsed, r.rid
    stream_span: trace.Span | None = None
    response: web.StreamResponse | None = None
    finished = False
    failover = Failover(router, r.job, r.stream, r.blocks, r.prefill_node)
    router.failovers[r.job.request_id] = failover
    router.active.add(rid)
    journal = JournalWriter(router, r.entry)
    try:
        if parsed.stream:
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
        texts: list[str] = []
        reason: str | None = None
        completion_tokens = 0
        first = True
        last_t = r.start
        decode_by = ""
        deadline = router.config.request_timeout - (time.monotonic() - r.start)
        async with asyncio.timeout(deadline):  # the whole request, however it streams
            async for delta in r.stream.deltas(
                router.config.first_token_timeout,
                router.config.stall_timeout,
                failover.lost,
                failover.resume,
            ):
                if delta.error is not None:
                    raise ApiError(503, f"generation failed: {delta.error}")
                now = time.monotonic()
                if first:
                    router.metrics.ttft.observe(now - r.start)
                    span.add_event("first_token", {"tandem.prefill_node": delta.node_id})
                    stream_span = TRACER.start_span("router.stream")
                    if r.route == "disaggregated":  # else the decode node made it
                        router.metrics.node_requests.labels("prefill", delta.node_id).inc()
                else:
                    router.metrics.itl.observe(now - last_t)
                last_t = now
                if delta.seq > 0 or r.route == "local":
                    decode_by = delta.node_id
                completion_tokens = max(completion_tokens, delta.completion_tokens)
                reason = delta.finish_reason if delta.finished else None
                journal.delivered(delta, r.stream.token_ids)
                if not failover.standby:
                    await failover.warm_standby()
                text = delta.text
                if delta.seq <= r.skip_through:  # the client has it (regenerated on resume)
                    if not delta.finished:
                        continue
                    text = ""  # it may not have seen the end: say it, without the text
                opening = delta.seq == 0
                if response is not None and (text or delta.finished or opening):
                    body = chunk(parsed, rid, r.created, text, reason, opening)
                    await response.write(sse(delta.seq if r.resumable else None, body))
                texts.append(delta.text)
                first = False
        finished = True
        if stream_span is not None:
            stream_span.set_attribute("tandem.completion_tokens", completion_tokens)
        if decode_by and (completion_tokens > 1 or r.route == "local"):
            router.metrics.node_requests.labels("decode", decode_by).inc()
        prompt_tokens = len(r.job.prompt_ids)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        elapsed = time.monotonic() - r.start
        router.metrics.e2e.observe(elapsed)
        router.metrics.prompt_tokens.inc(prompt_tokens)
        router.metrics.output_tokens.inc(completion_tokens)
        if completion_tokens > 1:
            router.metrics.tpot.observe((last_t - r.start) / completion_tokens)
        router.metrics.requests.labels(r.endpoint, "200").inc()
        log.info("finished: %d tokens (%s) in %.3fs", completion_tokens, reason, elapsed)
        await journal.settle()
        await router.journal.delete(rid, failover.job.request_id)
        if response is not None:
            if parsed.include_usage:
                tail = chunk(parsed, rid, r.created, "", None, False)
                tail["choices"] = []
                tail["usage"] = usage
                await response.write(sse(None, tail))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response(completion(parsed, rid, r.created, "".join(texts), reason, usage))
    except (ApiError, StreamTimeout, TimeoutError) as exc:
        if isinstance(exc, ApiError):
            err = exc
        elif isinstance(exc, StreamTimeout):
            err = ApiError(504, str(exc))
        else:
            err = ApiError(
                504, f"request exceeded its deadline of {router.config.request_timeout:g}s"
            )
        span.set_status(Status(StatusCode.ERROR, err.message))
        router.metrics.requests.labels(r.endpoint, str(err.status)).inc()
        router.metrics.errors.labels(str(err.status)).inc()
        if response is None:
            return err.response()
        await response.write(sse(None, err.body()))
        await response.write(b"data: [DONE]\n\n")
        return response
    finally:
        if stream_span is not None:
            stream_span.end()
        router.failovers.pop(failover.job.request_id, None)
        router.active.discard(rid)
        await r.stream.close()
        if not finished:
            # client gone, error or timeout: every node drops the request, blocks freed. The
            # nodes hear it at once; only the journal delete waits for a write in flight.
            await router.cancel(
                rid,
                failover.job.request_id,
                "client disconnected or request failed",
                settle=journal.settle,
            )
