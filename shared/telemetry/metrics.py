"""Per-node Prometheus metrics, served on a node's own metrics port.

Gauges read live engine and store state through callbacks at scrape time, so the hot path
only increments counters and observes histograms.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class NodeMetrics:
    """The metrics every model node exports; a role fills those that apply to it."""

    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.role = role
        self.batch_size = Histogram(
            f"tandem_{role}_batch_size",
            "Sequences per forward pass",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            f"tandem_{role}_step_seconds",
            "Duration of one forward pass",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(f"tandem_{role}_tokens", "Tokens computed", registry=r)
        self.transfer_bytes = Counter(
            "tandem_kv_transfer_bytes",
            "KV bytes moved on the data plane",
            ["direction"],
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "tandem_kv_transfer_seconds",
            "Duration of KV transfers",
            ["direction"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.errors = Counter("tandem_node_errors", "Errors by type", ["type"], registry=r)
        self.prefix_lookup_tokens = Counter(
            "tandem_prefix_cache_lookup_tokens",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "tandem_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            registry=r,
        )
        self.failovers = Counter(
            "tandem_failovers", "Requests resumed after a node failure", registry=r
        )
        self.resume_recomputed = Histogram(
            "tandem_resume_recomputed_tokens",
            "Per resumed request: context tokens recomputed (not loaded from a checkpoint)",
            buckets=(0, 1, 4, 8, 16, 32, 64, 128, 512, 2048, 8192),
            registry=r,
        )
        self.lease_lost = Counter(
            "tandem_lease_lost",
            "Times this node, cut off from NATS past its lease, dropped its sequences",
            registry=r,
        )

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        Gauge(name, doc, registry=self.registry).set_function(read)

    def serve(self, port: int | None, host: str = "127.0.0.1") -> int | None:
        """Serve /metrics on `port` (0 picks a free one); None leaves it off."""
        if port is None:
            return None
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
