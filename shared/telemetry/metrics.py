"""Per-node Prometheus metrics, served on a node's own metrics port.

Gauges read live engine and store state through callbacks at scrape time, so the hot path
only increments counters and observes histograms. A decode process hosting several models
(a node per model) serves them all on its one port, each sample labelled `model`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class NodeMetrics:
    """The metrics every model node exports; a role fills those that apply to it."""

    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # What the port serves: this registry, or several nodes' (`serve_models`)
        self._exposition = _Exposition(self.registry)
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
        # Exported where it can move: only a decode node steps prompt chunks beside running
        # decodes (elsewhere the counter exists, unregistered, and stays 0).
        self.chunked_steps = Counter(
            f"tandem_{role}_chunked_prefill_steps",
            "Steps that computed prompt chunks beside running decodes (chunked prefill)",
            registry=r if role == "decode" else None,
        )
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
        served = CollectorRegistry()
        served.register(self._exposition)
        return serve_registry(served, port, host)

    def serve_models(self, nodes: Mapping[str, NodeMetrics]) -> None:
        """From now on this node's port serves the metrics of every node of its process, a
        model each (served name → its node's metrics; this one's among them), every sample
        labelled with its model."""
        self._exposition.parts = {model: m.registry for model, m in nodes.items()}


class _Exposition:
    """A node's registry as it is, or several (by model) merged into one family per metric
    name with a `model` label: one exposition may name a metric family only once."""

    def __init__(self, own: CollectorRegistry) -> None:
        self.own = own
        self.parts: dict[str, CollectorRegistry] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.parts is None:
            yield from self.own.collect()
            return
        merged: dict[str, Metric] = {}
        for model, registry in self.parts.items():
            for family in registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = out
                for sample in family.samples:
                    out.samples.append(sample._replace(labels={**sample.labels, "model": model}))
        yield from merged.values()


def serve_registry(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> int:
    """Serve `registry` at /metrics on a listener of its own (a thread), on `port` (0 picks
    a free one); returns the port."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
