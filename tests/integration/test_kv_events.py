"""The router's prefix index over the KV-event stream, on a real nats-server: what a node
announces is indexed; what it announces for another node, or for a node the registry does
not know, is not; and no node's entry outgrows what it can hold (issue 49: forged events)."""

from __future__ import annotations

import pytest

from shared.bus.client import Bus
from shared.bus.kv_events import KVIndex
from shared.bus.messages import KVEvent
from shared.bus.server import NatsServer
from shared.bus.topology import TopologyConfig, ensure_topology, kv_events_subject
from tests.polling import wait_until

pytestmark = pytest.mark.integration

REGISTERED = {"decode-1": 4, "decode-2": 4}  # node → the KV blocks it advertises


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


async def test_index_takes_registered_nodes_own_events_within_their_capacity(
    nats_server: NatsServer,
) -> None:
    bus = await Bus(nats_server.url, "kv-events-test").connect()
    try:
        assert bus.js is not None
        await ensure_topology(bus.js, TopologyConfig())
        index = KVIndex(REGISTERED.get)
        await index.follow(bus)

        async def send(subject_node: str, node: str, op: str, hashes: list[bytes]) -> None:
            event = KVEvent(node_id=node, op=op, block_hashes=hashes)  # type: ignore[arg-type]
            await bus.js_publish(kv_events_subject(subject_node), event)

        await send("decode-1", "decode-1", "stored", [h(1), h(2)])
        await send("decode-2", "decode-1", "stored", [h(3)])  # decode-2 speaking for decode-1
        await send("ghost", "ghost", "stored", [h(4)])  # a node never registered
        await send("decode-2", "decode-2", "stored", [h(i) for i in range(10, 16)])  # 6 > 4
        await send("decode-1", "decode-1", "evicted", [h(2)])
        await wait_until("the events", lambda: index.events >= 4)
        await wait_until("decode-1's eviction", lambda: index.by_node.get("decode-1") == {h(1)})
        assert "ghost" not in index.by_node
        assert len(index.by_node["decode-2"]) == 4  # its advertised capacity
        assert index.refused == 1 + 2  # the ghost's block, decode-2's two beyond 4
        assert bus.dropped[kv_events_subject("decode-2")] == 1  # the forged one
    finally:
        await bus.close()


def test_removals_apply_to_any_node_and_capacity_counts_new_blocks_only() -> None:
    index = KVIndex(REGISTERED.get)
    stored = KVEvent(node_id="decode-1", op="stored", block_hashes=[h(1), h(2), h(3)])
    index.apply(stored)
    index.apply(stored)  # again: nothing new, nothing refused
    assert index.by_node["decode-1"] == {h(1), h(2), h(3)} and index.refused == 0
    index.apply(KVEvent(node_id="decode-1", op="stored", block_hashes=[h(3), h(4), h(5)]))
    assert len(index.by_node["decode-1"]) == 4 and index.refused == 1
    index.apply(KVEvent(node_id="ghost", op="evicted", block_hashes=[h(1)]))  # no entry made
    index.apply(KVEvent(node_id="ghost", op="cleared"))
    assert set(index.by_node) == {"decode-1"}
    index.apply(KVEvent(node_id="decode-1", op="cleared"))
    assert index.by_node == {}
