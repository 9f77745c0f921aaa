"""The router's liveness probe against a real NATS server: a node that should send the next
token of an in-flight stream is pinged every 0.05 s, so a node that died (its subscription
gone: NATS answers "no responders") is declared dead within a fraction of a second even
while its stream still looks healthy; a node slow to answer is not declared dead while its
tokens flow, only once its streams are quiet and several probes in a row went unanswered.
The router around the probe is a stand-in holding only what the probe reads."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError

from services.router.liveness import LivenessProbe, ProbeTiming
from services.router.metrics import RouterMetrics
from shared.bus.client import Bus
from shared.bus.server import NatsServer
from shared.bus.topology import PING_STALLED, ping_subject

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


@dataclass
class Registered:
    role: str = "decode"


class Registry:
    """What the probe reads of the router's node table: every node is a decode node."""

    def get(self, node_id: str) -> Registered:
        return Registered()


class Nodes:
    nodes = Registry()

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


def probe_of(router: RouterStandIn, timing: ProbeTiming) -> LivenessProbe:
    """The probe over the stand-in's parts (its `failovers` are what InFlight holds)."""
    return LivenessProbe(
        router.bus,
        router,  # type: ignore[arg-type]
        router.nodes,  # type: ignore[arg-type]
        router.metrics,
        router.node_lost,
        timing,
    )


@pytest.fixture
async def router(nats_server: NatsServer) -> AsyncIterator[RouterStandIn]:
    bus = await Bus(nats_server.url, "router-test").connect()
    yield RouterStandIn(bus)
    await bus.close()


async def answer(msg: Msg) -> None:
    await msg.respond(b"")


SETUP = b"setup"


async def subscribe_pings(
    router: RouterStandIn, node: Bus, cb: Callable[[Msg], Awaitable[None]]
) -> Subscription:
    """Subscribe `node` to its pings (probes go to `cb`) once the router reaches it: a
    freshly started nats-server can answer "no responders" for a moment even to a
    subscription already flushed (seen in ~1 of 30 fresh servers)."""
    assert node.nc is not None and router.bus.nc is not None

    async def on_ping(msg: Msg) -> None:
        await (msg.respond(b"") if msg.data == SETUP else cb(msg))

    sub = await node.nc.subscribe(ping_subject("decode", node.name), cb=on_ping)
    await node.nc.flush()
    for _ in range(100):
        try:
            await router.bus.nc.request(ping_subject("decode", node.name), SETUP, timeout=0.5)
            return sub
        except NoRespondersError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"{node.name} never became reachable")


@contextlib.asynccontextmanager
async def running(probe: LivenessProbe) -> AsyncIterator[None]:
    """The probe's loop, running for the body of the `async with`."""
    stop = asyncio.Event()
    task = asyncio.create_task(probe.run(stop))
    try:
        yield
    finally:
        stop.set()
        await task


async def lost_within(router: RouterStandIn, node: str, seconds: float) -> float:
    """How long after now `node` was declared dead, waiting at most `seconds`."""
    start = time.monotonic()
    while node not in router.lost and time.monotonic() - start < seconds:
        await asyncio.sleep(0.01)
    assert node in router.lost, f"{node} not declared dead within {seconds}s"
    return router.lost[node] - start


async def keep_flowing(flow: Flow, until: asyncio.Event) -> None:
    while not until.is_set():
        flow.stream.last_delta_at = time.monotonic()
        await asyncio.sleep(0.05)


async def test_a_dead_node_is_found_before_its_stream_looks_quiet(
    router: RouterStandIn, nats_server: NatsServer
) -> None:
    node = await Bus(nats_server.url, "d1").connect()
    assert node.nc is not None and router.bus.nc is not None
    sub = await subscribe_pings(router, node, answer)
    flow = Flow("d1", Stream(itl=2.0))  # quiet only after 5 s (probe_after)
    router.failovers["r1"] = flow
    probe = probe_of(router, ProbeTiming(probe_after=5.0))
    try:
        async with running(probe):
            await asyncio.sleep(0.5)
            assert not router.lost  # alive and answering
            await sub.unsubscribe()  # what a SIGKILL does to its subscription
            await node.nc.flush()
            flow.stream.last_delta_at = time.monotonic()  # its last token came just now
            assert await lost_within(router, "d1", 1.0) < 0.5  # long before the 5 s threshold
    finally:
        await node.close()


async def test_a_node_slow_to_answer_is_alive_while_its_tokens_flow(
    router: RouterStandIn, nats_server: NatsServer
) -> None:
    node = await Bus(nats_server.url, "d2").connect()
    assert node.nc is not None

    async def never(msg: Msg) -> None:  # subscribed, but never answers (a cut link)
        pass

    await subscribe_pings(router, node, never)
    flow = Flow("d2", Stream(itl=0.05))
    router.failovers["r2"] = flow
    probe = probe_of(router, ProbeTiming(probe_after=0.5, timeout=0.1))
    flowing = asyncio.Event()
    tokens = asyncio.create_task(keep_flowing(flow, flowing))
    try:
        async with running(probe):
            await asyncio.sleep(1.5)  # ~15 unanswered probes, every one while tokens flowed
            assert not router.lost
            flowing.set()  # the stream goes quiet: now unanswered probes count
            await tokens
            assert await lost_within(router, "d2", 3.0) < 2.0
    finally:
        await node.close()


async def test_a_nats_restart_is_no_verdict_on_nodes_that_come_back_late(
    router: RouterStandIn, nats_server: NatsServer
) -> None:
    """After a NATS restart a node that resubscribes a moment after the router is back has
    no subscription yet ("no responders"): alive all the same. One whose subscription never
    comes back is declared dead once the grace after the router's reconnection is over."""
    late, gone = [await Bus(nats_server.url, n).connect() for n in ("late", "gone")]
    assert late.nc is not None and gone.nc is not None
    subs = [await subscribe_pings(router, n, answer) for n in (late, gone)]
    router.failovers = {"r-late": Flow("late"), "r-gone": Flow("gone")}
    probe = probe_of(router, ProbeTiming(reconnect_grace=1.5))
    try:
        async with running(probe):
            await asyncio.sleep(0.3)
            assert not router.lost
            reconnects = router.bus.reconnects
            await asyncio.to_thread(nats_server.stop)
            for sub in subs:  # while the server is away: neither is subscribed when it is back
                await sub.unsubscribe()
            await asyncio.to_thread(nats_server.start)
            while router.bus.reconnects == reconnects:
                await asyncio.sleep(0.01)
            # The grace runs from the router's own reconnection, which this loop notices up
            # to a poll later (asserting against that later time once missed by 0.2 ms).
            back = router.bus.reconnected_at
            await asyncio.sleep(0.5)  # "no responders" for both, all this time
            assert not router.lost
            await late.nc.subscribe(ping_subject("decode", "late"), cb=answer)  # "late" is back
            await late.nc.flush()
            while "gone" not in router.lost and time.monotonic() - back < 5:
                await asyncio.sleep(0.01)
            assert set(router.lost) == {"gone"}
            assert router.lost["gone"] - back >= 1.5
    finally:
        await late.close()
        await gone.close()


async def test_a_probe_lost_with_the_node_does_not_delay_its_verdict(
    router: RouterStandIn, nats_server: NatsServer
) -> None:
    """A node that dies holding a probe never answers it: the next probes go out meanwhile
    (they overlap), find its subscription gone, and the verdict comes long before the lost
    probe's timeout."""
    node = await Bus(nats_server.url, "d3").connect()
    assert node.nc is not None
    died = asyncio.Event()

    async def die_holding_it(msg: Msg) -> None:
        if not died.is_set():  # it dies holding this probe: never answered
            died.set()
        else:  # probes that come before its subscription is gone are still answered
            await msg.respond(b"")

    sub = await subscribe_pings(router, node, die_holding_it)
    router.failovers["r3"] = Flow("d3", Stream(itl=2.0))  # never quiet within the test
    probe = probe_of(router, ProbeTiming(probe_after=5.0, timeout=2.0))
    try:
        async with running(probe):
            await asyncio.wait_for(died.wait(), 2)
            await sub.unsubscribe()
            await node.nc.flush()
            assert await lost_within(router, "d3", 3.0) < 1.0  # the held probe's timeout is 2 s
    finally:
        await node.close()


async def test_overlapping_probes_of_a_silent_node_count_one_miss_per_timeout(
    router: RouterStandIn, nats_server: NatsServer
) -> None:
    """A cut-off node (subscribed, never answering) with quiet streams is declared dead
    after `misses` timeouts' worth of silence, however many probes overlapped in it."""
    node = await Bus(nats_server.url, "d4").connect()
    assert node.nc is not None

    async def never(msg: Msg) -> None:
        pass

    await subscribe_pings(router, node, never)
    router.failovers["r4"] = Flow("d4", Stream(itl=0.05, last_delta_at=time.monotonic() - 9))
    probe = probe_of(router, ProbeTiming(timeout=0.3, misses=3))
    try:
        async with running(probe):
            # three counted misses: sent at >= 0, 0.3 and 0.6 s, the last timing out at 0.9 s
            # (probes every 0.025 s, three in flight, would count three misses by ~0.4 s)
            assert await lost_within(router, "d4", 5.0) >= 0.85
    finally:
        await node.close()


async def test_a_node_that_answers_stalled_is_dead_at_once(
    router: RouterStandIn, nats_server: NatsServer
) -> None:
    """Its event loop answers, but says its engine hangs: its streams move now, not after
    the stall timeout or missed probes."""
    node = await Bus(nats_server.url, "d1").connect()
    stalled = asyncio.Event()

    async def honest(msg: Msg) -> None:
        reply = f"{PING_STALLED}: an engine call has run 21s" if stalled.is_set() else "ok"
        await msg.respond(reply.encode())

    await subscribe_pings(router, node, honest)
    flow = Flow("d1", Stream(itl=2.0))  # quiet only after 5 s (probe_after)
    router.failovers["r1"] = flow
    try:
        async with running(probe_of(router, ProbeTiming(probe_after=5.0))):
            await asyncio.sleep(0.5)
            assert not router.lost  # "ok": alive
            stalled.set()
            assert await lost_within(router, "d1", 1.0) < 0.5
    finally:
        await node.close()


async def test_a_router_held_up_declares_no_live_node_dead(
    router: RouterStandIn, nats_server: NatsServer
) -> None:
    """A starved router notices its probes' timeouts late, before it has read the answers
    (and its streams look quiet, their tokens unread too): no verdict then. The same
    node cut off (never answering) is still declared dead once the router runs freely."""
    node = await Bus(nats_server.url, "d5").connect()
    answering = True

    replies: set[asyncio.Task[None]] = set()

    async def later(msg: Msg) -> None:
        await asyncio.sleep(0.1)
        await msg.respond(b"ok")

    async def maybe(msg: Msg) -> None:
        if answering:  # 0.1 s later, within the timeout: a probe is always in flight
            task = asyncio.create_task(later(msg))  # each apart: pings overlap
            replies.add(task)
            task.add_done_callback(replies.discard)

    await subscribe_pings(router, node, maybe)
    router.failovers["r5"] = Flow("d5", Stream(itl=0.05, last_delta_at=time.monotonic() - 9))
    probe = probe_of(router, ProbeTiming(timeout=0.2, misses=3))
    try:
        async with running(probe):
            for _ in range(6):  # the whole process (router and node) held up 0.5 s at a time
                await asyncio.sleep(0.06)
                time.sleep(0.5)
            await asyncio.sleep(0.3)
            assert "d5" not in router.lost
            answering = False
            assert await lost_within(router, "d5", 5.0) >= 0.5
    finally:
        await node.close()
