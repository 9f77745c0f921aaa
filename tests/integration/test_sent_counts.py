"""A request the router sends to a decode node counts once against that node until its next
heartbeat, whichever path took it (issue 52: `NodeTable.inflight` had four writers, and a
locally prefilled request was counted twice: by the plan that chose the node, and again
when the node accepted it). On a real nats-server, with a decode node stand-in answering."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.msg import Msg

from services.router.config import RouterConfig
from services.router.dispatch import Dispatch
from services.router.nodes import NodeTable
from services.router.placement import plan
from services.router.routing import PrefixRouter
from shared.bus.client import Bus
from shared.bus.kv_events import KVIndex
from shared.bus.messages import PrefillJob, accepted, refused
from shared.bus.server import NatsServer
from shared.bus.topology import local_prefill_subject
from tests.unit.test_routing import decode_node

pytestmark = pytest.mark.integration


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    b = await Bus(nats_server.url, "router-test").connect()
    yield b
    await b.close()


async def accepting(bus: Bus, node_id: str) -> None:
    """A decode node's local-prefill subject, answered "accepted"."""

    async def answer(msg: Msg) -> None:
        await msg.respond(accepted())

    assert bus.nc is not None
    await bus.nc.subscribe(local_prefill_subject(node_id), cb=answer)
    await bus.nc.flush()


async def test_a_local_prefill_counts_once(bus: Bus) -> None:
    nodes = NodeTable(registry=None, colocated=True)  # type: ignore[arg-type]
    nodes.nodes = {"d1": decode_node("d1")}
    await accepting(bus, "d1")
    chosen = plan(nodes, PrefixRouter(nodes, KVIndex(), colocated=True), list(range(40)), 8)
    assert chosen.local and nodes.inflight == {"d1": 1}  # the plan counts its choice
    dispatch = Dispatch(RouterConfig(), bus, nodes, journal=None)  # type: ignore[arg-type]
    job = PrefillJob(attempt_id="cmpl-1", prompt_ids=list(range(40)), decode_node="d1")
    assert await dispatch.send_local(chosen.decode_node, job)
    assert nodes.inflight == {"d1": 1}  # accepted: still one


def test_a_refused_send_is_taken_back_and_never_below_zero() -> None:
    nodes = NodeTable(registry=None)  # type: ignore[arg-type]
    nodes.sent("d1")
    nodes.sent("d1", -1)
    nodes.sent("d1", -1)
    assert nodes.inflight == {"d1": 0}


async def test_a_refused_resume_moves_its_count_to_the_node_it_goes_to(bus: Bus) -> None:
    """A failover's target (counted as it was picked) refuses the resumed request: it goes
    through the prefill queue to another decode node, and the count goes with it, as a
    refused local prefill's does (`placement.after_local_refusal`)."""

    async def refuse(msg: Msg) -> None:
        await msg.respond(refused("not enough free KV blocks"))

    assert bus.nc is not None
    await bus.nc.subscribe(local_prefill_subject("d1"), cb=refuse)
    await bus.nc.flush()
    nodes = NodeTable(registry=None)  # type: ignore[arg-type]
    prefill = msgspec.structs.replace(decode_node("p1"), role="prefill")  # a queue to go by
    nodes.nodes = {"d1": decode_node("d1"), "d2": decode_node("d2"), "p1": prefill}
    target = nodes.pick_decode(2, {"d2"})  # the failover's pick: counted
    assert target is not None and target.node_id == "d1" and nodes.inflight == {"d1": 1}
    dispatch = Dispatch(RouterConfig(), bus, nodes, journal=None)  # type: ignore[arg-type]
    queued: list[PrefillJob] = []

    async def submit(job: PrefillJob, prefill_node: str = "") -> None:
        queued.append(job)  # the prefill queue's side is tests/integration/test_bus.py's

    dispatch.submit = submit  # type: ignore[method-assign]
    job = PrefillJob(attempt_id="cmpl-2", prompt_ids=list(range(40)), decode_node="d1",
                     output_ids=[5, 6])  # fmt: skip
    assert await dispatch.resubmit(target, job, 2) == "remote"
    assert [j.decode_node for j in queued] == ["d2"]
    assert nodes.inflight == {"d1": 0, "d2": 1}
