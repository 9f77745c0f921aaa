"""The prefill service (built in its own issue; see ../../docs/architecture.md)."""
