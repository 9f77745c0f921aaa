"""The router's HTTP API: OpenAI-compatible completions and chat, health, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.router.errors import ApiError
from services.router.failover import Failover
from services.router.metrics import RouterMetrics
from services.router.nodes import NodeTable
from services.router.relay import Relay, relay
from services.router.routing import PrefixRouter
from services.router.streams import RequestStream
from services.router.validation import Limits, ParsedRequest, parse_request
from shared.bus.client import Bus
from shared.bus.journal import RequestJournal
from shared.bus.messages import Cancel, JournalEntry, NodeInfo, PrefillJob, encode
from shared.bus.params import new_seed
from shared.bus.topology import (
    REPLY_BY_HEADER,
    cancel_subject,
    local_prefill_subject,
    token_subject,
)
from shared.bus.tracing import inject_headers
from shared.bus.workqueue import purge_steered, submit_job
from shared.model.tokenizer import TokenizerInfo
from shared.telemetry.logs import bind
from shared.telemetry.tracing import tracer

log = logging.getLogger("tandem.router")
TRACER = tracer("router")

BLOCK_SIZE = 16
LOCAL_PREFILL_TIMEOUT = 2.0
REPLY_MARGIN = 0.5  # a decode node's "ok" must reach us before we stop waiting


RESUMABLE_HEADER = "X-Tandem-Resumable"


def resumable_requested(request: web.Request) -> bool:
    """Whether the client asked for `id:` lines (see relay.py): off unless it says so."""
    return request.headers.get(RESUMABLE_HEADER, "").strip().lower() in ("1", "true", "yes")


@dataclass
class RouterConfig:
    node_id: str = "router"
    max_inflight: int = 256
    max_body_bytes: int = 1 << 20
    first_token_timeout: float = 120.0
    stall_timeout: float = 30.0
    request_timeout: float = 600.0  # whole request, streaming included
    limits: Limits = field(default_factory=Limits)
    colocated: bool = False  # no prefill nodes: decode nodes prefill every request
    standby_after: int = 16  # delivered tokens before a stream gets a standby (0: never)


class Router:
    def __init__(
        self,
        config: RouterConfig,
        bus: Bus,
        tokenizer: TokenizerInfo,
        nodes: NodeTable,
        journal: RequestJournal,
        routing: PrefixRouter | None = None,
    ) -> None:
        self.config = config
        self.routing = routing
        self.bus = bus
        self.tok = tokenizer
        self.nodes = nodes
        self.journal = journal
        self.metrics = RouterMetrics()
        self.inflight = 0
        # request id → its failover state (told when the node serving it leaves)
        self.failovers: dict[str, Failover] = {}
        self.active: set[str] = set()  # client-facing ids of requests this process streams
        self._background: set[asyncio.Future[None]] = set()
        nodes.on_leave.append(self.node_left)

    # ---- helpers ----------------------------------------------------------------------------

    @staticmethod
    def blocks_needed(prompt_tokens: int, max_tokens: int) -> int:
        """KV blocks a request can come to fill (what a decode node must have room for)."""
        return -(-(prompt_tokens + max_tokens) // BLOCK_SIZE)

    async def _body(self, request: web.Request) -> Any:
        if (
            request.content_length is not None
            and request.content_length > self.config.max_body_bytes
        ):
            raise ApiError(413, f"request body exceeds {self.config.max_body_bytes} bytes")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(413, f"request body exceeds {self.config.max_body_bytes} bytes") from exc
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from exc

    # ---- endpoints --------------------------------------------------------------------------

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
            response = await self._generate_in_span(request, chat, span)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 400:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {response.status}"))
            return response

    async def _generate_in_span(
        self, request: web.Request, chat: bool, span: trace.Span
    ) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        admission = TRACER.start_span("router.admission")
        try:
            body = await self._body(request)
            parsed = parse_request(body, chat, self.tok, {self.tok.served_name}, self.config.limits)
            if self.inflight >= self.config.max_inflight:
                raise ApiError(
                    429, "too many requests in flight; retry shortly", headers={"Retry-After": "1"}
                )
            if not self.nodes.ready():
                raise ApiError(
                    503, "no prefill or decode node is available", headers={"Retry-After": "2"}
                )
        except ApiError as exc:
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            self.metrics.errors.labels(str(exc.status)).inc()
            admission.set_status(Status(StatusCode.ERROR, exc.message))
            admission.end()
            return exc.response()
        span.set_attribute("tandem.prompt_tokens", len(parsed.prompt_ids))
        span.set_attribute("tandem.max_tokens", parsed.params.max_tokens)
        self.inflight += 1
        self.metrics.inflight.inc()
        try:
            return await self._serve(request, parsed, endpoint, span, admission)
        finally:
            self.inflight -= 1
            self.metrics.inflight.dec()

    async def _serve(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        endpoint: str,
        span: trace.Span,
        admission: trace.Span,
    ) -> web.StreamResponse:
        rid = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex[:24]
        span.set_attribute("tandem.request_id", rid)
        bind(request_id=rid)
        created = int(time.time())
        start = time.monotonic()
        blocks = self.blocks_needed(len(parsed.prompt_ids), parsed.params.max_tokens)
        plan = self.routing.plan(parsed.prompt_ids, blocks) if self.routing else None
        local_node = plan.local_node if plan is not None else None
        decode_node = local_node or self.nodes.pick_decode(blocks)
        if plan is not None:
            admission.set_attribute("tandem.decode_cached_tokens", plan.decode_cached_tokens)
            admission.set_attribute("tandem.kvcache_cached_tokens", plan.kvcache_cached_tokens)
        if decode_node is None:
            admission.end()
            self.metrics.requests.labels(endpoint, "503").inc()
            return ApiError(
                503, "no decode node has room for this request", headers={"Retry-After": "2"}
            ).response()
        stream = await RequestStream(self.bus, rid).open()
        self.active.add(rid)  # from its first journal write on, the janitor leaves it alone
        try:
            seed = parsed.params.seed if parsed.params.seed is not None else new_seed()
            job = PrefillJob(
                request_id=rid,
                prompt_ids=parsed.prompt_ids,
                params=parsed.params,
                seed=seed,
                decode_node=decode_node.node_id,
                transfer_id=rid,
                token_subject=token_subject(rid),
                deadline=time.time() + self.config.first_token_timeout,
            )
            # In the journal before any node sees it: if this router dies from here on, a
            # client can resume it through another router (or the janitor cancels it).
            entry = JournalEntry(
                request_id=rid,
                state="queued",
                router_id=self.config.node_id,
                decode_node=decode_node.node_id,
                internal_id=rid,
                job=job,
                chat=parsed.chat,
                model=parsed.model,
                include_usage=parsed.include_usage,
                created=created,
            )
            await self.journal.put(entry)
            route, steered = "disaggregated", ""
            if local_node is not None and await self._send_local(local_node, job):
                route = "local"
            elif self.config.colocated:  # no prefill node to fall back on
                admission.end()
                raise ApiError(
                    503, "no decode node took the request; retry shortly",
                    headers={"Retry-After": "1"},
                )  # fmt: skip
            else:
                if local_node is not None:  # refused: the usual path, decode chosen by load
                    # Not that node if another has room: a late cancel of its attempt
                    # (it timed out) must not meet the request there again.
                    decode_node = self.nodes.pick_decode(blocks, {local_node.node_id}) or local_node
                    job = msgspec.structs.replace(job, decode_node=decode_node.node_id)
                elif plan is not None and plan.prefill_node is not None:
                    steered = plan.prefill_node.node_id  # its pool holds the prefix
                    self.nodes.inflight[steered] = self.nodes.inflight.get(steered, 0) + 1
                    self.metrics.steered.inc()
                    admission.set_attribute("tandem.prefill_node", steered)
                    admission.set_attribute(
                        "tandem.prefill_cached_tokens", plan.prefill_cached_tokens
                    )
                # carries the request span's trace context
                await submit_job(self.bus, job, prefill_node=steered)
            self.metrics.routes.labels(route).inc()
            log.info(
                "routed %s to %s%s: %d prompt tokens, %d cached on a decode node, %d in kvcache",
                route,
                decode_node.node_id,
                f" via {steered} ({plan.prefill_cached_tokens} cached there)"
                if steered and plan
                else "",
                len(parsed.prompt_ids),
                plan.decode_cached_tokens if plan else 0,
                plan.kvcache_cached_tokens if plan else 0,
            )
            admission.set_attribute("tandem.route", route)
            admission.set_attribute("tandem.decode_node", decode_node.node_id)
            admission.end()
            relayed = Relay(
                parsed=parsed,
                rid=rid,
                job=job,
                stream=stream,
                entry=entry,
                endpoint=endpoint,
                created=created,
                route=route,
                blocks=blocks,
                start=start,
                prefill_node=steered,
                resumable=resumable_requested(request),
            )
        except BaseException as exc:  # not admitted: nothing of it may stay anywhere
            self.active.discard(rid)
            await stream.close()
            await self.cancel(rid, rid, "not admitted")
            if not isinstance(exc, ApiError):
                raise
            span.set_status(Status(StatusCode.ERROR, exc.message))
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            self.metrics.errors.labels(str(exc.status)).inc()
            return exc.response()
        return await relay(self, request, relayed, span)

    def node_lost(self, node_id: str) -> None:
        """A node left or was declared dead: its requests fail over."""
        for failover in self.failovers.values():
            failover.node_left(node_id)

    def node_left(self, node_id: str) -> None:
        """A node left the registry (every router sees that): its requests fail over, and
        jobs steered to it (a prefill node) leave its queue, as every router's requests
        waiting there fail over too. Not on a probe's verdict alone, which may be this
        router's only: another router's jobs there would wait on a node that is alive."""
        self.node_lost(node_id)
        task = asyncio.ensure_future(purge_steered(self.bus, node_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def resubmit(self, node: NodeInfo, job: PrefillJob, blocks: int, attempt: int = 0) -> str:
        """A resumed request (failover, or a stream picked up after a router died): straight
        to the decode node, which loads the checkpointed KV itself and recomputes only the
        tail, no prefill node or transfer in the way; through the prefill queue if it
        refuses. Returns the path taken."""
        if await self._send_local(node, job, count=False):
            return "local"
        other = self.nodes.pick_decode(blocks, {node.node_id})
        if other is not None:  # not the node that refused or timed out (see _send_local)
            job = msgspec.structs.replace(job, decode_node=other.node_id)
        await submit_job(self.bus, job, attempt=attempt)
        return "disaggregated"

    async def _send_local(self, node: NodeInfo, job: PrefillJob, count: bool = True) -> bool:
        """Ask a decode node holding the prompt's prefix to prefill the rest itself."""
        assert self.bus.nc is not None
        # The node answers once the request is queued in its engine, after the step running
        # now. Colocated, that step may be a long prefill and there is no other path: wait.
        timeout = (
            self.config.first_token_timeout if self.config.colocated else LOCAL_PREFILL_TIMEOUT
        )
        # The node admits it only until shortly before we stop waiting: a late "ok" would
        # leave it running there as well as on the path taken instead.
        reply_by = time.time() + timeout - REPLY_MARGIN
        try:
            reply = await self.bus.nc.request(
                local_prefill_subject(node.node_id),
                encode(job),
                timeout=timeout,
                headers=inject_headers({REPLY_BY_HEADER: f"{reply_by:.3f}"}),
            )
        except Exception as exc:  # gone or slow: the disaggregated path still serves it
            log.warning("local prefill on %s failed: %s", node.node_id, exc)
            # Past reply_by it admits nothing; one admitted just before is dropped by this.
            await self.cancel_on(node.node_id, job.request_id, "local prefill timed out")
            return False
        if reply.data != b"ok":
            log.info("%s refused local prefill: %s", node.node_id, reply.data[:200])
            return False
        if count:
            self.nodes.inflight[node.node_id] = self.nodes.inflight.get(node.node_id, 0) + 1
        return True

    async def cancel_on(self, node_id: str, internal_id: str, reason: str) -> None:
        """Only `node_id` drops the request (a path or node it left; the others go on)."""
        cancel = Cancel(request_id=internal_id, reason=reason, node_id=node_id)
        try:
            await self.bus.publish(cancel_subject(), cancel)
        except Exception as exc:  # best effort: that node's lease frees the blocks anyway
            log.debug("cancel on %s not sent: %s", node_id, exc)

    async def cancel(
        self,
        rid: str,
        internal_id: str,
        reason: str,
        settle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Every node drops the request's current attempt; the journal forgets it (after
        `settle`, which lets a journal write in flight land so it can't re-create the entry)."""
        try:
            await self.bus.publish(cancel_subject(), Cancel(request_id=internal_id, reason=reason))
            if settle is not None:
                await settle()
            await self.journal.delete(rid, internal_id)
        except Exception as exc:  # best effort: nodes also expire work past its deadline
            log.warning("cancel of %s failed: %s", rid, exc)

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """A client of a router that died picks its stream up here (see resume.py)."""
        from services.router.resume import resume_stream  # it builds on this module

        return await resume_stream(self, request)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.tok.served_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "tandem",
                    }
                ],
            }
        )

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        ok = self.bus.is_connected and self.nodes.ready()
        body = {
            "ready": ok,
            "nats": self.bus.is_connected,
            "prefill": len(self.nodes.by_role("prefill")),
            "decode": len(self.nodes.by_role("decode")),
        }
        return web.json_response(body, status=200 if ok else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )
