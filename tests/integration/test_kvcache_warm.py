"""Warm connections: a kvcache node opens the connection its gets will take with a one-byte
transfer the receiving node asked for, so the receiver's listener knows it as a peer at
once and can close silent strangers within seconds (shared/transport/admission.py)."""

from __future__ import annotations

import asyncio

import pytest
from nats.errors import NoRespondersError

from shared.bus.messages import KVWarm, encode, read_reply
from shared.bus.registry import NodeRegistry
from shared.bus.server import NatsServer
from shared.bus.topology import kvcache_subject
from shared.kvclient.client import KVCacheClient
from shared.kvclient.warm import keep_warm
from tests.integration.test_kvcache_service import (
    BLOCK,
    client_side,
    h,
    start_node,
    stop,
    wait_for_nodes,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("kind", ["ucx", "tcp"])
async def test_a_warmed_connection_is_a_peer_at_once_and_carries_the_gets(
    nats_server: NatsServer, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_DATA_STRANGER_IDLE", "1")  # this process's listener
    proc = start_node(nats_server.url, kind, "--capacity-mb", "4")
    bus, transport, pending = await client_side(nats_server.url, kind)
    table = transport.connections  # type: ignore[attr-defined]
    stopping = asyncio.Event()
    try:
        registry = await NodeRegistry(bus).start()
        client = KVCacheClient(bus, transport, pending, registry)
        await wait_for_nodes(client, {"kv-1"})
        assert len(table) == 0
        warming = asyncio.create_task(keep_warm(client, stopping))
        for _ in range(100):  # the loop's first round asks kv-1 at once
            if table.peers:
                break
            await asyncio.sleep(0.05)
        assert len(table.peers) == 1 and not table.strangers
        await asyncio.sleep(1.5)  # past the silence a stranger may keep
        assert len(table.peers) == 1 and table.evicted == 0  # proven: kept
        blocks = [bytes([i]) * BLOCK for i in range(3)]
        node = (await client.nodes())[0]
        await client.put("kv-1", node.data_address, [h(i) for i in range(3)], b"".join(blocks))
        assert await client.get("kv-1", [h(0), h(1), h(2)], 3 * BLOCK) == blocks
        assert len(table.peers) == 1 and not table.strangers  # the get came the warm way
        stopping.set()
        await asyncio.wait_for(warming, 5)
        assert pending.refused == 0
        # A request that names no secret is refused, and nothing is sent.
        bad = KVWarm(transfer_id="warm-x", reply_address=transport.address)
        raw = await bus.nc.request(kvcache_subject("kv-1", "warm"), encode(bad), timeout=5)  # type: ignore[union-attr]
        assert not read_reply(raw.data).accepted
        await client.warm("kv-1")  # and a good one still works
        with pytest.raises((NoRespondersError, TimeoutError)):  # no node: no hang
            await asyncio.wait_for(client.warm("kv-nobody"), 5)
    finally:
        stopping.set()
        await transport.close()
        await bus.close()
        stop(proc)
