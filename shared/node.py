"""What every service process does the same way: identity, logging, bus, signals."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import uuid

from shared.bus.client import Bus
from shared.bus.topology import TopologyConfig, ensure_topology
from shared.telemetry.logs import setup_logs


def make_node_id(role: str, given: str | None = None) -> str:
    """`<role>-<host>-<short uuid>` unless given; safe as a NATS KV key."""
    if given:
        return given
    host = "".join(c if c.isalnum() else "-" for c in socket.gethostname())[:20]
    return f"{role}-{host}-{uuid.uuid4().hex[:6]}"


def setup_logging(service: str, node_id: str, level: str = "INFO") -> None:
    """Structured logs for a service process (JSON lines unless on a terminal)."""
    setup_logs(service, node_id, level)


async def connect_bus(url: str, node_id: str, topology: TopologyConfig | None = None) -> Bus:
    bus = await Bus(url, node_id).connect()
    assert bus.js is not None
    await ensure_topology(bus.js, topology)
    return bus


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM, for graceful shutdown (stop taking work, drain)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def default_threads(share: int = 1) -> int:
    """Cores this process may use, divided among `share` model processes on the same cores."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, share))
