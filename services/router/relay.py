"""Relaying one request's token deltas to its client, for new and resumed requests alike.

The relay writes each delta as a server-sent event exactly as OpenAI does (one `data:` line
and a blank line), which naive SSE readers (`vllm bench serve`, hand-written clients) need.
A client that asked for a resumable stream (the `X-Tandem-Resumable: true` request header;
streams picked up through the resume endpoint always are) also gets an `id:` line per
event, the delta's sequence number, so after losing its router it can reconnect with
`Last-Event-ID` and get the rest. Every block of delivered tokens also goes to the request
journal (in the background): what another router resumes from if this one dies.

Steps: open the response → stream the deltas → finish (usage, metrics, journal, the last
events) or fail (an error event or body) → release (a request that did not finish is
cancelled on every node).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from services.router.errors import error_body, error_response
from services.router.logprobs import LogprobsWriter, merge
from services.router.parts import RouterParts
from services.router.request import ServedRequest
from services.router.responses import Output, chunk, completion
from services.router.streams import StreamTimeout
from services.router.trim import tail_of
from shared.bus.messages import TokenDelta
from shared.errors import DeadlineError, GenerationError, TandemError
from shared.telemetry.tracing import tracer

log = logging.getLogger("tandem.router")
TRACER = tracer("router")


def sse(seq: int | None, body: object) -> bytes:
    """One server-sent event: `data: <json>` and a blank line, after `id: <seq>` if given."""
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}data: {json.dumps(body)}\n\n".encode()


@dataclass
class Progress:
    """What the stream loop has seen so far."""

    texts: list[str] = field(default_factory=list)
    reason: str | None = None
    completion_tokens: int = 0
    last_t: float = 0.0  # monotonic time of the latest delta
    decode_by: str = ""  # the decode node that made the tokens
    stream_span: trace.Span | None = None
    logprobs: LogprobsWriter | None = None  # the request asked for them
    echo: str = ""  # the prompt's text, shown before the output (completions' `echo`)
    usage: dict[str, int] = field(default_factory=dict)  # once finished


async def relay(
    parts: RouterParts, http: web.Request, served: ServedRequest, span: trace.Span
) -> web.StreamResponse:
    """Stream (or collect) the request's deltas; errors end it with an OpenAI error body."""
    response = await open_stream(parts, http, served) if served.parsed.stream else None
    try:
        progress = await run_choice(parts, served, response, span)
        return await finish(parts, [(served, progress)], response)
    except (TandemError, StreamTimeout, TimeoutError) as exc:
        return await fail(parts, served, response, span, as_tandem_error(exc, parts))


async def open_stream(
    parts: RouterParts, http: web.Request, served: ServedRequest
) -> web.StreamResponse:
    """The event stream's response, headers sent; if the client is gone already, the
    request leaves every node."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await response.prepare(http)
    except BaseException:
        await release(parts, served, finished=False)
        raise
    return response


async def run_choice(
    parts: RouterParts,
    served: ServedRequest,
    response: web.StreamResponse | None,
    span: trace.Span,
) -> Progress:
    """One request's (or one choice's) deltas to their end, its events written to a
    streaming `response` as they come; recorded and forgotten once complete. Raises what
    ended it otherwise (the request is then cancelled on every node)."""
    parts.inflight.watch(served.rid, served.failover)
    progress = Progress(
        last_t=served.start, logprobs=logprobs_writer(parts, served), echo=echo_text(parts, served)
    )
    finished = False
    try:
        deadline = parts.config.request_timeout - (time.monotonic() - served.start)
        async with asyncio.timeout(deadline):  # the whole request, however it streams
            await stream_deltas(parts, served, response, span, progress)
        finished = True
        progress.usage = record_finish(parts, served, progress)
        await served.journal.settle()
        await parts.journal.delete(served.rid, served.job.attempt_id)
        return progress
    finally:
        if progress.stream_span is not None:
            progress.stream_span.end()
        await release(parts, served, finished)


def logprobs_writer(parts: RouterParts, served: ServedRequest) -> LogprobsWriter | None:
    if served.parsed.params.logprobs is None:
        return None
    tok = parts.tokenizers.get(served.parsed.model)
    text_of = (lambda t: tok.decode([t])) if tok is not None else str
    return LogprobsWriter(served.parsed.chat, text_of)


def echo_text(parts: RouterParts, served: ServedRequest) -> str:
    parsed = served.parsed
    tok = parts.tokenizers.get(parsed.model)
    if not parsed.echo or tok is None:
        return ""
    return tok.decode(parsed.prompt_ids)


def as_tandem_error(exc: Exception, parts: RouterParts) -> TandemError:
    if isinstance(exc, TandemError):
        return exc
    if isinstance(exc, StreamTimeout):
        return DeadlineError(str(exc))
    return DeadlineError(f"request exceeded its deadline of {parts.config.request_timeout:g}s")


async def stream_deltas(
    parts: RouterParts,
    served: ServedRequest,
    response: web.StreamResponse | None,
    span: trace.Span,
    progress: Progress,
) -> None:
    """Every delta until the last: metrics, journal, standby, and the client's events."""
    config, stream, failover = parts.config, served.stream, served.failover
    first = True
    deltas = stream.deltas(
        config.first_token_timeout, config.stall_timeout, failover.lost, failover.resume
    )
    async for delta in deltas:
        if delta.error is not None:
            raise GenerationError(f"generation failed: {delta.error}", request_id=served.rid)
        if delta.first_seq <= served.skip_through < delta.seq:  # the client has part of it
            delta = tail_of(delta, served.skip_through + 1) or delta
        observe(parts, served, span, delta, progress, first)
        served.journal.delivered(stream.token_ids)
        if not failover.standby:
            await failover.warm_standby()
        text, part = shown(served, progress, delta)
        await send_event(served, response, delta, text, part)
        progress.texts.append(text)
        first = False


def shown(
    served: ServedRequest, progress: Progress, delta: TokenDelta
) -> tuple[str, dict[str, Any] | None]:
    """What the client sees of a delta: its text and its tokens' logprobs (if asked), an
    echo's prompt before the first, nothing of an output `max_tokens: 0` hid."""
    parsed, writer = served.parsed, progress.logprobs
    if delta.seq <= served.skip_through:  # the client has it (send_event says so)
        return delta.text, None
    echo = parsed.echo and delta.first_seq == 0
    prompt_part = None
    if echo and writer is not None:  # first: offsets count the prompt's text
        prompt_part = writer.add_prompt(parsed.prompt_ids, delta.prompt_logprobs)
    text, part = "", None
    if not parsed.hide_output:
        text = delta.text
        if writer is not None:
            part = writer.add(delta.token_ids, delta.logprobs)
    if echo:
        text = progress.echo + text
        if prompt_part is not None:
            part = prompt_part if part is None else merge(prompt_part, part)
    return text, part


def observe(
    parts: RouterParts,
    served: ServedRequest,
    span: trace.Span,
    delta: TokenDelta,
    progress: Progress,
    first: bool,
) -> None:
    """Latency metrics and spans for one delta; who made it."""
    metrics = parts.metrics
    now = time.monotonic()
    if first:
        parts.nodes.prefill_done(served.rid)  # no longer queued for a prefill anywhere
        metrics.ttft.labels(served.parsed.model).observe(now - served.start)
        span.add_event("first_token", {"tandem.prefill_node": delta.node_id})
        progress.stream_span = TRACER.start_span("router.stream")
        if served.route == "remote":  # else the decode node made it
            metrics.node_requests.labels("prefill", delta.node_id).inc()
    else:
        metrics.itl.labels(served.parsed.model).observe(now - progress.last_t)
    progress.last_t = now
    if delta.first_seq > 0 or served.route == "local":
        progress.decode_by = delta.node_id
        if served.kv_placed is not None:  # its decode node holds its prompt's KV now
            served.kv_placed.set()
    progress.completion_tokens = max(progress.completion_tokens, delta.completion_tokens)
    progress.reason = delta.finish_reason if delta.finished else None


async def send_event(
    served: ServedRequest,
    response: web.StreamResponse | None,
    delta: TokenDelta,
    text: str,
    logprobs: dict[str, Any] | None = None,
) -> None:
    """The delta's `text` (and its tokens' `logprobs`, if asked; `shown` makes both) to a
    streaming client (not what a resumed client has already)."""
    if delta.seq <= served.skip_through:  # the client has it (regenerated on resume)
        if not delta.finished:
            return
        text = ""  # it may not have seen the end: say it, without the text
    opening = delta.first_seq == 0
    if response is None or not (text or delta.finished or opening or logprobs):
        return
    reason = delta.finish_reason if delta.finished else None
    shape = served.shape
    body = chunk(
        served.parsed, served.response_id, shape.created, text, reason, opening, logprobs,
        served.choice,
    )  # fmt: skip
    await response.write(sse(delta.seq if served.shape.resumable else None, body))


async def finish(
    parts: RouterParts,
    choices: list[tuple[ServedRequest, Progress]],
    response: web.StreamResponse | None,
) -> web.StreamResponse:
    """Every choice is complete: count the request and send the last events (usage, if
    asked, summed over the choices) or the whole body."""
    served = choices[0][0]
    parsed, rid, created = served.parsed, served.response_id, served.shape.created
    parts.metrics.requests.labels(served.shape.endpoint, "200").inc()
    usage = dict(choices[0][1].usage)
    for _, progress in choices[1:]:  # one prompt, n outputs
        usage["completion_tokens"] += progress.usage["completion_tokens"]
        usage["total_tokens"] += progress.usage["completion_tokens"]
    if response is None:
        outputs = [
            Output(
                "".join(p.texts), p.reason, p.logprobs.whole() if p.logprobs is not None else None
            )
            for _, p in choices
        ]
        return web.json_response(completion(parsed, rid, created, outputs, usage))
    if parsed.include_usage:
        tail = chunk(parsed, rid, created, "", None, False)
        tail["choices"] = []
        tail["usage"] = usage
        await response.write(sse(None, tail))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def record_finish(parts: RouterParts, served: ServedRequest, progress: Progress) -> dict[str, int]:
    """Metrics, span and log line of a finished request; returns its usage."""
    metrics, tokens = parts.metrics, progress.completion_tokens
    visible = 0 if served.parsed.hide_output else tokens  # what the client is told it got
    if progress.stream_span is not None:
        progress.stream_span.set_attribute("tandem.completion_tokens", tokens)
    if progress.decode_by and (tokens > 1 or served.route == "local"):
        metrics.node_requests.labels("decode", progress.decode_by).inc()
    prompt_tokens = len(served.job.prompt_ids)
    elapsed = time.monotonic() - served.start
    model = served.parsed.model
    metrics.e2e.labels(model).observe(elapsed)
    metrics.prompt_tokens.labels(model).inc(prompt_tokens)
    metrics.output_tokens.labels(model).inc(tokens)
    metrics.prompt_tokens_sq.labels(model).inc(prompt_tokens * prompt_tokens)
    metrics.output_tokens_sq.labels(model).inc(tokens * tokens)
    if tokens > 1:
        metrics.tpot.labels(model).observe((progress.last_t - served.start) / tokens)
    log.info("finished: %d tokens (%s) in %.3fs", tokens, progress.reason, elapsed)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": visible,
        "total_tokens": prompt_tokens + visible,
    }


async def fail(
    parts: RouterParts,
    served: ServedRequest,
    response: web.StreamResponse | None,
    span: trace.Span,
    err: TandemError,
) -> web.StreamResponse:
    """An error ends the request: an error body, or an error event and [DONE] mid-stream."""
    span.set_status(Status(StatusCode.ERROR, err.message))
    status = str(err.http_status)
    parts.metrics.requests.labels(served.shape.endpoint, status).inc()
    parts.metrics.errors.labels(status).inc()
    if response is None:
        return error_response(err)
    await response.write(sse(None, error_body(err)))
    await response.write(b"data: [DONE]\n\n")
    return response


async def release(parts: RouterParts, served: ServedRequest, finished: bool) -> None:
    """The request leaves this router; one that did not finish leaves every node too."""
    parts.inflight.release(served.rid)
    parts.nodes.prefill_done(served.rid)  # ended before its first token: queued no more
    await served.stream.close()
    if not finished:
        # client gone, error or timeout: every node drops the request, blocks freed. The
        # nodes hear it at once; only the journal delete waits for a write in flight.
        await parts.dispatch.cancel(
            served.rid,
            served.job.attempt_id,
            "client disconnected or request failed",
            settle=served.journal.settle,
        )
