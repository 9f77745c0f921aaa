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
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from opentelemetry.trace import SpanKind

from services.router.errors import ApiError
from services.router.relay import Relay, relay
from services.router.streams import RequestStream
from services.router.validation import ParsedRequest
from shared.bus.messages import Cancel, JournalEntry
from shared.bus.topology import cancel_subject, token_subject
from shared.telemetry.logs import bind
from shared.telemetry.tracing import tracer

if TYPE_CHECKING:
    from services.router.app import Router

log = logging.getLogger("tandem.router.resume")
TRACER = tracer("router")

REQUEST_ID = re.compile(r"^(chatcmpl|cmpl)-[0-9a-f]{24}$")


def last_event_id(request: web.Request) -> int:
    """The seq of the last event the client has (-1: none), from the header or `?after=`."""
    raw = request.headers.get("Last-Event-ID", request.query.get("after", "-1")).strip()
    try:
        after = int(raw)
    except ValueError as exc:
        raise ApiError(
            400, "Last-Event-ID must be the integer id of an event", param="after"
        ) from exc
    if after < -1:
        raise ApiError(400, "Last-Event-ID must be >= -1", param="after")
    return after


def known_output(entry: JournalEntry, checkpointed: list[int] | None) -> list[int]:
    """The longest known prefix of the request's output (journal or checkpoint record)."""
    ours = list(entry.output_ids)
    if checkpointed and len(checkpointed) > len(ours) and checkpointed[: len(ours)] == ours:
        return list(checkpointed)
    return ours


async def resume_stream(router: Router, request: web.Request) -> web.StreamResponse:
    rid = request.match_info.get("request_id", "")
    with TRACER.start_as_current_span(
        "GET /v1/requests/{id}/stream",
        kind=SpanKind.SERVER,
        attributes={"http.request.method": "GET", "tandem.request_id": rid},
    ) as span:
        after = last_event_id(request)
        if not REQUEST_ID.match(rid):
            raise ApiError(404, f"no request {rid[:64]!r} to resume", param="request_id")
        found = await router.journal.get_with_revision(rid)
        if found is None or found[0].job is None:
            raise ApiError(
                404, "no such request in flight (finished, cancelled, or its lease ran out)"
            )
        entry, revision = found
        owner = entry.router_id
        if rid in router.active:
            raise ApiError(409, "this request is being streamed by this router already")
        if owner != router.config.node_id and owner in router.nodes.nodes:
            raise ApiError(409, f"this request is still served by router {owner}")
        assert entry.job is not None
        job = entry.job
        record = await router.journal.checkpoint(entry.internal_id)
        known = known_output(entry, record.output_ids if record else None)
        # Resume before the client's last token: regenerating it (not sent again) also
        # brings its finish reason if it was the last one.
        output = known[: max(0, min(after, len(known), job.params.max_tokens - 1))]
        blocks = router.blocks_needed(len(job.prompt_ids), job.params.max_tokens)
        node = router.nodes.pick_decode(blocks)
        if node is None:
            raise ApiError(
                503, "no decode node has room for this request", headers={"Retry-After": "2"}
            )
        internal = f"{rid}-r{uuid.uuid4().hex[:6]}"
        claimed = msgspec.structs.replace(
            entry,
            router_id=router.config.node_id,
            internal_id=internal,
            state="resumed",
            decode_node=node.node_id,
            output_ids=output,
            tokens_delivered=len(output),
        )
        if not await router.journal.claim(claimed, revision):
            raise ApiError(409, "another router resumed this request first")
        bind(request_id=rid)
        await router.bus.publish(
            cancel_subject(),
            Cancel(request_id=entry.internal_id, reason=f"resumed by {router.config.node_id}"),
        )
        job = msgspec.structs.replace(
            job,
            request_id=internal,
            transfer_id=internal,
            token_subject=token_subject(internal),
            decode_node=node.node_id,
            output_ids=output,
            deadline=time.time() + router.config.first_token_timeout,
        )
        stream = await RequestStream(router.bus, internal, output).open()
        try:
            await router.resubmit(node, job, blocks)
        except BaseException:
            await stream.close()
            raise
        router.metrics.resumes.inc()
        log.info(
            "resumed %s for its client after event %d: %d tokens known, resubmitted after %d "
            "(router %s had it)",
            rid, after, len(known), len(output), owner,
        )  # fmt: skip
        span.add_event("resumed", {"tandem.after": after, "tandem.output_tokens": len(output)})
        parsed = ParsedRequest(
            chat=entry.chat,
            model=entry.model,
            prompt_ids=job.prompt_ids,
            params=job.params,
            stream=True,
            include_usage=entry.include_usage,
        )
        resumed = Relay(
            parsed=parsed,
            rid=rid,
            job=job,
            stream=stream,
            entry=claimed,
            endpoint="resume",
            created=entry.created,
            route="resumed",
            blocks=blocks,
            start=time.monotonic(),
            skip_through=after,
            resumable=True,
        )
        return await relay(router, request, resumed, span)
