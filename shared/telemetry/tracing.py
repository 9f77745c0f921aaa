"""OpenTelemetry tracing for every service, configured by the standard OTEL_* variables.

With no `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) set, nothing is installed:
the API's no-op tracer costs a few attribute lookups per span. With one, spans go through a
batch processor (export happens off the hot path) to OTLP over HTTP/protobuf, or gRPC when
`OTEL_EXPORTER_OTLP_PROTOCOL=grpc` (the `tandem[grpc]` extra). Sampler settings
(`OTEL_TRACES_SAMPLER`, `..._ARG`) are read by the SDK itself.
"""

from __future__ import annotations

import atexit
import os
from typing import TYPE_CHECKING

from opentelemetry import trace

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

_installed = False
FLUSH_AT_EXIT_MS = 2000


def tracing_enabled() -> bool:
    return (
        bool(
            os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        )
        and os.environ.get("OTEL_TRACES_EXPORTER", "otlp") != "none"
    )


def setup_tracing(service: str, node_id: str) -> bool:
    """Install the SDK tracer provider once per process; False when tracing is off."""
    global _installed
    if _installed or not tracing_enabled():
        return _installed
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
    )
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # an extra: the default protocol needs no gRPC stack
            raise SystemExit(
                "error: OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the gRPC exporter: "
                "pip install 'tandem[grpc]' (or use http/protobuf, the default)"
            ) from exc
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    resource = Resource.create(
        {
            "service.name": os.environ.get("OTEL_SERVICE_NAME", f"tandem-{service}"),
            "service.instance.id": node_id,
            "tandem.role": service,
        }
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    atexit.register(_flush_and_shut, provider)
    _installed = True
    return True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(f"tandem.{name}")


def flush_tracing() -> None:
    """Export what is batched now (bounded), for a process about to end without atexit."""
    if _installed:  # the provider is then setup_tracing's SDK one
        provider = trace.get_tracer_provider()
        provider.force_flush(timeout_millis=FLUSH_AT_EXIT_MS)  # type: ignore[attr-defined]


def _flush_and_shut(provider: SdkTracerProvider) -> None:
    """Export what is batched when the service stops, within a bound: a collector that is
    down must not hold a stopping node past its orchestrator's grace period."""
    provider.force_flush(timeout_millis=FLUSH_AT_EXIT_MS)
    provider.shutdown()
