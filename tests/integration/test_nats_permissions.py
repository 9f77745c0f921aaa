"""Least privilege on NATS, against a real nats-server with `tandem up`'s per-role identities:
each role does its own work through the project's code (topology, heartbeats, tokens, the
journal's checkpoint records), and is refused what it must not do: a kvcache identity
publishing or reading tokens or reading the router's replies, a decode identity writing a
request's journal entry or purging the kvcache service, a prefill identity queueing jobs or
writing a decode node's registry entry, the autoscaler cancelling; and no reader takes a
registry entry whose role is not the one its key names.
(The whole e2e suite runs on these identities too: any permission a role lacks for its
normal work would fail it.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import nats
import pytest

from shared.bus.auth import BusAuth, ClusterAuth
from shared.bus.client import Bus
from shared.bus.journal import RequestJournal
from shared.bus.messages import CheckpointRecord, TokenDelta, decode, encode
from shared.bus.registry import NodeRegistry, node_info
from shared.bus.server import NatsServer
from shared.bus.topology import PREFILL_STREAM, ping_subject
from shared.runtime.node import connect_bus

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[NatsServer, ClusterAuth]]:
    auth = ClusterAuth.generate()
    with NatsServer(extra_config=auth.server_config()) as server:
        yield server, auth


class Raw:
    """A plain nats-py connection as one role, collecting the server's errors."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS | None = None

    async def connect(self, url: str, auth: BusAuth) -> Raw:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc).lower())

        self.nc = await nats.connect(url, error_cb=on_error, **auth.connect_kwargs())
        return self

    async def refused(self, timeout: float = 3.0) -> str:
        """The next permissions violation the server reports to this connection."""
        async with asyncio.timeout(timeout):
            while not any("permissions violation" in e for e in self.errors):
                await asyncio.sleep(0.02)
        return next(e for e in self.errors if "permissions violation" in e)


@pytest.fixture
async def raw(cluster: tuple[NatsServer, ClusterAuth]) -> AsyncIterator[dict[str, Raw]]:
    server, auth = cluster
    conns = {role: await Raw().connect(server.url, auth.for_role(role)) for role in auth.roles}
    yield conns
    for conn in conns.values():
        assert conn.nc is not None
        await conn.nc.close()


async def test_each_role_does_its_own_work(cluster: tuple[NatsServer, ClusterAuth]) -> None:
    server, auth = cluster
    buses = {}
    for role in ("router", "prefill", "decode", "kvcache"):  # topology as every service does
        buses[role] = await connect_bus(server.url, f"{role}-1", auth.for_role(role))
    try:
        for role, bus in buses.items():  # heartbeats and registry reads
            registry = await NodeRegistry(bus).start()
            await registry.heartbeat(node_info(f"{role}-1", role))  # type: ignore[arg-type]
        nodes = await (await NodeRegistry(buses["router"]).start()).nodes()
        assert {"router-1", "prefill-1", "decode-1", "kvcache-1"} <= nodes.keys()
        # a token from a decode node reaches the router's stream
        got: asyncio.Queue[TokenDelta] = asyncio.Queue()
        router_nc, decode_bus = buses["router"].nc, buses["decode"]
        assert router_nc is not None

        async def on_token(msg: nats.aio.msg.Msg) -> None:
            got.put_nowait(decode(msg.data, TokenDelta))

        await router_nc.subscribe("tandem.tokens.cmpl-1", cb=on_token)
        await router_nc.flush()
        assert (await published_until_received(decode_bus, got)).attempt_id == "cmpl-1"
        # a decode node writes checkpoint records; the router reads them
        journal = await RequestJournal(decode_bus).start()
        record_in = CheckpointRecord(attempt_id="cmpl-1", node_id="decode-1", output_ids=[1, 2])
        await journal.put_checkpoint(record_in)
        record = await (await RequestJournal(buses["router"]).start()).checkpoint("cmpl-1")
        assert record is not None and record.output_ids == [1, 2]
        # prefill and decode nodes ask a kvcache node to warm its connection to them (a
        # refusal here would only be logged at debug level by the nodes themselves)
        kv_nc = buses["kvcache"].nc
        assert kv_nc is not None

        async def on_warm(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"warm")

        await kv_nc.subscribe("tandem.kvcache.kvcache-1.warm", cb=on_warm)
        await kv_nc.flush()
        for role in ("prefill", "decode"):
            nc = buses[role].nc
            assert nc is not None
            reply = await warm_request(nc)
            assert reply.data == b"warm", role
    finally:
        for bus in buses.values():
            await bus.close()


async def published_until_received(
    bus: Bus, got: asyncio.Queue[TokenDelta], within: float = 10.0
) -> TokenDelta:
    """A token published (core NATS: at most once) again every half second until the
    router's subscription has it: one publish went unseen for 5 s once in CI under load,
    like the warm request below. A refused publish never arrives: the deadline fails it."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        await bus.publish("tandem.tokens.cmpl-1", TokenDelta(attempt_id="cmpl-1", seq=0))
        try:
            return await asyncio.wait_for(got.get(), 0.5)
        except TimeoutError:
            continue
    raise AssertionError(f"the decode node's token did not reach the router in {within} s")


async def warm_request(nc: nats.aio.client.Client) -> nats.aio.msg.Msg:
    """The warm request, asked again if the server says "no responders": a fresh
    nats-server sometimes does so for a moment even to a subscription already flushed (seen
    in CI under load; docs say the same of the liveness tests). A refused publish is no
    such answer: it times out."""
    for _ in range(20):
        try:
            return await nc.request("tandem.kvcache.kvcache-1.warm", b"", timeout=5)
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.1)
    raise AssertionError("no responder to the warm request after 2 s")


async def test_each_role_is_refused_what_it_must_not_do(raw: dict[str, Raw]) -> None:
    kv, dec, pre, auto = raw["kvcache"], raw["decode"], raw["prefill"], raw["autoscaler"]
    assert kv.nc and dec.nc and pre.nc and auto.nc
    await kv.nc.publish("tandem.tokens.cmpl-1", b"forged")
    assert 'publish to "tandem.tokens.cmpl-1"' in await kv.refused()
    kv.errors.clear()
    await kv.nc.subscribe("tandem.tokens.*")
    assert 'subscription to "tandem.tokens.*"' in await kv.refused()
    kv.errors.clear()
    await kv.nc.subscribe("_INBOX_router.>")  # the router's replies: journal entries
    assert "_inbox_router" in await kv.refused()
    await dec.nc.publish("$KV.tandem-journal.cmpl-1", b"forged entry")
    assert "$kv.tandem-journal.cmpl-1" in await dec.refused()
    dec.errors.clear()
    await dec.nc.publish("tandem.kvcache.kv-1.purge", b"")  # an operator's, not a node's
    assert "tandem.kvcache.kv-1.purge" in await dec.refused()
    await pre.nc.publish("tandem.prefill.jobs", b"a job")
    assert "tandem.prefill.jobs" in await pre.refused()
    pre.errors.clear()
    await pre.nc.publish("$KV.tandem-nodes.decode.decode-1", b"a fake decode node")
    assert "$kv.tandem-nodes.decode.decode-1" in await pre.refused()
    await auto.nc.publish("tandem.cancel", b"cancel everything")
    assert "tandem.cancel" in await auto.refused()
    # a node answers its own role's pings only: a kvcache or prefill identity cannot
    # answer a decode node's "stalled" and have its streams moved (issue 49)
    for other in (kv, pre):
        other.errors.clear()
        await other.nc.subscribe(ping_subject("decode", "decode-1"))
        assert "tandem.node.decode.decode-1.ping" in await other.refused()
    dec.errors.clear()
    await dec.nc.subscribe(ping_subject("kvcache", "kvcache-1"))
    assert "tandem.node.kvcache.kvcache-1.ping" in await dec.refused()
    # no node identity changes a stream: a prefill node adding `tandem.tokens.>` to the job
    # stream it consumes would read every tenant's output (issue 49)
    for role in ("prefill", "decode", "kvcache", "router"):
        conn = raw[role]
        assert conn.nc is not None
        conn.errors.clear()
        update = f"$JS.API.STREAM.UPDATE.{PREFILL_STREAM}"
        await conn.nc.publish(update, b'{"name": "TANDEM_PREFILL", "subjects": ["tandem.>"]}')
        assert update.lower() in await conn.refused(), role


async def test_a_registry_entry_under_another_roles_key_is_not_taken(
    cluster: tuple[NatsServer, ClusterAuth],
) -> None:
    server, auth = cluster
    decode_bus = await connect_bus(server.url, "decode-9", auth.for_role("decode"))
    try:
        registry = await NodeRegistry(decode_bus).start()
        await registry.heartbeat(node_info("decode-9", "decode"))
        # a decode identity may write decode entries; one claiming to be a prefill node
        # (under its decode key) is refused by readers
        forged = encode(node_info("decode-8", "prefill"))
        assert decode_bus.js is not None
        await decode_bus.js.publish("$KV.tandem-nodes.decode.decode-8", forged)
        nodes = await registry.nodes()
        assert "decode-9" in nodes and "decode-8" not in nodes
        events = registry.watch()
        seen = []
        async for event in events:
            if event.kind == "synced":
                break
            seen.append(event.node_id)
        await events.aclose()
        assert "decode-9" in seen and "decode-8" not in seen
    finally:
        await decode_bus.close()
