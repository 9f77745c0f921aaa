"""A stranger on the network floods the data plane while a client streams: 2,000 idle
connections and 50 transfers announcing 64 MiB each (with secrets nobody gave them) at
every decode node's and the kvcache node's data port. Each bogus transfer is refused at
its header with its connection (its payload never read), the stream still ends with the
reference text, no attacked node's RSS rises by 100 MiB, and a new request still gets its
KV through (both decode nodes are attacked, so its KV lands on an attacked one)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from shared.bus.client import Bus
from shared.bus.registry import NodeRegistry
from shared.model.loader import LoadedModel
from shared.transport.base import BufferHandler, TransferError, TransferRejected
from shared.transport.factory import make_transport
from shared.transport.frames import VERSION, TransferHeader, make_header, new_secret
from tandem.launcher import Stack
from tests.e2e.streaming import complete
from tests.e2e.test_api import reference, text_of
from tests.e2e.test_failover import failovers
from tests.rss import rss_mib

pytestmark = pytest.mark.e2e

IDLE = 2000
BOGUS = 50
MiB = 1 << 20


async def data_ports(stack: Stack) -> dict[str, str]:
    """Data-plane address of each decode and kvcache node, from the registry."""
    bus = await Bus(stack.nats_url, "e2e-flood", stack.auth).connect()
    try:
        nodes = await (await NodeRegistry(bus).start()).nodes()
    finally:
        await bus.close()
    return {n.node_id: n.data_address for n in nodes.values() if n.role in ("decode", "kvcache")}


async def flood(addresses: list[str]) -> list[asyncio.StreamWriter]:
    """The idle connections (left open) and the bogus transfers (each refused)."""
    idle = []
    for address in addresses:
        host, _, port = address.split("://")[1].rpartition(":")
        for _ in range(IDLE):
            idle.append((await asyncio.open_connection(host, int(port)))[1])
    sender = make_transport(addresses[0].split("://")[0])
    await sender.start(BufferHandler())
    bogus = memoryview(bytearray(64 * MiB))

    async def push(address: str, i: int) -> None:
        header = make_header("attack", f"attack-{i}", bogus, secret=new_secret())
        with pytest.raises(TransferError) as refused:
            await sender.send(address, header, bogus, timeout=60)
        # closed at the header, not read and answered (which cost the node 64 MiB of reads)
        assert not isinstance(refused.value, TransferRejected)

    try:
        await asyncio.gather(*(push(a, i) for a in addresses for i in range(BOGUS)))
    finally:
        await sender.close()
    return idle


async def test_flooded_data_ports_still_serve(stack: Stack, real_model: LoadedModel) -> None:
    ports = await data_ports(stack)
    assert {"decode-1", "decode-2", "kvcache-1"} <= ports.keys(), ports
    pids = {node: stack.child(node).proc.pid for node in ports}  # type: ignore[union-attr]
    base = {node: rss_mib(pid) for node, pid in pids.items()}
    peak = dict(base)
    ids = real_model.encode("Write a short story about a lighthouse keeper.")
    ref = text_of(real_model, reference(real_model, ids, 64))
    async with aiohttp.ClientSession() as session:
        streaming = asyncio.ensure_future(complete(session, stack.url, ids, 64))
        attack = asyncio.ensure_future(flood(list(ports.values())))
        while not (streaming.done() and attack.done()):
            for node, pid in pids.items():
                peak[node] = max(peak[node], rss_mib(pid))
            await asyncio.sleep(0.02)
        assert streaming.result() == ref
        idle = attack.result()
        grew = {node: round(peak[node] - base[node]) for node in pids}
        print(f"\nflood: {len(idle)} idle connections, {BOGUS} bogus 64 MiB transfers per node;"
              f" peak RSS growth MiB {grew}")  # fmt: skip
        assert max(grew.values()) < 100, grew
        started = time.monotonic()
        other = real_model.encode("List three facts about the moon.")
        assert await complete(session, stack.url, other, 16) == text_of(
            real_model, reference(real_model, other, 16)
        )
        assert time.monotonic() - started < 60
    for writer in idle:
        writer.close()


PROBES = 89  # issue 49's run: 89 crafted headers made 8 failovers and 0 of 4 exact streams


def crafted_header(i: int) -> TransferHeader:
    """Issue 49's probe: 29,100 shape entries of 2**63 - 1 (a 262 KB header) and no secret.
    The Struct takes what it is given; only a receiver's decoder checks the bounds."""
    return TransferHeader(
        v=VERSION, request_id="probe", transfer_id=f"probe-{i}", dtype="uint8",
        shape=[2**63 - 1] * 29_100, nbytes=1, chunk_bytes=1, checksums=[0],
    )  # fmt: skip


async def probe(addresses: list[str], streaming: asyncio.Future[list[str]]) -> int:
    """Crafted headers at every address, in a loop, until the streams end (PROBES at least)."""
    sender = make_transport(addresses[0].split("://")[0])
    await sender.start(BufferHandler())
    sent = 0
    try:
        while sent < PROBES or not streaming.done():
            for address in addresses:
                with contextlib.suppress(TransferError):  # refused: the connection dropped
                    await sender.send(address, crafted_header(sent), memoryview(b"x"), timeout=10)
                sent += 1
    finally:
        await sender.close()
    return sent


async def oldest_heartbeat(stack: Stack, nodes: set[str], done: asyncio.Future[int]) -> float:
    """The oldest any of `nodes`' heartbeats got while `done` ran: at each poll, seconds since
    the newest heartbeat seen of each node (infinity for one never seen). A poll whose view
    could not be read (NATS slow on a loaded host: `nodes()` returns {}) measures nothing,
    but a node that really stops heartbeating ages through the polls that follow."""
    bus = await Bus(stack.nats_url, "e2e-probe", stack.auth).connect()
    newest: dict[str, float] = {}
    worst = 0.0
    try:
        registry = await NodeRegistry(bus).start()
        while not done.done():
            seen = await registry.nodes()
            if seen:
                for node in nodes:
                    if node in seen:
                        newest[node] = max(newest.get(node, 0.0), seen[node].timestamp)
                    age = time.time() - newest[node] if node in newest else float("inf")
                    worst = max(worst, age)
            await asyncio.sleep(0.1)
    finally:
        await bus.close()
    return worst


async def test_crafted_headers_cost_a_decode_node_nothing(
    stack: Stack, real_model: LoadedModel
) -> None:
    """A stranger sends issue 49's crafted headers to both decode nodes' data ports in a
    loop while 4 greedy streams run: every stream ends exact, no stream fails over, and the
    decode nodes' heartbeats stay within the registry's TTL (2 s here) throughout."""
    ports = await data_ports(stack)
    decodes = {n: a for n, a in ports.items() if n.startswith("decode")}
    prompts = [real_model.encode(f"Tell me about the number {i}.") for i in range(4)]
    refs = [text_of(real_model, reference(real_model, ids, 48)) for ids in prompts]
    before = failovers(stack)
    async with aiohttp.ClientSession() as session:
        streaming = asyncio.ensure_future(
            asyncio.gather(*(complete(session, stack.url, ids, 48) for ids in prompts))
        )
        probing = asyncio.ensure_future(probe(list(decodes.values()), streaming))
        worst = await oldest_heartbeat(stack, set(decodes), probing)
        sent = probing.result()
        assert streaming.result() == refs
    print(f"\nprobe: {sent} crafted headers; oldest decode heartbeat seen {worst:.2f} s")
    assert sent >= PROBES
    assert failovers(stack) == before
    assert worst < 2.0
