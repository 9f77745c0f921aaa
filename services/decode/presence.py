"""How a decode node stands with the routers: its registry entry, whether it drains, and
its lease on the sequences it runs.

A node with no round trip to NATS for `lease` seconds gives up its sequences: the routers
have declared it dead and resumed them elsewhere, so their blocks are better freed. A draining
node takes no new work and finishes what runs for at most `drain_timeout` seconds; it
publishes a heartbeat at once, so the routers learn of the drain without waiting for the
next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from shared.bus.messages import NodeInfo
from shared.bus.registry import NodeRegistry


class Presence:
    """None for `registry`: a node outside the registry (tests), which never loses its lease."""

    def __init__(self, registry: NodeRegistry | None, lease: float, drain_timeout: float) -> None:
        self.registry = registry
        self.lease = lease
        self.drain_timeout = drain_timeout
        self.draining = False

    def out_of_contact(self) -> float | None:
        """Seconds since the last round trip to NATS, once past the lease (else None)."""
        if self.registry is None:
            return None
        silent = time.monotonic() - self.registry.last_ok
        return silent if silent >= self.lease else None

    async def announce(self, info: NodeInfo) -> None:
        """Publish this node's entry now (best effort, for a second at most)."""
        if self.registry is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.registry.heartbeat(info), 1.0)
