"""The router's Prometheus metrics (one registry per process, served on /metrics).

The latency histograms, the routes and the token counters carry the served `model` of the
request (a cluster may serve several; dashboards sum over it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


def _latency(name: str, doc: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(name, doc, ["model"], buckets=LATENCY_BUCKETS, registry=registry)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tandem_requests_total",
            "Requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.errors = Counter("tandem_errors_total", "Errors by type", ["type"], registry=r)
        self.ttft = _latency("tandem_time_to_first_token_seconds", "Time to first token", r)
        self.tpot = _latency(
            "tandem_time_per_output_token_seconds", "Mean time per output token after the first", r
        )
        self.itl = _latency("tandem_inter_token_latency_seconds", "Gap between tokens", r)
        self.e2e = _latency("tandem_e2e_request_latency_seconds", "End-to-end latency", r)
        self.node_requests = Counter(
            "tandem_node_requests_total",
            "Requests served, by the node of each role that served them",
            ["role", "node"],
            registry=r,
        )
        self.routes = Counter(
            "tandem_router_routes_total",
            "Requests by route: local (prefilled on their decode node) or remote (on the "
            "prefill pool)",
            ["route", "model"],
            registry=r,
        )
        self.steered = Counter(
            "tandem_router_prefill_steered_total",
            "Disaggregated requests steered to the prefill node whose pool holds their prefix",
            registry=r,
        )
        self.failovers = Counter(
            "tandem_failovers_total",
            "Requests resumed on another node after theirs died or stalled",
            registry=r,
        )
        self.inflight = Gauge(
            "tandem_requests_in_flight",
            "Sequences admitted and not yet ended (what --max-inflight bounds: a request's "
            "choices each, /tokenize while it waits)",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens_total", "Prompt tokens", ["model"], registry=r
        )
        self.output_tokens = Counter(
            "tandem_output_tokens_total", "Output tokens", ["model"], registry=r
        )
        # Sums of squares beside the sums: over a window, the spread of the requests'
        # lengths (the SLO autoscaler sizes with it: a mix of long and short prompts fills
        # decode nodes' KV unevenly, and one of fixed mean length misjudged that by half)
        self.prompt_tokens_sq = Counter(
            "tandem_prompt_tokens_squared_total",
            "Sum over finished requests of the square of their prompt tokens",
            ["model"],
            registry=r,
        )
        self.output_tokens_sq = Counter(
            "tandem_output_tokens_squared_total",
            "Sum over finished requests of the square of their output tokens",
            ["model"],
            registry=r,
        )
        self.resumes = Counter(
            "tandem_stream_resumes_total",
            "Streams resumed by a client reconnecting with the request id (router restart)",
            registry=r,
        )
        self.expired = Counter(
            "tandem_requests_expired_total",
            "Requests of a dead router not resumed within the lease: cancelled, blocks freed",
            registry=r,
        )
