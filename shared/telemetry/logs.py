"""Structured logs (structlog): JSON lines, or readable console lines on a terminal.

Every record carries `service`, `node_id`, the current OpenTelemetry `trace_id`/`span_id`
(when a span is active) and any ids bound with `bind(request_id=...)`, so the lines of one
request can be joined across services by `trace_id`. The standard `logging` calls of the
code base and its libraries go through the same pipeline.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from opentelemetry import trace


def _add_trace_ids(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


# A log field's most characters. Ids, prompts' fragments and error texts can come from
# outside (a request id in a NATS message, a malformed frame): a client must not be able to
# write 256 KiB into every log line it causes.
MAX_FIELD_CHARS = 1024
MAX_EXCEPTION_CHARS = 16384  # tracebacks are ours, but carry messages that may quote input


def _cap(value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    return f"{value[:limit]}...[{len(value) - limit} more chars]"


def _cap_fields(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in event.items():
        limit = MAX_EXCEPTION_CHARS if key == "exception" else MAX_FIELD_CHARS
        if isinstance(value, str):
            event[key] = _cap(value, limit)
        elif not isinstance(value, (int, float, bool, type(None))):
            text = repr(value)
            if len(text) > limit:
                event[key] = _cap(text, limit)
    return event


def setup_logs(service: str, node_id: str, level: str = "INFO", json: bool | None = None) -> None:
    """Route all logging through structlog; JSON unless stderr is a terminal."""
    use_json = (not sys.stderr.isatty()) if json is None else json

    def add_identity(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("service", service)
        event.setdefault("node_id", node_id)
        return event

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_identity,
        _add_trace_ids,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.PositionalArgumentsFormatter()],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                _cap_fields,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    for noisy in ("nats", "asyncio", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def bind(**ids: str) -> None:
    """Attach ids (e.g. request_id) to every log line of the current task."""
    structlog.contextvars.bind_contextvars(**ids)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
