"""A test's own data-plane listener, registered as a node so that kvcache nodes send to it:
they send blocks only to registered nodes' data planes (services/kvcache/peers.py)."""

from __future__ import annotations

from shared.bus.client import Bus
from shared.bus.registry import NodeRegistry, node_info
from shared.transport.base import Transport


async def register_peer(bus: Bus, transport: Transport, node_id: str = "client") -> NodeRegistry:
    """Registered as a draining decode node (no router sends it work) whose data plane is
    `transport`'s, for a minute; `registry.remove("decode", node_id)` takes it out."""
    registry = await NodeRegistry(bus, ttl=60).start()
    await registry.heartbeat(
        node_info(node_id, "decode", data_address=transport.address, draining=True)
    )
    return registry
