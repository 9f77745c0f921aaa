"""W3C trace context in NATS message headers (`traceparent`, `tracestate`)."""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry.propagate import extract, inject


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers with the current span's trace context added (no-op without an active span)."""
    carrier = dict(headers or {})
    inject(carrier)
    return carrier


def extract_context(headers: dict[str, str] | None) -> otel_context.Context:
    """The remote parent context carried by a message's headers."""
    return extract(headers or {})
