"""Where a failover resumes: another decode node when one is registered (its standby if it
has room), and when none is (all of them suspected at once, as while NATS comes back), the
first one that registers within NODE_WAIT; past that the resume gives up. Which node
becomes a stream's standby, and when. The dispatch is a stand-in holding what Failover
reads; RequestStream is the real one (its bus is never used here)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from msgspec.structs import replace

from services.router import failover as failover_module
from services.router.failover import Failover
from services.router.metrics import RouterMetrics
from services.router.nodes import NodeTable
from services.router.streams import RequestStream
from shared.bus.messages import Message, NodeInfo, Prefetch, PrefillJob, TokenDelta, encode
from tests.unit.test_stream_gaps import FakeMsg


class Nodes:
    def __init__(self) -> None:
        self.decode: list[NodeInfo] = []

    def pick_decode(
        self, blocks: int, exclude: set[str] | None = None, prefer: str = "", model: str = ""
    ) -> NodeInfo | None:
        return next(
            (
                n
                for n in self.decode
                if n.node_id not in (exclude or set()) and (not model or n.model in (model, ""))
            ),
            None,
        )


def decoder(node_id: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, role="decode")


class Config:
    first_token_timeout = 60.0
    standby_after = 2


class Bus:
    def __init__(self) -> None:
        self.published: list[tuple[str, Message]] = []

    async def publish(self, subject: str, msg: Message) -> None:
        self.published.append((subject, msg))


class RouterStandIn:
    def __init__(self) -> None:
        self.nodes: Any = Nodes()
        self.bus = Bus()
        self.config = Config()
        self.metrics = RouterMetrics()
        self.sent: list[tuple[str, PrefillJob]] = []
        self.cancels: list[tuple[str, str]] = []

    async def resubmit(self, node: NodeInfo, job: PrefillJob, blocks: int) -> str:
        self.sent.append((node.node_id, job))
        return "remote"

    async def cancel_on(self, node: str, request_id: str, reason: str) -> None:
        self.cancels.append((node, request_id))


def failover_of(router: RouterStandIn) -> Failover:
    job = PrefillJob(attempt_id="r1", prompt_ids=[1, 2, 3], decode_node="d1")
    stream = RequestStream(bus=None, request_id="r1", output_ids=[7, 8])  # type: ignore[arg-type]
    stream.node_id = "d1"
    return Failover(router, router.metrics, job, stream, blocks=1)  # type: ignore[arg-type]


async def test_resumes_on_another_node_and_frees_the_one_it_left() -> None:
    router = RouterStandIn()
    router.nodes.decode = [decoder("d1"), decoder("d2")]
    assert await failover_of(router).resume("stalled")
    [(node, job)] = router.sent
    assert node == "d2" and job.output_ids == [7, 8] and job.decode_node == "d2"
    assert router.cancels == [("d1", "r1")]


async def test_resumes_on_a_node_of_its_model() -> None:
    router = RouterStandIn()
    other, same = decoder("d2"), decoder("d3")
    router.nodes.decode = [decoder("d1"), replace(other, model="a"), replace(same, model="b")]
    failover = failover_of(router)
    failover.job = replace(failover.job, model="b")
    assert await failover.resume("stalled")
    assert [node for node, _ in router.sent] == ["d3"]


async def test_waits_for_a_decode_node_when_none_is_registered() -> None:
    router = RouterStandIn()

    async def comes_back() -> None:
        await asyncio.sleep(0.5)  # its next heartbeat
        router.nodes.decode = [decoder("d1")]

    started = time.monotonic()
    back = asyncio.create_task(comes_back())
    assert await failover_of(router).resume("its decode node was lost")
    await back
    assert time.monotonic() - started >= 0.5
    assert [node for node, _ in router.sent] == ["d1"]  # the only one, so the same one


async def test_gives_up_when_no_decode_node_comes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover_module, "NODE_WAIT", 0.3)
    router = RouterStandIn()
    started = time.monotonic()
    assert not await failover_of(router).resume("its decode node was lost")
    assert 0.3 <= time.monotonic() - started < 2.0
    assert router.sent == [] and router.cancels == []


async def test_a_steered_job_fails_over_when_its_prefill_node_is_lost() -> None:
    router = RouterStandIn()
    router.nodes.decode = [decoder("d1"), decoder("d2")]
    job = PrefillJob(attempt_id="r2", prompt_ids=[1, 2, 3], decode_node="d1")
    stream = RequestStream(bus=None, request_id="r2")  # type: ignore[arg-type]
    failover = Failover(router, router.metrics, job, stream, blocks=1, prefill_node="p1")  # type: ignore[arg-type]
    assert failover.expected_sender() == "p1"  # probed until it sends token 0
    failover.node_left("p2")
    assert not failover.lost.is_set()
    failover.node_left("p1")
    assert failover.lost.is_set()
    assert await failover.resume("its prefill node was lost")
    failover.lost.clear()
    [(_, resumed)] = router.sent
    assert resumed.output_ids == [] and failover.expected_sender() == ""  # not steered again
    failover.node_left("p1")  # its registry entry expires later: no second failover
    assert not failover.lost.is_set()


async def test_a_stream_whose_last_delta_comes_while_a_node_is_sought_is_not_resumed() -> None:
    """A router waking from a stall sees its nodes' entries lapsed (lost) before it reads
    the deltas that waited in NATS: if the finished one comes in while the failover looks
    for a node, the stream is complete and nothing is resubmitted (a decode node would
    refuse it: max_tokens reached), and the stream goes on to that delta."""
    router = RouterStandIn()  # no decode node yet: the failover waits NODE_WAIT for one
    failover = failover_of(router)
    stream = failover.stream
    stream.next_seq = 2

    async def the_rest_arrives() -> None:
        await asyncio.sleep(0.2)
        last = TokenDelta(attempt_id="r1", seq=2, token_ids=[9], finished=True,
                          finish_reason="length", node_id="d1")  # fmt: skip
        await stream._on_msg(FakeMsg(encode(last)))  # type: ignore[arg-type]
        router.nodes.decode = [decoder("d2")]

    arrives = asyncio.create_task(the_rest_arrives())
    assert await failover.resume("its decode node was lost")
    await arrives
    assert router.sent == [] and router.cancels == [] and failover.attempts == 0
    assert stream.ended and stream.token_ids == [7, 8, 9]
    delivered = [d async for d in stream.deltas(1.0, 1.0)]
    assert [d.token_ids for d in delivered] == [[9]] and delivered[0].finished


def decode_node(node_id: str, free: int, running: int = 0) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, role="decode", free_kv_blocks=free, total_kv_blocks=100, running=running
    )


def table(*nodes: NodeInfo) -> NodeTable:
    t = NodeTable(None)  # type: ignore[arg-type]  # never started: its nodes are set here
    t.nodes = {n.node_id: n for n in nodes}
    return t


async def test_resumes_on_its_standby_if_it_is_alive_with_room() -> None:
    router = RouterStandIn()
    nodes = table(decode_node("d1", 90), decode_node("d2", 90), decode_node("d3", 40, 3))
    router.nodes = nodes
    failover = failover_of(router)
    failover.standby = "d3"  # busier than d2: chosen only as the standby
    assert await failover.resume("its decode node was lost")
    assert [node for node, _ in router.sent] == ["d3"]

    for standby, why in [("d3", "no room"), ("d1", "it was serving"), ("d9", "not registered")]:
        nodes.put(decode_node("d3", 0 if why == "no room" else 40, 3))
        router.sent.clear()
        failover = failover_of(router)
        failover.standby = standby
        assert await failover.resume("its decode node was lost")
        assert [node for node, _ in router.sent] == ["d2"], why  # the least loaded instead


async def test_a_stream_gets_one_standby_once_it_has_enough_tokens() -> None:
    router = RouterStandIn()
    router.nodes = table(
        decode_node("d1", 90), decode_node("d2", 50), decode_node("d3", 80),
        NodeInfo(node_id="k1", role="kvcache"),
    )  # fmt: skip
    job = PrefillJob(attempt_id="r1", prompt_ids=[1, 2, 3], decode_node="d1")
    stream = RequestStream(bus=None, request_id="r1", output_ids=[7])  # type: ignore[arg-type]
    stream.node_id = "d1"
    failover = Failover(router, router.metrics, job, stream, blocks=1)  # type: ignore[arg-type]
    await failover.warm_standby()
    assert router.bus.published == [] and failover.standby == ""  # 1 token < standby_after
    stream.token_ids.append(8)
    await failover.warm_standby()
    await failover.warm_standby()  # once per stream
    assert failover.standby == "d3"  # the most room, not the node serving it
    assert router.bus.published == [
        ("tandem.decode.d3.prefetch", Prefetch(attempt_id="r1", token_ids=[1, 2, 3, 7, 8]))
    ]
    assert await failover.resume("its decode node was lost")  # on the standby, d3
    stream.node_id = "d3"
    router.nodes.drop("d1")  # the lost node left
    await failover.warm_standby()  # a new standby for the new node
    assert failover.standby == "d2" and router.bus.published[-1][0] == "tandem.decode.d2.prefetch"


async def test_no_standby_without_a_kvcache_service_to_load_from() -> None:
    router = RouterStandIn()
    router.nodes = table(decode_node("d1", 90), decode_node("d2", 90))
    failover = failover_of(router)  # 2 tokens delivered
    await failover.warm_standby()
    assert router.bus.published == [] and failover.standby == "-"
