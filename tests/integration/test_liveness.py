"""The router's liveness probe against a real NATS server: a node that should send the next
token of an in-flight stream is pinged every 0.1 s, so a node that died (its subscription
gone: NATS answers "no responders") is declared dead within a fraction of a second even
while its stream still looks healthy; a node slow to answer is not declared dead while its
tokens flow, only once its streams are quiet and several probes in a row went unanswered.
The router around the probe is a stand-in holding only what the probe reads."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.aio.msg import Msg

from services.router.liveness import LivenessProbe
from services.router.metrics import RouterMetrics
from shared.bus.client import Bus
from shared.bus.server import NatsServer
from shared.bus.topology import ping_subject

pytestmark = pytest.mark.integration


@dataclass
class Stream:
    itl: float | None = 0.1
    last_delta_at: float = field(default_factory=time.monotonic)


@dataclass
class Flow:
    """An in-flight request as the probe sees it: who sends next, and when it last did."""

    node: str
    stream: Stream = field(default_factory=Stream)

    def expected_sender(self) -> str:
        return self.node


class Nodes:
    def suspect(self, node_id: str) -> None:
        pass


class RouterStandIn:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.failovers: dict[str, Any] = {}
        self.metrics = RouterMetrics()
        self.nodes = Nodes()
        self.lost: dict[str, float] = {}

    def node_lost(self, node_id: str) -> None:
        self.lost.setdefault(node_id, time.monotonic())


@pytest.fixture
async def router(nats_server: NatsServer) -> AsyncIterator[RouterStandIn]:
    bus = await Bus(nats_server.url, "router-test").connect()
    yield RouterStandIn(bus)
    await bus.close()


async def answer(msg: Msg) -> None:
    await msg.respond(b"")


async def keep_flowing(flow: Flow, until: asyncio.Event) -> None:
    while not until.is_set():
        flow.stream.last_delta_at = time.monotonic()
        await asyncio.sleep(0.05)


async def test_a_dead_node_is_found_before_its_stream_looks_quiet(
    router: RouterStandIn, nats_server: NatsServer
) -> None:
    node = await Bus(nats_server.url, "d1").connect()
    assert node.nc is not None and router.bus.nc is not None
    sub = await node.nc.subscribe(ping_subject("d1"), cb=answer)
    await node.nc.flush()  # the server has the subscription before the first probe
    flow = Flow("d1", Stream(itl=2.0))  # quiet only after 5 s (probe_after)
    router.failovers["r1"] = flow
    probe = LivenessProbe(router, probe_after=5.0)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(probe.run(stop))
    try:
        await asyncio.sleep(0.5)
        assert not router.lost  # alive and answering
        await sub.unsubscribe()  # what a SIGKILL does to its subscription
        await node.nc.flush()
        died = time.monotonic()
        flow.stream.last_delta_at = died  # its last token came just now
        for _ in range(100):
            if router.lost:
                break
            await asyncio.sleep(0.01)
        assert "d1" in router.lost
        assert router.lost["d1"] - died < 0.5  # long before the 5 s quiet threshold
    finally:
        stop.set()
        await task
        await node.close()


async def test_a_node_slow_to_answer_is_alive_while_its_tokens_flow(
    router: RouterStandIn, nats_server: NatsServer
) -> None:
    node = await Bus(nats_server.url, "d2").connect()
    assert node.nc is not None

    async def never(msg: Msg) -> None:  # subscribed, but never answers (a cut link)
        pass

    await node.nc.subscribe(ping_subject("d2"), cb=never)
    await node.nc.flush()
    flow = Flow("d2", Stream(itl=0.05))
    router.failovers["r2"] = flow
    probe = LivenessProbe(router, probe_after=0.5, timeout=0.1)  # type: ignore[arg-type]
    stop, flowing = asyncio.Event(), asyncio.Event()
    tokens = asyncio.create_task(keep_flowing(flow, flowing))
    task = asyncio.create_task(probe.run(stop))
    try:
        await asyncio.sleep(1.5)  # ~15 unanswered probes, every one while tokens flowed
        assert not router.lost
        flowing.set()  # the stream goes quiet: now unanswered probes count
        await tokens
        quiet_from = time.monotonic()
        for _ in range(300):
            if router.lost:
                break
            await asyncio.sleep(0.01)
        assert "d2" in router.lost
        assert router.lost["d2"] - quiet_from < 2.0
    finally:
        stop.set()
        await task
        await node.close()


async def test_a_nats_restart_is_no_verdict_on_nodes_that_come_back_late(
    router: RouterStandIn, nats_server: NatsServer
) -> None:
    """After a NATS restart a node that resubscribes a moment after the router is back has
    no subscription yet ("no responders"): alive all the same. One whose subscription never
    comes back is declared dead once the grace after the router's reconnection is over."""
    late, gone = [await Bus(nats_server.url, n).connect() for n in ("late", "gone")]
    assert late.nc is not None and gone.nc is not None
    subs = [await n.nc.subscribe(ping_subject(n.name), cb=answer) for n in (late, gone)]
    for node in (late, gone):
        await node.nc.flush()
    router.failovers = {"r-late": Flow("late"), "r-gone": Flow("gone")}
    probe = LivenessProbe(router, reconnect_grace=1.5)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(probe.run(stop))
    try:
        await asyncio.sleep(0.3)
        assert not router.lost
        reconnects = router.bus.reconnects
        await asyncio.to_thread(nats_server.stop)
        for sub in subs:  # while the server is away: neither is subscribed when it is back
            await sub.unsubscribe()
        await asyncio.to_thread(nats_server.start)
        while router.bus.reconnects == reconnects:
            await asyncio.sleep(0.01)
        back = time.monotonic()
        await asyncio.sleep(0.5)  # "no responders" for both, all this time
        assert not router.lost
        await late.nc.subscribe(ping_subject("late"), cb=answer)  # "late" is back
        await late.nc.flush()
        while "gone" not in router.lost and time.monotonic() - back < 5:
            await asyncio.sleep(0.01)
        assert set(router.lost) == {"gone"}
        assert router.lost["gone"] - back >= 1.5
    finally:
        stop.set()
        await task
        await late.close()
        await gone.close()
