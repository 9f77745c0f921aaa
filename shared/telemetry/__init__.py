"""Telemetry: OpenTelemetry tracing set up from the standard OTEL_* environment."""
