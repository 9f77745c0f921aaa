"""The router's HTTP endpoints: OpenAI-compatible completions and chat, the resume of a
stream, models, health, readiness and metrics.

A completion is admitted and started by admission.py and streamed by relay.py; a resume
is resume.py. The router's parts (node table, journal, dispatch, in-flight table,
metrics) are in parts.py; errors become responses in errors.py, once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.router import admission
from services.router.admission import resumable_requested
from services.router.choices import serve_choices
from services.router.errors import error_response
from services.router.parts import RouterParts
from services.router.relay import relay
from services.router.resume import resume_stream
from services.router.routing import PrefixRouter
from services.router.tokens_api import TokensApi
from shared.bus.workqueue import purge_steered
from shared.errors import InvalidRequestError, NotFoundError, RateLimitError, TandemError
from shared.model.tokenizer import TokenizerInfo
from shared.telemetry.tracing import tracer

log = logging.getLogger("tandem.router")
TRACER = tracer("router")


class Router:
    def __init__(
        self,
        parts: RouterParts,
        tokenizers: Mapping[str, TokenizerInfo],
        routing: PrefixRouter | None = None,
    ) -> None:
        self.parts = parts
        self.routing = routing
        self.tokenizers = tokenizers  # by served model name, the first the default
        self._background: set[asyncio.Future[None]] = set()
        # why the API port does not serve /metrics (services/router/main.py), or None
        self.metrics_refusal: str | None = None
        config = parts.config
        self.tokens = TokensApi(
            tokenizers, config.limits, config.max_body_bytes, config.body_timeout, parts.inflight
        )
        parts.nodes.on_leave.append(self.node_left)

    def node_left(self, node_id: str) -> None:
        """A node left the registry (every router sees that): its requests fail over, and
        jobs steered to it (a prefill node) leave its queue, as every router's requests
        waiting there fail over too. Not on a probe's verdict alone, which may be this
        router's only: another router's jobs there would wait on a node that is alive."""
        self.parts.inflight.node_lost(node_id)
        task = asyncio.ensure_future(purge_steered(self.parts.bus, node_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- generation ---------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        with TRACER.start_as_current_span(
            f"{request.method} {request.path}",
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.path},
        ) as span:
            response = await self._admit_and_relay(request, chat, span)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 400:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {response.status}"))
            return response

    async def _admit_and_relay(
        self, request: web.Request, chat: bool, span: trace.Span
    ) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        parts = self.parts
        admission_span = TRACER.start_span("router.admission")
        try:  # before a slot is taken: a slow body holds none (and gets a 408 at its deadline)
            body = await admission.read_body(
                request, parts.config.max_body_bytes, parts.config.body_timeout
            )
        except TandemError as exc:
            return self._refused(endpoint, admission_span, exc)
        # n choices are n sequences: each counts against the router's and the key's limits
        choices = admission.choices_asked(body, parts.config.limits)
        try:
            parts.inflight.check_room(choices)
        except RateLimitError as busy:
            return self._refused(endpoint, admission_span, busy)
        with parts.inflight.admit(choices):  # counted from here: tokenising is work
            try:
                claim = request.get("claim_key_slots")
                if claim is not None and choices > 1:
                    claim(choices - 1)
                parsed = await admission.admit(parts, request, chat, self.tokenizers, body)
            except TandemError as exc:
                return self._refused(endpoint, admission_span, exc)
            span.set_attribute("tandem.prompt_tokens", len(parsed.prompt_ids))
            span.set_attribute("tandem.max_tokens", parsed.params.max_tokens)
            try:
                if parsed.n > 1:
                    if resumable_requested(request):
                        raise InvalidRequestError(
                            "a response with n > 1 choices is not resumable", param="n"
                        )
                    return await serve_choices(
                        parts, self.routing, request, parsed, endpoint, admission_span, span
                    )
                served = await admission.start(
                    parts, self.routing, request, parsed, endpoint, admission_span
                )
            except TandemError as exc:
                span.set_status(Status(StatusCode.ERROR, exc.message))
                return self._refused(endpoint, admission_span, exc)
            admission_span.end()
            return await relay(parts, request, served, span)

    def _refused(self, endpoint: str, span: trace.Span, exc: TandemError) -> web.Response:
        status = str(exc.http_status)
        self.parts.metrics.requests.labels(endpoint, status).inc()
        self.parts.metrics.errors.labels(status).inc()
        span.set_status(Status(StatusCode.ERROR, exc.message))
        span.end()
        return error_response(exc)

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """A client of a router that died picks its stream up here (see resume.py)."""
        return await resume_stream(self.parts, request)

    # ---- the rest of the API ------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        models = [
            {"id": name, "object": "model", "created": 0, "owned_by": "tandem"}
            for name in self.tokenizers
        ]
        return web.json_response({"object": "list", "data": models})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """200 once every served model has its nodes (a router whose one model of several
        has none would turn its requests away: 503 until it has); which models are, too."""
        bus, nodes = self.parts.bus, self.parts.nodes
        models = {name: nodes.ready(name) for name in self.tokenizers}
        ok = bus.is_connected and all(models.values())
        body = {
            "ready": ok,
            "nats": bus.is_connected,
            "prefill": len(nodes.by_role("prefill")),
            "decode": len(nodes.by_role("decode")),
            "models": models,
        }
        return web.json_response(body, status=200 if ok else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        if self.metrics_refusal is not None:
            raise NotFoundError(self.metrics_refusal)
        return web.Response(
            body=generate_latest(self.parts.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )
