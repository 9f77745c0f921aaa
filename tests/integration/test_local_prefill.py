"""A decode node asked to prefill a request itself (a prefix it holds, or a resume) admits
it only while the asking router still waits: past the router's reply-by time, or once the
router cancelled that path (it timed out and sent the request another way), the node
refuses and keeps nothing, so the request never runs twice. Real NATS, real engine (tiny
model), the worker's own subscriptions."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest

from services.decode.worker import DecodeWorker
from shared.bus.client import Bus
from shared.bus.ids import AttemptId
from shared.bus.messages import Cancel, PrefillJob, encode, read_reply
from shared.bus.server import NatsServer
from shared.bus.topology import (
    REPLY_BY_HEADER,
    cancel_subject,
    ensure_topology,
    local_prefill_subject,
    token_subject,
)
from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture
async def worker(nats_server: NatsServer, tiny_model: LoadedModel) -> AsyncIterator[DecodeWorker]:
    bus = await Bus(nats_server.url, "decode-test").connect()
    assert bus.js is not None
    await ensure_topology(bus.js)
    w = DecodeWorker(Engine(tiny_model, EngineConfig(num_blocks=64)), bus, "d1")
    await w.subscribe()
    yield w
    w.close()
    await bus.close()


def job(rid: str) -> PrefillJob:
    return PrefillJob(
        attempt_id=AttemptId(rid),
        prompt_ids=list(range(5, 45)),
        params=SamplingParams(max_tokens=8, temperature=0),
        token_subject=token_subject(rid),
    )


async def ask(w: DecodeWorker, rid: str, reply_by: float | None) -> str:
    """The node's typed answer, as "ok" or "refused: <reason>"."""
    assert w.bus.nc is not None
    headers = {REPLY_BY_HEADER: f"{reply_by:.3f}"} if reply_by is not None else None
    msg = await w.bus.nc.request(
        local_prefill_subject("d1"), encode(job(rid)), timeout=10, headers=headers
    )
    reply = read_reply(msg.data)
    return "ok" if reply.accepted else f"refused: {reply.reason}"


async def hold_engine_thread(w: DecodeWorker) -> tuple[threading.Event, asyncio.Future[None]]:
    """A long step: the engine thread is busy until the returned event is set (then await
    the returned future)."""
    busy, release = threading.Event(), threading.Event()

    def long_step() -> None:
        busy.set()
        release.wait(10)

    blocked = asyncio.get_running_loop().run_in_executor(w.thread.executor, long_step)
    await asyncio.to_thread(busy.wait, 5)
    return release, blocked


async def test_admits_in_time_and_refuses_a_second_copy(worker: DecodeWorker) -> None:
    assert await ask(worker, "r1", time.time() + 5) == "ok"
    assert "r1" in worker.engine.requests and "r1" in worker.streams
    assert await ask(worker, "r1", time.time() + 5) == "refused: already here"
    assert await ask(worker, "r2", None) == "ok"  # no header: no limit (older routers)


async def test_refuses_after_the_router_stopped_waiting(worker: DecodeWorker) -> None:
    used = worker.engine.pool.num_used
    assert await ask(worker, "late", time.time() - 0.01) == "refused: the router stopped waiting"
    assert "late" not in worker.engine.requests and "late" not in worker.streams
    assert worker.engine.pool.num_used == used


async def test_a_cancel_during_admission_leaves_nothing(worker: DecodeWorker) -> None:
    """The router timed out while the engine thread was busy (a long step): its targeted
    cancel arrives before the admission completes; the node must drop the request."""
    assert worker.bus.nc is not None
    release, blocked = await hold_engine_thread(worker)
    answer = asyncio.create_task(ask(worker, "slow", time.time() + 30))
    for _ in range(100):  # until the node is waiting on the engine thread to admit it
        if "slow" in worker.local.admitting:
            break
        await asyncio.sleep(0.02)
    assert "slow" in worker.local.admitting
    cancel = Cancel(attempt_id="slow", reason="local prefill timed out", node_id="d1")
    await worker.bus.nc.publish(cancel_subject(), encode(cancel))
    await worker.bus.nc.flush()
    for _ in range(100):
        if worker.local.admitting.get("slow"):
            break
        await asyncio.sleep(0.02)
    release.set()
    await blocked
    assert await answer == "refused: cancelled"
    assert "slow" not in worker.engine.requests and "slow" not in worker.streams
    assert not worker.local.admitting
    assert worker.engine.pool.num_used == 0


async def test_a_cancel_for_another_node_changes_nothing(worker: DecodeWorker) -> None:
    assert worker.bus.nc is not None
    assert await ask(worker, "kept", time.time() + 5) == "ok"
    cancel = Cancel(attempt_id="kept", reason="failed over", node_id="d2")
    await worker.bus.nc.publish(cancel_subject(), encode(cancel))
    await worker.bus.nc.flush()
    await asyncio.sleep(0.2)
    assert "kept" in worker.engine.requests and "kept" in worker.streams


async def test_a_cancel_that_overtook_its_request_refuses_it(worker: DecodeWorker) -> None:
    """The router gave up (or its client left) while the request still waited behind other
    local prefills here: the cancel arrives first, and the request must not start after."""
    assert worker.bus.nc is not None
    cancel = Cancel(attempt_id="queued", reason="local prefill timed out", node_id="d1")
    await worker.bus.nc.publish(cancel_subject(), encode(cancel))
    await worker.bus.nc.flush()
    for _ in range(100):
        if worker.local.cancelled_before("queued"):
            break
        await asyncio.sleep(0.02)
    assert await ask(worker, "queued", time.time() + 5) == "refused: cancelled"
    assert "queued" not in worker.engine.requests
    assert await ask(worker, "other", time.time() + 5) == "ok"  # only that one


async def test_requests_arriving_together_are_admitted_together(worker: DecodeWorker) -> None:
    """Requests that arrive during a step all wait for that one step, not one step each:
    admissions awaited inside the subscription's callback entered the engine one per step,
    so each prompt was prefilled alone (W16 first tokens 0.3 s apart)."""
    release, blocked = await hold_engine_thread(worker)
    rids = [f"together-{i}" for i in range(4)]
    answers = [asyncio.create_task(ask(worker, rid, time.time() + 30)) for rid in rids]
    for _ in range(200):  # every one reaches the engine thread's queue during the step
        if all(rid in worker.local.admitting for rid in rids):
            break
        await asyncio.sleep(0.02)
    assert all(rid in worker.local.admitting for rid in rids)
    assert worker.local.reserved_blocks > 0  # their blocks count as taken meanwhile
    release.set()
    await blocked
    assert await asyncio.gather(*answers) == ["ok"] * 4
    assert all(rid in worker.engine.requests for rid in rids)
    assert worker.local.reserved_blocks == 0
