"""Where a failover resumes: another decode node when one is registered, and when none is
(all of them suspected at once, as while NATS comes back), the first one that registers
within NODE_WAIT; past that the resume gives up. The router is a stand-in holding what
Failover reads; RequestStream is the real one (its bus is never used here)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.router import failover as failover_module
from services.router.failover import Failover
from services.router.metrics import RouterMetrics
from services.router.streams import RequestStream
from shared.bus.messages import NodeInfo, PrefillJob


class Nodes:
    def __init__(self) -> None:
        self.decode: list[NodeInfo] = []

    def pick_decode(self, blocks: int, exclude: set[str] | None = None) -> NodeInfo | None:
        return next((n for n in self.decode if n.node_id not in (exclude or set())), None)


class Config:
    first_token_timeout = 60.0


class RouterStandIn:
    def __init__(self) -> None:
        self.nodes = Nodes()
        self.config = Config()
        self.metrics = RouterMetrics()
        self.sent: list[tuple[str, PrefillJob]] = []
        self.cancels: list[tuple[str, str]] = []

    async def resubmit(self, node: NodeInfo, job: PrefillJob, blocks: int, attempt: int) -> str:
        self.sent.append((node.node_id, job))
        return "disaggregated"

    async def cancel_on(self, node: str, request_id: str, reason: str) -> None:
        self.cancels.append((node, request_id))


def failover_of(router: RouterStandIn) -> Failover:
    job = PrefillJob(request_id="r1", prompt_ids=[1, 2, 3], decode_node="d1")
    stream = RequestStream(bus=None, request_id="r1", output_ids=[7, 8])  # type: ignore[arg-type]
    stream.node_id = "d1"
    return Failover(router, job, stream, blocks=1)  # type: ignore[arg-type]


async def test_resumes_on_another_node_and_frees_the_one_it_left() -> None:
    router = RouterStandIn()
    router.nodes.decode = [NodeInfo(node_id="d1"), NodeInfo(node_id="d2")]
    assert await failover_of(router).resume("stalled")
    [(node, job)] = router.sent
    assert node == "d2" and job.output_ids == [7, 8] and job.decode_node == "d2"
    assert router.cancels == [("d1", "r1")]


async def test_waits_for_a_decode_node_when_none_is_registered() -> None:
    router = RouterStandIn()

    async def comes_back() -> None:
        await asyncio.sleep(0.5)  # its next heartbeat
        router.nodes.decode = [NodeInfo(node_id="d1")]

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
    router.nodes.decode = [NodeInfo(node_id="d1"), NodeInfo(node_id="d2")]
    job = PrefillJob(request_id="r2", prompt_ids=[1, 2, 3], decode_node="d1")
    stream = RequestStream(bus=None, request_id="r2")  # type: ignore[arg-type]
    failover = Failover(router, job, stream, blocks=1, prefill_node="p1")  # type: ignore[arg-type]
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
