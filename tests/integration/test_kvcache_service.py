"""The kvcache service as a real process: put blocks by hash, get the longest stored prefix."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from shared.bus.client import Bus
from shared.bus.ids import AttemptId
from shared.bus.messages import (
    KVGetTail,
    KVPutTails,
    KVPutTailsReply,
    KVTail,
    KVTailReply,
    KVUnpin,
    KVWarm,
    decode,
    encode,
    read_reply,
)
from shared.bus.registry import NodeRegistry, node_info
from shared.bus.server import NatsServer, free_port
from shared.bus.topology import ensure_topology, kvcache_subject
from shared.kv.block_hash import BlockHash
from shared.kv.sharding import shard
from shared.kv.tail import TailBlock
from shared.kvclient.client import UNPIN_MEMORY, KVCacheClient, KVCacheError
from shared.transport.base import Transport
from shared.transport.factory import make_transport
from shared.transport.pending import PendingTransfers
from tests.kv_peer import register_peer
from tests.otlp_receiver import OtlpReceiver
from tests.polling import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 64 * 1024


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if the node is not gone within a loaded CI machine's patience."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("kvcache node ignored SIGTERM for 30 s") from None


async def wait_for_nodes(client: KVCacheClient, names: set[str]) -> None:
    for _ in range(200):
        if {n.node_id for n in await client.nodes(fresh=True)} == names:  # read again now
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"kvcache nodes {names} did not register in 20 s")


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def start_node(url: str, kind: str, *argv: str, env: dict[str, str] | None = None) -> Any:
    """A kvcache node `kv-1` as its own process."""
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "kvcache", "--nats", url, "--node-id", "kv-1",
         "--transport", kind, *argv],
        cwd=ROOT,
        env=env,
    )  # fmt: skip


async def client_side(url: str, kind: str) -> tuple[Bus, Transport, PendingTransfers]:
    """A client's bus (topology made) and a data-plane listener for the gets' replies."""
    bus = await Bus(url, "client").connect()
    assert bus.js is not None
    await ensure_topology(bus.js)
    transport = make_transport(kind)
    pending = PendingTransfers()
    await transport.start(pending)
    await register_peer(bus, transport)
    return bus, transport, pending


async def data_address(bus: Bus, node_id: str) -> str:
    """The data-plane address a kvcache node registers, once it has (20 s at most)."""
    registry = await NodeRegistry(bus).start()
    for _ in range(200):
        nodes = await registry.nodes()
        if node_id in nodes:
            return nodes[node_id].data_address
        await asyncio.sleep(0.1)
    raise AssertionError(f"kvcache node {node_id} did not register in 20 s")


@pytest.mark.parametrize("kind", ["ucx", "tcp"])
async def test_put_and_get_prefix_bounded(nats_server: NatsServer, kind: str) -> None:
    capacity_blocks = 16
    otlp = OtlpReceiver()
    otlp.start()
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=otlp.url, OTEL_BSP_SCHEDULE_DELAY="100")
    argv = ("--capacity-mb", "1", "--heartbeat-ttl", "2")
    proc = start_node(nats_server.url, kind, *argv, env=env)
    bus, transport, pending = await client_side(nats_server.url, kind)
    try:
        address = await data_address(bus, "kv-1")
        client = KVCacheClient(bus, transport, pending)
        blocks = [os.urandom(BLOCK) for _ in range(4)]
        tracer = TracerProvider().get_tracer("test")
        with tracer.start_as_current_span("client") as parent:
            await client.put("kv-1", address, [h(i) for i in range(4)], b"".join(blocks))
            got = await client.get("kv-1", [h(0), h(1), h(2), h(3), h(99)], max_bytes=8 * BLOCK)
        assert got == blocks
        trace_id = format(parent.get_span_context().trace_id, "032x")
        for _ in range(100):  # the node's spans join the caller's trace
            names = {s.name for s in otlp.snapshot() if s.trace_id == trace_id}
            if {"kvcache.put", "kvcache.get"} <= names:
                break
            await asyncio.sleep(0.1)
        assert {"kvcache.put", "kvcache.get"} <= names
        assert await client.get("kv-1", [h(2), h(3)], max_bytes=8 * BLOCK) == blocks[2:]
        assert await client.get("kv-1", [h(50), h(0)], max_bytes=8 * BLOCK) == []
        # 1 MiB holds 16 blocks of 64 KiB: 20 more push the first ones out
        more = [os.urandom(BLOCK) for _ in range(20)]
        await client.put("kv-1", address, [h(100 + i) for i in range(20)], b"".join(more))
        assert await client.get("kv-1", [h(0)], max_bytes=BLOCK) == []
        tail = [h(100 + i) for i in range(20 - capacity_blocks, 20)]
        assert await client.get("kv-1", tail, max_bytes=20 * BLOCK) == more[-capacity_blocks:]
        assert pending.refused == 0
    finally:
        await transport.close()
        await bus.close()
        stop(proc)
        otlp.stop()


async def test_two_models_blocks_share_one_node_s_memory(nats_server: NatsServer) -> None:
    """Blocks of two KV layouts (two models) on one node: each prefix comes back whole at
    its own size, and the node's memory limit holds their sum, the least recently used
    block going first whatever its size."""
    proc = start_node(nats_server.url, "tcp", "--capacity-mb", "1", "--heartbeat-ttl", "2")
    bus, transport, pending = await client_side(nats_server.url, "tcp")
    try:
        address = await data_address(bus, "kv-1")
        client = KVCacheClient(bus, transport, pending)
        small = [os.urandom(BLOCK) for _ in range(4)]  # 4 x 64 KiB
        big = [os.urandom(2 * BLOCK) for _ in range(6)]  # 6 x 128 KiB: 1 MiB in all
        await client.put("kv-1", address, [h(i) for i in range(4)], b"".join(small))
        await client.put("kv-1", address, [h(10 + i) for i in range(6)], b"".join(big))
        assert await client.get("kv-1", [h(i) for i in range(4)], max_bytes=1 << 20) == small
        got = await client.get("kv-1", [h(10 + i) for i in range(6)], max_bytes=1 << 20)
        assert got == big
        # two more small blocks: the least recently used (a small one, read first) goes
        more = [os.urandom(BLOCK) for _ in range(2)]
        await client.put("kv-1", address, [h(20), h(21)], b"".join(more))
        assert await client.get("kv-1", [h(0)], max_bytes=BLOCK) == []
        assert await client.get("kv-1", [h(20), h(21)], max_bytes=2 * BLOCK) == more
        assert await client.get("kv-1", [h(10 + i) for i in range(6)], max_bytes=1 << 20) == big
        assert pending.refused == 0
    finally:
        await transport.close()
        await bus.close()
        stop(proc)


async def test_blocks_shard_over_two_nodes_and_survive_losing_one(nats_server: NatsServer) -> None:
    """Rendezvous sharding through real nodes: each owns its share; a lost node ends the
    joint prefix at its first block and nothing else fails."""
    argv = ["--nats", nats_server.url, "--transport", "tcp", "--capacity-mb", "4"]
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "kvcache", *argv, "--node-id", name],
            cwd=ROOT,
        )
        for name in ("kv-a", "kv-b")
    }
    bus = await Bus(nats_server.url, "client").connect()
    assert bus.js is not None
    await ensure_topology(bus.js)
    transport = make_transport("tcp")
    pending = PendingTransfers()
    await transport.start(pending)
    await register_peer(bus, transport)
    try:
        registry = await NodeRegistry(bus).start()
        client = KVCacheClient(bus, transport, pending, registry)
        await wait_for_nodes(client, {"kv-a", "kv-b"})
        hashes = [os.urandom(16) for _ in range(24)]
        blocks = [os.urandom(BLOCK) for _ in range(24)]
        assert await client.store(hashes, blocks) == 24
        owners = shard(hashes, ["kv-a", "kv-b"])
        assert set(owners) == {"kv-a", "kv-b"}  # both hold a share
        for name, positions in owners.items():  # and each holds exactly its own
            own = [hashes[i] for i in positions]
            assert await client.get(name, own, len(own) * BLOCK) == [blocks[i] for i in positions]
        assert await client.load_prefix(hashes, BLOCK) == blocks
        procs["kv-b"].kill()
        procs["kv-b"].wait()
        first_lost = owners["kv-b"][0]
        assert await client.load_prefix(hashes, BLOCK) == blocks[:first_lost]
        assert client.failures >= 1  # logged and counted, then skipped
        # kv-b is skipped now: kv-a alone serves the same prefix, without another failure
        failures = client.failures
        assert await client.load_prefix(hashes, BLOCK) == blocks[:first_lost]
        assert client.failures == failures
    finally:
        await transport.close()
        await bus.close()
        for p in procs.values():
            stop(p)


async def test_request_tails_grow_by_pieces_expire_and_bad_input_is_refused(
    nats_server: NatsServer,
) -> None:
    """Running requests' partial last blocks through a real node: a whole tail replaces,
    a piece appends its rows, one that does not continue is reported and drops the stored
    tail; the whole tail comes back; gone a lease after the last write; bad puts change
    nothing."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "kvcache", "--nats", nats_server.url,
         "--node-id", "kv-t", "--transport", "ucx", "--capacity-mb", "4", "--tail-mb", "1",
         "--tail-ttl", "1.5"],
        cwd=ROOT,
    )  # fmt: skip
    bus = await Bus(nats_server.url, "client").connect()
    assert bus.js is not None and bus.nc is not None
    await ensure_topology(bus.js)
    transport = make_transport("ucx")
    pending = PendingTransfers()
    await transport.start(pending)
    await register_peer(bus, transport)
    row, max_rows = 4096, 15
    try:
        registry = await NodeRegistry(bus).start()
        client = KVCacheClient(bus, transport, pending, registry)
        await wait_for_nodes(client, {"kv-t"})

        def tail(rid: str, tokens: list[int], first: int = 0) -> TailBlock:
            data = os.urandom((len(tokens) - first) * row)
            return TailBlock(rid, 32, BlockHash(h(1)), tokens, data, first)

        def joined(*parts: TailBlock) -> bytes:
            return b"".join(p.data for p in parts)

        async def load(rid: str) -> TailBlock | None:
            return await client.load_tail(rid, row, max_rows)

        a1, b1 = tail("req-a", [5, 6]), tail("req-b", [7])
        assert await client.store_tails([a1, b1]) == []
        got = await load("req-a")
        assert got is not None and (got.request_id, got.start, got.parent, got.token_ids) == (
            "req-a",
            32,
            h(1),
            [5, 6],
        )
        assert bytes(got.data) == a1.data and got.first == 0
        a2, a3 = tail("req-a", [5, 6, 8], first=2), tail("req-a", [5, 6, 8, 9, 4], first=3)
        b2 = tail("req-b", [7, 1], first=1)
        assert await client.store_tails([a2, b2]) == []
        assert await client.store_tails([a3]) == []
        got = await load("req-a")
        assert got is not None and got.token_ids == [5, 6, 8, 9, 4]
        assert bytes(got.data) == joined(a1, a2, a3)
        got = await load("req-b")
        assert got is not None and bytes(got.data) == joined(b1, b2)
        a4 = tail("req-a", [5, 6, 8, 9, 4, 2], first=5)
        gap = tail("req-b", [7, 1, 3, 3], first=3)  # rows 2.. only: it skips one
        never = tail("req-c", [1, 2], first=1)  # nothing stored to extend
        assert sorted(await client.store_tails([a4, gap, never])) == ["req-b", "req-c"]
        got = await load("req-a")
        assert got is not None and bytes(got.data) == joined(a1, a2, a3, a4)
        assert await load("req-b") is None  # a tail is whole or absent
        assert await load("req-c") is None
        a5 = tail("req-a", [5, 6, 8], first=0)  # whole again (say a resend): replaces
        assert await client.store_tails([a5]) == []
        got = await load("req-a")
        assert got is not None and got.token_ids == [5, 6, 8] and bytes(got.data) == a5.data
        assert await load("req-none") is None
        assert await client.load_tail("req-a", row // 2, max_rows) is None  # another model
        assert await client.load_tail("req-a", row, 2) is None  # longer than a block here
        # malformed or inconsistent puts are refused; the node keeps serving
        subject = kvcache_subject("kv-t", "put_tails")
        bad_tails = (
            [KVTail("r", 0, b"", [1, 2], 2)],  # no rows
            [KVTail("r", 0, b"", [1], -1)],
            [KVTail("r", 0, b"", [])],
            [KVTail("r", 0, b"", list(range(500)))],  # 500 rows of 200 KB: more than a put may
        )
        for bad in (
            b"\x93garbage",
            encode(KVPutTails(transfer_id="x", row_bytes=row)),
            *(encode(KVPutTails(transfer_id="x", tails=t, row_bytes=200_000)) for t in bad_tails),
        ):
            reply = decode((await bus.nc.request(subject, bad, timeout=2)).data, KVPutTailsReply)
            assert reply.error and not reply.missing
        with pytest.raises(KVCacheError):
            odd = TailBlock("req-c", 32, BlockHash(h(1)), [1], b"x" * 10)  # another size
            await client._put_tails((await client.nodes())[0], [a1, odd])
        got = await load("req-a")
        assert got is not None and bytes(got.data) == a5.data
        await asyncio.sleep(2.0)  # past the lease of 1.5 s with no write
        assert await load("req-a") is None
        assert await load("req-b") is None
        assert client.failures == 0
    finally:
        await transport.close()
        await bus.close()
        stop(proc)


def test_a_node_stopped_before_nats_is_up_ends_cleanly() -> None:
    """nats-py retries a first connection forever (right while a server starts, as under
    compose); SIGTERM in that time must still end the node, not wait for NATS."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "kvcache", "--nats", f"nats://127.0.0.1:{free_port()}",
         "--node-id", "kv-early", "--capacity-mb", "1"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        seen: list[str] = []
        while not any("nats error" in line for line in seen[-1:]):  # connecting to nothing
            seen.append(proc.stderr.readline())
            assert seen[-1], f"the node ended before connecting: {''.join(seen)}"
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "stopped: asked to stop while connecting to NATS" in err


async def test_purge_drops_the_blocks_one_node_stored(nats_server: NatsServer) -> None:
    """Each block remembers which node stored it; `tandem purge-kv --producer` (the real
    command) drops that node's blocks and no other's."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "kvcache", "--nats", nats_server.url,
         "--node-id", "kv-1", "--transport", "tcp", "--capacity-mb", "4",
         "--heartbeat-ttl", "2"],
        cwd=ROOT,
    )  # fmt: skip
    buses, transports = [], []
    try:
        clients = {}
        for name in ("bad-node", "good-node"):
            bus = await Bus(nats_server.url, name).connect()
            assert bus.js is not None
            await ensure_topology(bus.js)
            pending = PendingTransfers()
            transport = make_transport("tcp")
            await transport.start(pending)
            await register_peer(bus, transport)
            buses.append(bus)
            transports.append(transport)
            clients[name] = KVCacheClient(bus, transport, pending, await NodeRegistry(bus).start())
        await wait_for_nodes(clients["good-node"], {"kv-1"})
        address = (await clients["good-node"].nodes())[0].data_address
        bad, good = [os.urandom(BLOCK) for _ in range(2)], [os.urandom(BLOCK) for _ in range(2)]
        await clients["bad-node"].put("kv-1", address, [h(1), h(2)], b"".join(bad))
        await clients["good-node"].put("kv-1", address, [h(3), h(4)], b"".join(good))
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "tandem.cli", "purge-kv", "--nats", nats_server.url,
             "--producer", "bad-node"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0 and "kv-1: 2 removed" in done.stdout, done.stdout + done.stderr
        getter = clients["good-node"]
        assert await getter.get("kv-1", [h(1), h(2)], max_bytes=4 * BLOCK) == []
        assert await getter.get("kv-1", [h(3), h(4)], max_bytes=4 * BLOCK) == good
    finally:
        for transport in transports:
            await transport.close()
        for bus in buses:
            await bus.close()
        stop(proc)


async def test_unpins_reach_a_kvcache_node_a_registry_read_left_out(
    nats_server: NatsServer,
) -> None:
    """A registry read under load skips entries it cannot read in time, so a kvcache node
    can drop out of a client's list for a moment. Its pins must still be released when
    their requests end: unpins go to every node listed within the pins' lease (not to one
    listed longer ago: it has released them itself)."""
    bus, transport, pending = await client_side(nats_server.url, "tcp")
    try:
        registry = await NodeRegistry(bus, ttl=30).start()
        for name in ("kv-a", "kv-b"):
            await registry.heartbeat(node_info(name, "kvcache"))
        client = KVCacheClient(bus, transport, pending, registry)
        await wait_for_nodes(client, {"kv-a", "kv-b"})
        await registry.remove("kvcache", "kv-b")
        await wait_for_nodes(client, {"kv-a"})
        got: dict[str, list[KVUnpin]] = {"kv-a": [], "kv-b": []}
        assert bus.nc is not None
        for name, seen in got.items():

            async def keep(msg: Any, seen: list[KVUnpin] = seen) -> None:
                seen.append(decode(msg.data, KVUnpin))

            await bus.nc.subscribe(kvcache_subject(name, "unpin"), cb=keep)
        await client.unpin([AttemptId("r-1")], over=True)
        await bus.nc.flush()
        await wait_until("r-1's unpin at both nodes", lambda: got["kv-a"] and got["kv-b"])
        assert [u.attempt_ids for u in got["kv-b"]] == [["r-1"]] and got["kv-a"]
        assert got["kv-b"][0].over and got["kv-b"][0].node_id == "client"
        client._seen["kv-b"] -= UNPIN_MEMORY + 1  # listed last beyond the lease
        await client.unpin([AttemptId("r-2")], over=True)
        # kv-b must get nothing: rather than wait a while for what should not come, send a
        # marker to it on the client's connection. NATS keeps one connection's order, so
        # once the marker is in, an unpin of r-2 sent to kv-b would be in before it.
        marker = KVUnpin(attempt_ids=[AttemptId("marker")], node_id="test")
        await bus.nc.publish(kvcache_subject("kv-b", "unpin"), encode(marker))
        await bus.nc.flush()
        await wait_until(
            "r-2's unpin at kv-a and the marker at kv-b",
            lambda: len(got["kv-a"]) >= 2 and marker in got["kv-b"],
        )
        assert len(got["kv-a"]) == 2 and got["kv-b"] == [got["kv-b"][0], marker]
    finally:
        await transport.close()
        await bus.close()


async def test_blocks_go_only_to_a_registered_nodes_data_plane(nats_server: NatsServer) -> None:
    """issue 49: a get, a tail get or a warm names where the kvcache node sends; one naming
    an address no prefill or decode node registered is refused, and no connection is even
    opened to it (a node identity cannot aim a kvcache node's sends at any host)."""
    proc = start_node(nats_server.url, "tcp", "--capacity-mb", "1", "--heartbeat-ttl", "2")
    bus, transport, pending = await client_side(nats_server.url, "tcp")  # registered
    stranger, stranger_pending = make_transport("tcp"), PendingTransfers()
    await stranger.start(stranger_pending)
    try:
        address = await data_address(bus, "kv-1")
        client = KVCacheClient(bus, transport, pending)
        blocks = [os.urandom(BLOCK) for _ in range(2)]
        await client.put("kv-1", address, [h(0), h(1)], b"".join(blocks))
        assert await client.get("kv-1", [h(0), h(1)], 2 * BLOCK) == blocks
        aimed = KVCacheClient(bus, stranger, stranger_pending)
        with pytest.raises(KVCacheError, match="no registered node"):
            await aimed.get("kv-1", [h(0), h(1)], 2 * BLOCK)
        assert bus.nc is not None
        tail_get = KVGetTail(attempt_id=AttemptId("a-1"), transfer_id="t-1",
                             reply_address=stranger.address, transfer_secret="s" * 32)  # fmt: skip
        raw = await bus.nc.request(kvcache_subject("kv-1", "get_tail"), encode(tail_get), 5)
        assert "no registered node" in decode(raw.data, KVTailReply).error
        warm = KVWarm(transfer_id="w-1", reply_address=stranger.address, transfer_secret="s" * 32)
        raw = await bus.nc.request(kvcache_subject("kv-1", "warm"), encode(warm), 5)
        reply = read_reply(raw.data)
        assert not reply.accepted and "no registered node" in reply.reason
        await asyncio.sleep(0.5)  # a send, had one started, would have connected by now
        assert len(stranger.connections) == 0  # type: ignore[attr-defined]
        # the registered client is served as before
        assert await client.get("kv-1", [h(0), h(1)], 2 * BLOCK) == blocks
    finally:
        await stranger.close()
        await transport.close()
        await bus.close()
        stop(proc)
