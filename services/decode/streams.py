"""The request streams a decode node runs, shared by the parts that start them (a received
transfer, a local prefill) and the batch loop that feeds and ends them; and what those
parts ask of the worker that owns them (`DecodeNode`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace

from shared.telemetry.tracing import tracer

TRACER = tracer("decode")
T = TypeVar("T")


class DecodeNode(Protocol):
    """The worker, as its parts see it."""

    @property
    def draining(self) -> bool: ...

    def free_blocks(self) -> int:
        """Free KV blocks not reserved for transfers announced to this node."""
        ...

    async def on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on the engine thread (every engine call goes there, in order)."""
        ...


class Streams:
    """Request id → the token subject its deltas go to, and its `decode.stream` span."""

    def __init__(self, node_id: str, model: str = "") -> None:
        self.node_id = node_id
        self.model = model  # the served model (on each stream's span)
        self.subjects: dict[str, str] = {}
        self.handoffs: dict[str, int] = {}  # the handoff each runs here (its deltas say so)
        self.spans: dict[str, trace.Span] = {}
        # Set once a started stream may run: an idle batch loop waits on it.
        self.wake = asyncio.Event()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.subjects

    def start(
        self,
        request_id: str,
        token_subject: str,
        handoff: int,
        ctx: otel_context.Context | None = None,
    ) -> None:
        """A sequence joined this node's batch (`ctx`: its trace; None: the current one)."""
        self.spans[request_id] = TRACER.start_span(
            "decode.stream",
            context=ctx,
            attributes={"tandem.node_id": self.node_id, "tandem.model": self.model},
        )
        self.subjects[request_id] = token_subject
        self.handoffs[request_id] = handoff

    def end(self, request_id: str, tokens: int, reason: str, engine_steps: int) -> None:
        """It left (finished, cancelled, dropped): no more deltas; its span ends."""
        self.subjects.pop(request_id, None)
        self.handoffs.pop(request_id, None)
        span = self.spans.pop(request_id, None)
        if span is None:
            return
        if tokens >= 0:
            span.set_attribute("tandem.completion_tokens", tokens)
        span.set_attribute("tandem.finish_reason", reason)
        span.set_attribute("tandem.engine_steps_total", engine_steps)
        span.end()

    def running_contexts(self) -> list[trace.SpanContext]:
        """The span contexts of the streams running now (to link checkpoint spans to)."""
        return [span.get_span_context() for span in self.spans.values()]
