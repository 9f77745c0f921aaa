"""The autoscaler's loop: sample the cluster, ask the policy, have the backend act.

Every `interval` it reads the node registry (running sequences, KV blocks, draining), the
prefill work queue's backlog (JetStream consumer info) and, when given a router URL, the
router's time-to-first-token histogram (p90 over the last interval, from bucket deltas).
Sampling failures are logged and skipped: a missed tick changes nothing.

A controller given a `model` scales that model's pool alone: it sees only that model's nodes,
its prefill queue and its requests' TTFT, and its backend starts and stops that model's
nodes. `run_controller` runs one such controller per model (each with its own policy, so
one model's load never starts or stops another's nodes) when it is given several.

Decode processes that host every model (`tandem up --shared-decode`) are one pool for all
models: each model's controller then scales its prefill nodes alone, and one more
controller scales the decode processes, seeing each process as one node (its models'
node entries summed: the sequences it runs for all of them; its KV use is the fullest
entry's, since they share one budget).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from nats.js.errors import NotFoundError
from prometheus_client.parser import text_string_to_metric_families

from shared.bus.auth import BusAuth
from shared.bus.client import Bus
from shared.bus.registry import NodeRegistry
from shared.bus.topology import PREFILL_STREAM, prefill_consumer
from shared.telemetry.metrics import serve_registry
from tandem.autoscale.metrics import AutoscaleMetrics
from tandem.autoscale.policies import policy_from_args
from tandem.autoscale.slo import SloPolicy
from tandem.autoscale.types import (
    ROLES,
    Backend,
    Decision,
    NodeSample,
    Observation,
    RouterCounts,
)

log = logging.getLogger("tandem.autoscale")
TTFT = "tandem_time_to_first_token_seconds"
COUNTS = {
    TTFT + "_count": "requests",
    "tandem_prompt_tokens_total": "prompt_tokens",
    "tandem_output_tokens_total": "output_tokens",
    "tandem_router_routes_total": "arrivals",  # each admitted request, local or remote
    "tandem_prompt_tokens_squared_total": "prompt_sq",
    "tandem_output_tokens_squared_total": "output_sq",
}


class Deciding(Protocol):
    """What the controller needs of a policy (tandem/autoscale/policy.py's Policy)."""

    def observe(self, obs: Observation, current: dict[str, int]) -> list[Decision]: ...


def ttft_buckets(metrics_text: str, model: str | None = None) -> dict[float, float]:
    """Cumulative counts of the router's TTFT histogram by upper bound: one model's, or
    summed over its models (`model` None: one pool serves them all)."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == TTFT + "_bucket" and model in (None, s.labels.get("model")):
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def router_counts(metrics_text: str, model: str | None = None) -> RouterCounts:
    """The router's cumulative request and token counts: one model's, or summed."""
    out = dict.fromkeys(COUNTS.values(), 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name in COUNTS and model in (None, s.labels.get("model")):
                out[COUNTS[s.name]] += s.value
    return RouterCounts(**out)


def p90_between(before: dict[float, float], now: dict[float, float]) -> float | None:
    """The 90th percentile of what was observed between two histogram readings, as the
    upper bound of the bucket holding it (None: nothing observed)."""
    bounds = sorted(now)
    deltas = [now[b] - before.get(b, 0.0) for b in bounds]
    if not deltas or deltas[-1] <= 0:
        return None
    target = 0.9 * deltas[-1]
    for bound, count in zip(bounds, deltas, strict=True):
        if count >= target:
            return bound
    return bounds[-1]


def per_process(nodes: list[NodeSample], hosts: Mapping[str, str]) -> list[NodeSample]:
    """Decode node entries of one process (`hosts`: node id → its process's, for the
    nodes of processes hosting several models) as one sample named after the process:
    the sequences all of them run, the KV use of the fullest (one budget shared), draining
    if any is. Other nodes are as they were."""
    out: list[NodeSample] = []
    groups: dict[str, list[NodeSample]] = {}
    for n in nodes:
        host = hosts.get(n.node_id)
        if n.role == "decode" and host:
            groups.setdefault(host, []).append(n)
        else:
            out.append(n)
    for host, group in sorted(groups.items()):
        fullest = max(group, key=lambda n: n.kv_used)
        out.append(
            NodeSample(
                node_id=host,
                role="decode",
                running=sum(n.running for n in group),
                free_kv_blocks=fullest.free_kv_blocks,
                total_kv_blocks=fullest.total_kv_blocks,
                draining=any(n.draining for n in group),
            )
        )
    return out


@dataclass
class Controller:
    bus: Bus
    backend: Backend
    policy: Deciding
    router_url: str | None = None
    interval: float = 1.0
    decisions: deque[tuple[float, Decision]] = field(default_factory=lambda: deque(maxlen=1000))
    history: deque[Observation] = field(default_factory=lambda: deque(maxlen=3600))
    on_decision: Callable[[Decision], None] | None = None
    model: str | None = None  # the model whose pool this scales (None: every node)
    roles: tuple[str, ...] = ROLES  # the roles it scales (a shared decode pool: its own)
    by_process: bool = False  # a decode process hosting several models is one node
    _registry: NodeRegistry | None = None
    _buckets: dict[float, float] = field(default_factory=dict)
    _infeasible: bool = False  # the SLO policy's last word on it (logged when it changes)
    metrics: AutoscaleMetrics | None = None  # exported on --scale-metrics-port, if given

    async def sample(self) -> Observation:
        if self._registry is None:
            self._registry = await NodeRegistry(self.bus).start()
        entries = (await self._registry.nodes()).values()
        nodes = [
            NodeSample(
                node_id=n.node_id,
                role=n.role,
                running=n.running if n.role == "decode" else n.load,
                free_kv_blocks=n.free_kv_blocks,
                total_kv_blocks=n.total_kv_blocks,
                draining=n.draining,
            )
            for n in entries
            if n.role in ROLES and self.model in (None, n.model)
        ]
        if self.by_process:
            nodes = per_process(nodes, {n.node_id: n.host for n in entries if n.host})
        if self.model is not None:
            models = {self.model}
        else:
            models = {n.model for n in entries if n.role == "prefill"} | {""}
        ttft, counts = await self._router()
        return Observation(
            time=time.monotonic(),
            nodes=nodes,
            prefill_queue=await self._queue_depth(models),
            ttft_p90=ttft,
            router=counts,
        )

    async def _queue_depth(self, models: set[str]) -> int:
        """Jobs waiting in the shared queues of the models the prefill nodes serve (and of
        jobs naming none)."""
        assert self.bus.js is not None
        depth = 0
        for model in sorted(models):
            try:
                info = await self.bus.js.consumer_info(PREFILL_STREAM, prefill_consumer(model))
            except NotFoundError:  # no node of that model has made it yet
                continue
            depth += int(info.num_pending or 0)
        return depth

    async def _router(self) -> tuple[float | None, RouterCounts | None]:
        """The router's TTFT p90 since the last tick and its counts (None, None: no URL,
        or it could not be read this tick)."""
        if not self.router_url:
            return None, None
        url = self.router_url.rstrip("/") + "/metrics"

        def fetch() -> str:
            with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - operator's URL
                return str(resp.read().decode())

        try:
            text = await asyncio.to_thread(fetch)
        except OSError as exc:
            log.warning("router metrics unreadable this tick: %s", exc)
            return None, None
        now = ttft_buckets(text, self.model)
        before, self._buckets = self._buckets, now
        return (p90_between(before, now) if before else None), router_counts(text, self.model)

    async def tick(self) -> list[Decision]:
        obs = await self.sample()
        self.history.append(obs)
        current = {role: self.backend.count(role) for role in self.roles}
        # off the loop: the SLO policy may simulate a new load first (slo.py)
        decisions = await asyncio.to_thread(self.policy.observe, obs, current)
        pool = "" if self.model is None else f" of {self.model}"
        slo = self.policy if isinstance(self.policy, SloPolicy) else None
        infeasible = slo is not None and slo.infeasible
        if infeasible != self._infeasible:
            self._infeasible = infeasible
            if infeasible:
                log.warning(
                    "autoscale%s: the SLO cannot be met even at the maximum (%s): holding it",
                    pool, slo.why if slo else "",
                )  # fmt: skip
            else:
                log.info("autoscale%s: the SLO can be met again within the bounds", pool)
        if self.metrics is not None:
            load = slo.load if slo else None
            self.metrics.tick(self.model or "", current, decisions, infeasible,
                              None if load is None else load.rate)  # fmt: skip
        for d in decisions:
            log.info("autoscale %s%s %+d: %s", d.role, pool, d.delta, d.reason)
            if d.delta > 0:
                started = await asyncio.to_thread(self.backend.scale_up, d.role, d.delta)
                log.info("started %s", ", ".join(started))
            elif d.remove:
                await asyncio.to_thread(self.backend.scale_down, d.role, list(d.remove))
            self.decisions.append((obs.time, d))
            if self.on_decision is not None:
                self.on_decision(d)
        return decisions

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.tick()
            except Exception as exc:  # NATS away, router restarting: try again next tick
                log.warning("autoscale tick failed: %r", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)


async def run_controller(
    args: argparse.Namespace,
    backends: Backend | Mapping[str, Backend],
    nats_url: str,
    auth: BusAuth,
    router_url: str | None,
    stop: asyncio.Event,
    shared_decode: Backend | None = None,
) -> None:
    """Scale one pool (a backend), or one pool per model (backends by served model name),
    each with a policy of its own, until `stop`. `shared_decode`: the decode processes
    every model shares, scaled as one pool (the models' backends then scale prefill)."""
    bus = await Bus(nats_url, "autoscaler", auth).connect(stop=stop)
    metrics = None
    if getattr(args, "scale_metrics_port", None) is not None:
        metrics = AutoscaleMetrics()
        port = serve_registry(metrics.registry, args.scale_metrics_port, args.scale_metrics_host)
        log.info("autoscaler metrics on http://%s:%d/metrics", args.scale_metrics_host, port)
    pools: dict[str | None, Backend] = {}
    if isinstance(backends, Mapping):
        pools.update(backends)
    else:
        pools[None] = backends
    try:
        roles = ("prefill",) if shared_decode is not None else ROLES
        controllers = [
            Controller(
                bus,
                backend,
                policy_from_args(args, getattr(args, "scale_node_options", None)),
                router_url,
                interval=args.scale_interval,
                model=model,
                roles=roles,
                metrics=metrics,
            )
            for model, backend in pools.items()
        ]
        if shared_decode is not None:
            controllers.append(
                Controller(
                    bus,
                    shared_decode,
                    policy_from_args(args, getattr(args, "scale_node_options", None)),
                    router_url,
                    interval=args.scale_interval,
                    roles=("decode",),
                    by_process=True,
                )
            )
        await asyncio.gather(*(c.run(stop) for c in controllers))
    finally:
        await bus.close()
