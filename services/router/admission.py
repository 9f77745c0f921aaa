"""A new request, from its HTTP body to its first attempt on the nodes.

Steps: **admit** (read and validate the body, bound the requests in flight, need a ready
cluster: any failure is an error response and nothing is queued anywhere) → **plan**
(where it runs: the decode node holding its prefix, if a short uncached tail lets it
prefill there, else the decode node with the most room and, when one holds the prefix,
the prefill node to steer it to) → **submit** (journal it, then send it on the planned
path; a refused local prefill falls back to the prefill queue). What comes back is the
`ServedRequest` the relay streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec
import nats.errors
from aiohttp import web
from opentelemetry import trace

from services.router.auth import request_owner
from services.router.failover import Failover
from services.router.parts import RouterParts
from services.router.placement import Plan, after_local_refusal, check_pool, plan, track_backlog
from services.router.request import JournalWriter, ResponseShape, ServedRequest
from services.router.routing import PrefixRouter
from services.router.streams import RequestStream
from services.router.tokenizing import FairThread
from services.router.validation import Limits, ParsedRequest, parse_request
from shared.bus.ids import RequestId, attempt_id, new_request_id
from shared.bus.messages import JournalEntry, NodeInfo, PrefillJob
from shared.bus.topology import token_subject
from shared.errors import (
    CapacityError,
    InvalidRequestError,
    PayloadTooLargeError,
    RequestTimeoutError,
)
from shared.model.tokenizer import TokenizerInfo
from shared.sampling_params import SamplingParams, seeded
from shared.telemetry.logs import bind

log = logging.getLogger("tandem.router")

RESUMABLE_HEADER = "X-Tandem-Resumable"


def resumable_requested(request: web.Request) -> bool:
    """Whether the client asked for `id:` lines (see relay.py): off unless it says so."""
    return request.headers.get(RESUMABLE_HEADER, "").strip().lower() in ("1", "true", "yes")


async def read_body(request: web.Request, max_bytes: int, timeout: float) -> Any:
    """The JSON body, within the size limit and `timeout` seconds (a trickled body holds
    its connection no longer)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise PayloadTooLargeError(f"request body exceeds {max_bytes} bytes")
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise PayloadTooLargeError(f"request body exceeds {max_bytes} bytes") from exc
    except TimeoutError as exc:
        raise RequestTimeoutError(f"request body not received within {timeout:g}s") from exc
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"invalid JSON body: {exc}") from exc
    except RecursionError as exc:  # `[[[[...` a few thousand deep fits in any body limit
        raise InvalidRequestError("invalid JSON body: nested too deeply") from exc


def choices_asked(body: Any, limits: Limits) -> int:
    """How many sequences a body asks for (its `n`, 1 when absent or not a valid count:
    the parse that follows refuses a bad one with its own message)."""
    n = body.get("n", 1) if isinstance(body, dict) else 1
    valid = isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= limits.max_n
    return int(n) if valid else 1


T = TypeVar("T")
# The one tokenising thread, its turns shared fairly between API keys (tokenizing.py); the
# calls waiting for it count as in flight (`InFlight.admit` is taken once the body is read,
# before it is parsed), so --max-inflight bounds its queue.
TOKENIZING = FairThread()


async def off_loop(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the tokenising thread, in the turn of `request`'s API key."""
    return await TOKENIZING.run(request_owner(request), fn, *args)


def salted_by_key(params: SamplingParams, owner: str) -> SamplingParams:
    """`params` with the API key's owner digest before its cache salt (--cache-isolation
    key): a key's cached blocks are named apart from every other key's. An open API has no
    key to isolate by."""
    if not owner:
        return params
    return msgspec.structs.replace(params, cache_salt=f"{owner}:{params.cache_salt}")


async def admit(
    parts: RouterParts,
    request: web.Request,
    chat: bool,
    tokenizers: Mapping[str, TokenizerInfo],
    body: Any,
) -> ParsedRequest:
    """The request of JSON `body`, validated, if this router takes it now (the caller holds
    its in-flight count). `tokenizers`: the served models' (its `model` picks one)."""
    parsed = await off_loop(request, parse_request, body, chat, tokenizers, parts.config.limits)
    if parts.config.isolate_cache_by_key:
        params = salted_by_key(parsed.params, request_owner(request))
        parsed = dataclasses.replace(parsed, params=params)
    if not parts.nodes.ready(parsed.model):
        raise CapacityError(
            f"no prefill or decode node of model {parsed.model!r} is available", retry_after=2
        )
    return parsed


def new_job(
    parts: RouterParts, parsed: ParsedRequest, rid: RequestId, node: NodeInfo
) -> PrefillJob:
    attempt = attempt_id(rid)
    return PrefillJob(
        attempt_id=attempt,
        prompt_ids=parsed.prompt_ids,
        params=seeded(parsed.params),
        decode_node=node.node_id,
        token_subject=token_subject(attempt),
        deadline=time.time() + parts.config.first_token_timeout,
        model=parsed.model,
        alone=parts.inflight.streaming <= {rid},
    )


def journal_entry(
    parts: RouterParts,
    parsed: ParsedRequest,
    rid: RequestId,
    job: PrefillJob,
    created: int,
    owner: str,
) -> JournalEntry:
    return JournalEntry(
        request_id=rid,
        state="queued",
        router_id=parts.config.node_id,
        job=job,
        chat=parsed.chat,
        include_usage=parsed.include_usage,
        created=created,
        owner=owner,
        echo=parsed.echo,
        hide_output=parsed.hide_output,
    )


async def submit(
    parts: RouterParts, plan: Plan, job: PrefillJob, span: trace.Span
) -> tuple[PrefillJob, str, str]:
    """Send the first attempt on its path; returns (the job as sent, route, steered-to)."""
    if plan.local:
        answer = await parts.dispatch.ask_local(plan.decode_node, job)
        if answer.accepted:
            return job, "local", ""
        if answer.invalid:  # the request, not the node: a retry would be refused too
            raise InvalidRequestError(answer.reason)
    check_pool(parts.nodes, plan.model)  # a prefill node to fall back on
    steered = ""
    if plan.local:  # refused: the usual path, decode node chosen by load
        node = after_local_refusal(parts.nodes, plan.decode_node, plan.blocks, plan.model)
        job = msgspec.structs.replace(job, decode_node=node.node_id)
    elif plan.prefix is not None and plan.prefix.prefill_node is not None:
        steered = plan.prefix.prefill_node.node_id  # its pool holds the prefix
        parts.nodes.sent(steered)
        parts.metrics.steered.inc()
        span.set_attribute("tandem.prefill_node", steered)
        span.set_attribute("tandem.prefill_cached_tokens", plan.prefix.prefill_cached_tokens)
    await parts.dispatch.submit(job, prefill_node=steered)  # carries the span's trace context
    return job, "remote", steered


async def start(
    parts: RouterParts,
    routing: PrefixRouter | None,
    request: web.Request,
    parsed: ParsedRequest,
    endpoint: str,
    span: trace.Span,
    beside: str = "",
) -> ServedRequest:
    """Plan and submit an admitted request; nothing of it stays anywhere if this fails.
    `beside`: a decode node that holds this prompt's KV (another choice of the request
    runs there): prefill locally there if it takes it, the usual way otherwise."""
    rid = new_request_id(parsed.chat)
    trace.get_current_span().set_attribute("tandem.request_id", rid)  # the request's span
    bind(request_id=rid, model=parsed.model)
    shape = ResponseShape(endpoint, int(time.time()), resumable_requested(request))
    start_t = time.monotonic()
    params = parsed.params
    span.set_attribute("tandem.model", parsed.model)
    where = plan(
        parts.nodes,
        routing,
        parsed.prompt_ids,
        params.max_tokens,
        span,
        params.cache_salt,
        parsed.model,
    )
    holder = parts.nodes.nodes.get(beside)
    if holder is not None and not holder.draining and not parts.config.colocated:
        where = dataclasses.replace(where, decode_node=holder, local=True)
    stream = await RequestStream(parts.bus, rid).open()
    parts.inflight.claim(rid)  # from its first journal write on, the janitor leaves it alone
    try:
        job = new_job(parts, parsed, rid, where.decode_node)
        entry = journal_entry(parts, parsed, rid, job, shape.created, request_owner(request))
        # In the journal before any node sees it: if this router dies from here on, a
        # client can resume it through another router (or the janitor cancels it).
        await stored("request", parts.journal.put(entry))
        job, route, steered = await stored("job", submit(parts, where, job, span))
    except BaseException:  # not admitted: nothing of it may stay anywhere
        parts.inflight.release(rid)
        await stream.close()
        await parts.dispatch.cancel(rid, attempt_id(rid), "not admitted")
        raise
    log_route(parsed, where, job, route, steered)
    track_backlog(parts.nodes, rid, where, route, len(parsed.prompt_ids))
    parts.metrics.routes.labels(route, parsed.model).inc()
    span.set_attribute("tandem.route", route)
    if where.prefix is not None and where.prefix.reason:
        span.set_attribute("tandem.route_reason", where.prefix.reason)
    span.set_attribute("tandem.decode_node", job.decode_node)
    failover = Failover(parts.dispatch, parts.metrics, job, stream, where.blocks, steered)
    return ServedRequest(
        rid=rid,
        parsed=parsed,
        shape=shape,
        stream=stream,
        journal=JournalWriter(parts.journal, entry),
        failover=failover,
        route=route,
        blocks=where.blocks,
        start=start_t,
    )


async def stored(what: str, write: Awaitable[T]) -> T:
    """A write to the cluster's store. Its refusal (the journal or the job queue full: they
    are bounded, shared/bus/topology.py; or NATS away) is a 503 the client may retry, and
    the router serves on."""
    try:
        return await write
    except (nats.errors.Error, TimeoutError) as exc:
        raise CapacityError(
            f"the cluster could not store the {what} ({exc!r}); retry shortly", retry_after=2
        ) from exc


def log_route(
    parsed: ParsedRequest, where: Plan, job: PrefillJob, route: str, steered: str
) -> None:
    prefix = where.prefix
    via = (
        f" via {steered} ({prefix.prefill_cached_tokens} cached there)"
        if steered and prefix
        else ""
    )
    if prefix is not None and prefix.reason:
        log.debug("route %s: %s", route, prefix.reason)
    log.info(
        "routed %s to %s%s: %d prompt tokens, %d cached on a decode node, %d in kvcache",
        route,
        job.decode_node,
        via,
        len(parsed.prompt_ids),
        prefix.decode_cached_tokens if prefix else 0,
        prefix.kvcache_cached_tokens if prefix else 0,
    )
