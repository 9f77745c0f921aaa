"""Where a kvcache node may send (services/kvcache/peers.py): registered prefill and decode
nodes' data planes, the registry read again for an unknown address at most once an
interval, and kept when it cannot be read. The real registry behind it runs in
tests/integration/test_kvcache_service.py."""

from __future__ import annotations

import pytest

from services.kvcache.peers import Peers
from shared.bus.messages import NodeInfo

pytestmark = pytest.mark.unit


class Registry:
    def __init__(self) -> None:
        self.entries: dict[str, NodeInfo] = {}
        self.reads = 0

    async def nodes(self) -> dict[str, NodeInfo]:
        self.reads += 1
        return dict(self.entries)

    def add(self, node_id: str, role: str, address: str) -> None:
        self.entries[node_id] = NodeInfo(node_id=node_id, role=role, data_address=address)  # type: ignore[arg-type]


async def test_only_prefill_and_decode_data_planes_and_strangers_cost_one_read_an_interval() -> (
    None
):
    registry = Registry()
    registry.add("d1", "decode", "tcp://10.0.0.1:7000")
    registry.add("p1", "prefill", "tcp://10.0.0.2:7000")
    registry.add("kv", "kvcache", "tcp://10.0.0.3:7000")
    registry.add("r1", "router", "tcp://10.0.0.4:7000")
    peers = Peers(registry, min_interval=3600)  # type: ignore[arg-type]
    assert await peers.allows("tcp://10.0.0.1:7000")
    assert await peers.allows("tcp://10.0.0.2:7000")
    assert not await peers.allows("tcp://10.0.0.3:7000")  # a kvcache node asks no blocks
    assert not await peers.allows("tcp://10.0.0.4:7000")
    for _ in range(100):
        assert not await peers.allows("tcp://203.0.113.9:22")
    assert registry.reads == 1 and peers.refused == 102


async def test_a_node_registered_since_is_found_and_an_unreadable_registry_keeps_the_view() -> None:
    registry = Registry()
    registry.add("d1", "decode", "tcp://10.0.0.1:7000")
    peers = Peers(registry, min_interval=0, max_age=0)  # type: ignore[arg-type]  # every call reads
    assert await peers.allows("tcp://10.0.0.1:7000")
    assert not await peers.allows("tcp://10.0.0.5:7000")
    registry.add("d2", "decode", "tcp://10.0.0.5:7000")  # it registers
    assert await peers.allows("tcp://10.0.0.5:7000")
    reads = registry.reads
    registry.entries = {}  # not readable now (NodeRegistry.nodes gives {})
    assert await peers.allows("tcp://10.0.0.1:7000")
    assert registry.reads == reads + 1  # it was read, and its emptiness not believed
