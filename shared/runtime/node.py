"""What every service process does the same way: identity, logging, tracing, the bus,
signals, and (for nodes) the registry heartbeat, ping answers and the metrics port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import uuid
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg

from shared.bus.auth import BusAuth
from shared.bus.client import Bus
from shared.bus.messages import NodeInfo
from shared.bus.registry import NodeRegistry
from shared.bus.topology import TopologyConfig, ensure_topology, ping_subject
from shared.telemetry.logs import setup_logs
from shared.telemetry.metrics import NodeMetrics
from shared.transport.base import Transport
from shared.transport.factory import make_transport

log = logging.getLogger("tandem.node")
FIRST_BEAT_TIMEOUT = 5.0  # seconds the first registry write may take before the node goes on


def host_part(hostname: str) -> str:
    """The hostname as a self-named node id holds it: alphanumerics kept, the rest "-",
    at most 63 characters (a DNS label: a Kubernetes pod's hostname is its whole name,
    which the autoscaler's backends match node ids against)."""
    return "".join(c if c.isalnum() else "-" for c in hostname)[:63]


def make_node_id(role: str, given: str | None = None) -> str:
    """`<role>-<host>-<6 hex>` unless given; safe as a NATS KV key."""
    if given:
        return given
    return f"{role}-{host_part(socket.gethostname())}-{uuid.uuid4().hex[:6]}"


def setup_logging(service: str, node_id: str, level: str = "INFO") -> None:
    """Structured logs for a service process (JSON lines unless on a terminal)."""
    setup_logs(service, node_id, level)


async def connect_bus(
    url: str,
    node_id: str,
    auth: BusAuth | None = None,
    topology: TopologyConfig | None = None,
    stop: asyncio.Event | None = None,
) -> Bus:
    bus = await Bus(url, node_id, auth).connect(stop=stop)
    assert bus.js is not None
    await ensure_topology(bus.js, topology)

    async def again() -> None:
        """After a reconnect: the server may be a restarted one whose memory streams (the
        node registry) are gone; create or update everything again, retrying briefly."""
        for attempt in range(20):
            try:
                assert bus.js is not None
                await ensure_topology(bus.js, topology)
                return
            except Exception as exc:  # JetStream still starting: try again shortly
                log.debug("topology after reconnect, attempt %d: %r", attempt + 1, exc)
                await asyncio.sleep(0.5)
        log.warning("could not set the topology up again after a reconnect")

    bus.on_reconnect.append(again)
    return bus


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM, for graceful shutdown (stop taking work, drain)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


class NodeRuntime:
    """What a prefill, decode or kvcache node sets up and tears down the same way.

    `open` sets up logs, tracing, signal handling, the bus, the registry and the (unstarted)
    data-plane transport; `live` starts heartbeats and the metrics port once the node can serve;
    `close` leaves the registry and closes the transport and the bus.
    """

    def __init__(self, role: str, node_id: str, args: Any) -> None:
        self.role = role
        self.node_id = node_id
        self.args = args
        self.stop = asyncio.Event()
        self.bus: Bus | None = None
        self.transport: Transport | None = None
        self.registry: NodeRegistry | None = None
        self._beats: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, role: str, args: Any) -> NodeRuntime:
        from shared.telemetry.tracing import setup_tracing

        node_id = make_node_id(role, args.node_id)
        setup_logs(role, node_id, args.log_level)
        setup_tracing(role, node_id)
        return await cls.connect(role, node_id, args, stop_on_signals())

    @classmethod
    async def connect(cls, role: str, node_id: str, args: Any, stop: asyncio.Event) -> NodeRuntime:
        """A node's bus, registry and (unstarted) transport, stopping with `stop`: `open`'s
        part per node (a process hosting several models runs one such node per model,
        each under its own id, after one `open`)."""
        rt = cls(role, node_id, args)
        rt.stop = stop
        topology = TopologyConfig(replicas=args.nats_replicas)
        rt.bus = await connect_bus(
            args.nats, node_id, BusAuth.from_args(args), topology, stop=rt.stop
        )
        rt.registry = await NodeRegistry(rt.bus, ttl=args.heartbeat_ttl).start()
        rt.transport = make_transport(args.transport, args.data_host, args.data_port)
        return rt

    async def live(
        self,
        info: Callable[[], NodeInfo],
        metrics: NodeMetrics,
        health: Callable[[], str] = lambda: "ok",
    ) -> None:
        """Heartbeats with `info`, metrics, and answers to probes: `health()` ('ok', or why
        the node's streams should move, e.g. a hung engine)."""
        assert self.registry is not None and self.bus is not None and self.bus.nc is not None

        async def pong(msg: Msg) -> None:
            await msg.respond(health().encode())

        await self.bus.nc.subscribe(ping_subject(self.role, self.node_id), cb=pong)
        # The first entry is written before the node goes on (its first kvcache requests
        # name its data plane, which a kvcache node serves only once it is registered);
        # the loop then keeps it (and retries if this one failed).
        try:
            await asyncio.wait_for(self.registry.heartbeat(info()), FIRST_BEAT_TIMEOUT)
        except Exception as exc:  # NATS slow or away: the loop below keeps trying
            log.warning("first heartbeat not written: %r", exc)
        self._beats = asyncio.create_task(self.registry.run_heartbeats(info))
        host = getattr(self.args, "metrics_host", "127.0.0.1")
        port = metrics.serve(self.args.metrics_port, host)
        if port is not None:
            log.info("metrics on http://%s:%d/metrics", host, port)

    async def close(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
        if self.registry is not None:
            with contextlib.suppress(Exception):  # the entry expires by TTL anyway
                await asyncio.wait_for(self.registry.remove(self.role, self.node_id), 1.0)
        if self.transport is not None:
            await self.transport.close()
        if self.bus is not None:
            await self.bus.close()
