"""Resuming a stream whose router died: `GET /v1/requests/{id}/stream` on any router.

Every event of a resumable stream (asked for with `X-Tandem-Resumable: true`; every
stream this endpoint serves is one) carries `id: <seq>` (the index of the token it brings). A client
whose connection to its router broke reconnects, to this or any router, with the response
id it was given and `Last-Event-ID: <last id it received>` (or `?after=<seq>`), and gets
the rest of the stream in the same shape, no gap, no repeat.

The journal holds the request (prompt, parameters, seed) and a prefix of its output; decode
nodes' checkpoint records may know a longer one. The router claims the entry (one router
wins if two try), cancels the old attempt on every node, and submits a new attempt under a
new internal id after the tokens the client has: the prefill node loads their KV from the
kvcache service and recomputes at most the tail after the last stored block. Sampling is
(seed, position)-determined, so regenerated tokens equal the lost ones; those the client
has are not sent again. A request whose owner is alive is not taken from it (409).

Steps: find the entry (and refuse what cannot be resumed) → claim it with a new attempt →
cancel the old attempt and resubmit → relay, skipping what the client has.
"""

from __future__ import annotations

import hmac
import logging
import re
import time

import msgspec
from aiohttp import web
from opentelemetry.trace import SpanKind

from services.router.auth import request_owner
from services.router.failover import Failover
from services.router.parts import RouterParts
from services.router.relay import relay
from services.router.request import JournalWriter, ResponseShape, ServedRequest
from services.router.streams import RequestStream
from services.router.validation import ParsedRequest
from shared.bus.ids import AttemptId, attempt_id
from shared.bus.messages import Cancel, JournalEntry, NodeInfo, PrefillJob
from shared.bus.topology import cancel_subject, token_subject
from shared.errors import CapacityError, ConflictError, InvalidRequestError, NotFoundError
from shared.telemetry.logs import bind
from shared.telemetry.tracing import tracer

log = logging.getLogger("tandem.router.resume")
TRACER = tracer("router")

REQUEST_ID = re.compile(r"^(chatcmpl|cmpl)-[0-9a-f]{24}$")


def last_event_id(request: web.Request) -> int:
    """The seq of the last event the client has (-1: none), from the header or `?after=`."""
    raw = request.headers.get("Last-Event-ID", request.query.get("after", "-1")).strip()
    try:
        after = int(raw)
    except ValueError as exc:
        raise InvalidRequestError(
            "Last-Event-ID must be the integer id of an event", param="after"
        ) from exc
    if after < -1:
        raise InvalidRequestError("Last-Event-ID must be >= -1", param="after")
    return after


def known_output(entry: JournalEntry, checkpointed: list[int] | None) -> list[int]:
    """The longest known prefix of the request's output (journal or checkpoint record)."""
    ours = list(entry.output_ids)
    if checkpointed and len(checkpointed) > len(ours) and checkpointed[: len(ours)] == ours:
        return list(checkpointed)
    return ours


async def resume_stream(parts: RouterParts, request: web.Request) -> web.StreamResponse:
    rid = request.match_info.get("request_id", "")
    with TRACER.start_as_current_span(
        "GET /v1/requests/{id}/stream",
        kind=SpanKind.SERVER,
        attributes={"http.request.method": "GET", "tandem.request_id": rid},
    ) as span:
        after = last_event_id(request)
        entry, revision, job = await resumable_entry(parts, rid, request_owner(request))
        record = await parts.journal.checkpoint(entry.attempt_id)
        known = known_output(entry, record.output_ids if record else None)
        # Resume before the client's last token: regenerating it (not sent again) also
        # brings its finish reason if it was the last one.
        output = known[: max(0, min(after, len(known), job.params.max_tokens - 1))]
        model = job.model  # on a node serving its model
        blocks = parts.nodes.blocks_needed(len(job.prompt_ids), job.params.max_tokens, model)
        node = parts.nodes.pick_decode(blocks, model=model)
        if node is None:
            raise CapacityError("no decode node has room for this request", retry_after=2)
        claimed, job = await claim(parts, entry, revision, job, node, output)
        bind(request_id=rid)
        served = await resubmit(parts, claimed, entry.attempt_id, job, node, blocks, after)
        log.info(
            "resumed %s for its client after event %d: %d tokens known, resubmitted after %d "
            "(router %s had it)",
            rid, after, len(known), len(output), entry.router_id,
        )  # fmt: skip
        span.add_event("resumed", {"tandem.after": after, "tandem.output_tokens": len(output)})
        return await relay(parts, request, served, span)


async def resumable_entry(
    parts: RouterParts, rid: str, owner: str
) -> tuple[JournalEntry, int, PrefillJob]:
    """The request's journal entry and revision, if it can be resumed here and now, by the
    API key that made it (another key is told no such request: the same 404, so a
    response id alone says nothing about whether its request is in flight)."""
    if not REQUEST_ID.match(rid):
        raise NotFoundError(f"no request {rid[:64]!r} to resume", param="request_id")
    found = await parts.journal.get_with_revision(rid)
    gone = "no such request in flight (finished, cancelled, or its lease ran out)"
    if found is None or found[0].job is None:
        raise NotFoundError(gone)
    entry, revision = found
    if not hmac.compare_digest(entry.owner, owner):
        raise NotFoundError(gone)
    owner = entry.router_id
    if rid in parts.inflight:
        raise ConflictError("this request is being streamed by this router already")
    if owner != parts.config.node_id and owner in parts.nodes.nodes:
        raise ConflictError(f"this request is still served by router {owner}")
    assert entry.job is not None
    return entry, revision, entry.job


async def claim(
    parts: RouterParts,
    entry: JournalEntry,
    revision: int,
    job: PrefillJob,
    node: NodeInfo,
    output: list[int],
) -> tuple[JournalEntry, PrefillJob]:
    """Take the entry over under a new attempt (one router wins), and the attempt's job."""
    attempt = attempt_id(entry.request_id, takeover=True)
    job = msgspec.structs.replace(
        job,
        attempt_id=attempt,
        handoff=0,
        token_subject=token_subject(attempt),
        decode_node=node.node_id,
        output_ids=output,
        deadline=time.time() + parts.config.first_token_timeout,
        alone=False,  # said by the router that first sent it
    )
    claimed = msgspec.structs.replace(
        entry, router_id=parts.config.node_id, state="resumed", job=job, output_ids=output
    )
    if not await parts.journal.claim(claimed, revision):
        raise ConflictError("another router resumed this request first")
    return claimed, job


async def resubmit(
    parts: RouterParts,
    claimed: JournalEntry,
    old_attempt: AttemptId,
    job: PrefillJob,
    node: NodeInfo,
    blocks: int,
    after: int,
) -> ServedRequest:
    """Cancel the old attempt everywhere, send the new one, and make its ServedRequest."""
    reason = f"resumed by {parts.config.node_id}"
    await parts.bus.publish(cancel_subject(), Cancel(attempt_id=old_attempt, reason=reason))
    stream = await RequestStream(parts.bus, job.attempt_id, job.output_ids).open()
    try:
        await parts.dispatch.resubmit(node, job, blocks)
    except BaseException:
        await stream.close()
        raise
    parts.metrics.resumes.inc()
    parsed = ParsedRequest(
        chat=claimed.chat,
        model=job.model,
        prompt_ids=job.prompt_ids,
        params=job.params,
        stream=True,
        include_usage=claimed.include_usage,
        echo=claimed.echo,
        hide_output=claimed.hide_output,
    )
    return ServedRequest(
        rid=claimed.request_id,
        parsed=parsed,
        shape=ResponseShape("resume", claimed.created, resumable=True),
        stream=stream,
        journal=JournalWriter(parts.journal, claimed),
        failover=Failover(parts.dispatch, parts.metrics, job, stream, blocks),
        route="resumed",
        blocks=blocks,
        start=time.monotonic(),
        skip_through=after,
    )
