"""Tandem's four services: router, prefill, decode and kvcache (each runs as its own process)."""
