"""A request with `n` > 1: n independent samples of one prompt, as one response.

Each choice is a request of its own inside the cluster (its own attempt, journal entry,
failover and cancel), with its own seed: the request's `seed` plus the choice's index, or
a fresh seed each when none was given, so the samples differ. Choice 0 starts first; the
others start once a token of it came from its decode node, which then holds its prompt's
KV (a prefill node sends the first token before the KV):
they are sent there to prefill locally, which computes only what that node's cache does
not hold (the last partial block). The sharing is best effort: a node that refuses the
local prefill (no room) sends a choice the usual way, and it computes the prompt again.

The client sees one response: streamed, every choice's events with their `index` as they
come and one usage at the end; or one body with the n choices in order. One failed choice
fails the request, and the others are cancelled on every node. Such a response is not
resumable (a client knows none of the choices' ids): its header asking for it gets a 400.
"""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
from aiohttp import web
from opentelemetry import trace

from services.router import admission
from services.router.parts import RouterParts
from services.router.relay import (
    Progress,
    as_tandem_error,
    fail,
    finish,
    open_stream,
    run_choice,
)
from services.router.request import ServedRequest
from services.router.routing import PrefixRouter
from services.router.streams import StreamTimeout
from services.router.validation import ParsedRequest
from shared.errors import TandemError
from shared.sampling_params import SEED_LIMIT
from shared.telemetry.tracing import tracer

TRACER = tracer("router")


def choice_request(parsed: ParsedRequest, index: int) -> ParsedRequest:
    """Choice `index`'s request: one sample, its own seed."""
    params = parsed.params
    if params.seed is not None:
        params = msgspec.structs.replace(params, seed=(params.seed + index) % SEED_LIMIT)
    return dataclasses.replace(parsed, params=params, n=1)


async def serve_choices(
    parts: RouterParts,
    routing: PrefixRouter | None,
    http: web.Request,
    parsed: ParsedRequest,
    endpoint: str,
    admission_span: trace.Span,
    span: trace.Span,
) -> web.StreamResponse:
    """Start the choices (the first, then the rest once its decode node holds its KV) and
    relay them into one response."""
    first = await admission.start(
        parts, routing, http, choice_request(parsed, 0), endpoint, admission_span
    )
    admission_span.end()
    first.kv_placed = asyncio.Event()
    response = await open_stream(parts, http, first) if parsed.stream else None
    served: list[ServedRequest] = [first]
    tasks: list[asyncio.Task[Progress]] = [
        asyncio.create_task(run_choice(parts, first, response, span))
    ]
    try:
        await _placed_or_ended(first.kv_placed, tasks[0])
        for i in range(1, parsed.n):
            with TRACER.start_as_current_span("router.admission") as choice_span:
                choice_span.set_attribute("tandem.choice", i)
                more = await admission.start(
                    parts,
                    routing,
                    http,
                    choice_request(parsed, i),
                    endpoint,
                    choice_span,
                    beside=first.job.decode_node,
                )
            more.choice, more.shared_id = i, first.rid
            served.append(more)
            tasks.append(asyncio.create_task(run_choice(parts, more, response, span)))
        progress = await asyncio.gather(*tasks)
        return await finish(parts, list(zip(served, progress, strict=True)), response)
    except (TandemError, StreamTimeout, TimeoutError) as exc:
        return await fail(parts, first, response, span, as_tandem_error(exc, parts))
    finally:
        for task in tasks:  # an error or a client gone: the rest end too (and are cancelled)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _placed_or_ended(placed: asyncio.Event, first: asyncio.Task[Progress]) -> None:
    """Until choice 0's decode node holds its prompt's KV (or it ended: an error raises)."""
    waiter = asyncio.create_task(placed.wait())
    try:
        await asyncio.wait({waiter, first}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if first.done():
        first.result()  # raises what ended it
