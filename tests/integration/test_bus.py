"""Control plane against a real nats-server: work queue, registry, journal, restarts, bad input."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from services.prefill.intake import JobIntake, others_serve
from shared.bus.auth import BusAuth
from shared.bus.client import Bus
from shared.bus.ids import AttemptId
from shared.bus.journal import RequestJournal
from shared.bus.kv_keys import live_keys
from shared.bus.messages import JournalEntry, NodeInfo, PrefillJob, TokenDelta, decode, encode
from shared.bus.registry import (
    STALE_CHECK,
    CachedNodes,
    NodeRegistry,
    RegistryEvent,
    node_info,
    stale_after,
)
from shared.bus.server import NatsServer
from shared.bus.topology import (
    NODES_BUCKET,
    PREFILL_STREAM,
    PREFILL_SUBJECT,
    TopologyConfig,
    ensure_topology,
    prefill_consumer,
)
from shared.bus.tracing import extract_context
from shared.bus.workqueue import JobConsumer, ReceivedJob, purge_steered, submit_job
from shared.errors import TandemError
from shared.sampling_params import SamplingParams
from tests.polling import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FAST = TopologyConfig(ack_wait=2.0, max_deliver=3, node_ttl=1.0)


async def connect(server: NatsServer, name: str) -> Bus:
    bus = await Bus(server.url, name).connect()
    assert bus.js is not None
    await ensure_topology(bus.js, FAST)
    return bus


def job(attempt: str) -> PrefillJob:
    return PrefillJob(
        attempt_id=AttemptId(attempt), prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=4)
    )


async def test_topology_setup_is_idempotent(nats_server: NatsServer) -> None:
    bus = await connect(nats_server, "a")
    assert bus.js is not None
    await ensure_topology(bus.js, FAST)
    await ensure_topology(bus.js, TopologyConfig(ack_wait=3.0, node_ttl=1.0))
    info = await bus.js.consumer_info(PREFILL_STREAM, "prefill-workers")
    assert info.config.ack_wait == 3.0
    await bus.close()


async def test_killed_consumer_job_is_redelivered_and_duplicates_stored_once(
    nats_server: NatsServer,
) -> None:
    bus = await connect(nats_server, "router")
    await submit_job(bus, job("r-1"))
    await submit_job(bus, job("r-1"))  # a retried publish with the same Nats-Msg-Id
    assert bus.js is not None
    assert (await bus.js.stream_info(PREFILL_STREAM)).state.messages == 1
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.bus_worker", nats_server.url],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        assert line.strip() == "got r-1"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        if child.stdout:
            child.stdout.close()
    consumer = await JobConsumer(bus).start()
    deadline = time.monotonic() + FAST.ack_wait + 5
    received = []
    while not received and time.monotonic() < deadline:
        received = await consumer.fetch(batch=1, timeout=1.0)
    assert [r.job.attempt_id for r in received] == ["r-1"]
    assert received[0].num_delivered == 2
    await received[0].ack()
    assert await consumer.fetch(batch=1, timeout=0.5) == []
    await bus.close()


async def test_steered_jobs_reach_only_their_node_and_a_lost_node_s_are_purged(
    nats_server: NatsServer,
) -> None:
    bus = await connect(nats_server, "router")
    assert bus.js is not None
    p1, p2 = await JobIntake(bus, "p1").start(), await JobIntake(bus, "p2").start()
    await submit_job(bus, job("shared-1"))
    await submit_job(bus, job("steered-1"), prefill_node="p1")
    # p1 asks its own queue first: the steered job, although it was queued second
    assert [j.job.attempt_id for j in await p1.fetch(1)] == ["steered-1"]
    assert [j.job.attempt_id for j in await p2.fetch(4)] == ["shared-1"]  # any node's
    await submit_job(bus, job("steered-2"), prefill_node="p2")
    assert await p1.fetch(4) == []  # never another node's steered job
    await purge_steered(bus, "p2")  # p2 was lost: its request fails over elsewhere
    assert await p2.fetch(4) == []
    assert (await bus.js.stream_info(PREFILL_STREAM)).state.messages == 2  # fetched, unacked
    await p1.stop()
    await p2.stop()
    await bus.close()


async def backlog_settles(intake: JobIntake, want: int, within: float = 5.0) -> bool:
    """Whether the node's own queue's backlog reaches `want` within `within` seconds."""
    deadline = time.monotonic() + within
    while (await intake.own.backlog()) != want:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_a_busy_node_looks_at_its_own_queue_before_pulling_it(
    nats_server: NatsServer,
) -> None:
    """After a fetch that brought jobs, a node asks the server for its own queue's backlog
    and pulls it only when it holds something (a pull of an empty queue waits out its
    expiry between every two batches); steered jobs still come first, and an idle node
    pulls its own queue as before."""
    bus = await connect(nats_server, "router")
    intake = await JobIntake(bus, "p1").start()
    try:
        pulls: list[str] = []
        own_fetch = intake.own.fetch

        async def counted(batch: int = 8, timeout: float = 1.0) -> list[ReceivedJob]:
            pulls.append("own")
            return await own_fetch(batch=batch, timeout=timeout)

        intake.own.fetch = counted  # type: ignore[method-assign]
        assert await intake.own.backlog() == 0
        for i in range(3):
            await submit_job(bus, job(f"shared-{i}"))
        got = await intake.fetch(1)  # idle: pulls its own queue (empty), then the shared one
        assert [j.job.attempt_id for j in got] == ["shared-0"] and pulls == ["own"]
        await got[0].ack()
        got = await intake.fetch(1)  # busy: its own queue is empty, so it is not pulled
        assert [j.job.attempt_id for j in got] == ["shared-1"] and pulls == ["own"]
        await got[0].ack()
        await submit_job(bus, job("steered-1"), prefill_node="p1")
        assert await intake.own.backlog() == 1
        got = await intake.fetch(1)  # busy, and a steered job waits: pulled, and first
        assert [j.job.attempt_id for j in got] == ["steered-1"] and pulls == ["own", "own"]
        assert await intake.own.backlog() == 1  # delivered, not yet acknowledged
        await got[0].ack()
        # An ack is a plain publish: the server applies it a moment later, so wait for it (the
        # intake's next fetch would otherwise see the job still pending and pull once more).
        assert await backlog_settles(intake, 0)
        got = await intake.fetch(4)
        assert [j.job.attempt_id for j in got] == ["shared-2"] and len(pulls) == 2
        await got[0].ack()
        assert await intake.fetch(4) == []  # busy: shared queue waited on, found empty
        assert await intake.fetch(4) == [] and len(pulls) == 3  # idle again: pulls its own
    finally:  # a failed assertion must not leave a client for a later test to collect
        await intake.stop()
        await bus.close()


async def test_a_draining_node_relieved_by_another_takes_only_its_own_jobs(
    nats_server: NatsServer,
) -> None:
    """A stopped prefill node drains what is queued for it: its own queue always, the
    shared one only when no other prefill node of its model takes new work (`others_serve`
    by the registry's entries; draining ones and other models' do not count)."""
    bus = await connect(nats_server, "router")
    intake = await JobIntake(bus, "p1").start()
    try:
        await submit_job(bus, job("shared-1"))
        await submit_job(bus, job("steered-1"), prefill_node="p1")
        got = await intake.fetch(4, shared=False)
        assert [j.job.attempt_id for j in got] == ["steered-1"]
        await got[0].ack()
        assert await intake.fetch(4, shared=False) == []  # the shared job is not taken
        got = await intake.fetch(4)
        assert [j.job.attempt_id for j in got] == ["shared-1"]
        await got[0].ack()
    finally:
        await intake.stop()
        await bus.close()

    def prefill(node_id: str, **fields: object) -> NodeInfo:
        return NodeInfo(node_id=node_id, role="prefill", **fields)  # type: ignore[arg-type]

    me = prefill("p1", draining=True)
    assert not others_serve({"p1": me}, "p1", "m")  # the last one: it serves the shared queue
    assert not others_serve({}, "p1", "m")  # the registry unread: it serves it too
    assert others_serve({"p1": me, "p2": prefill("p2", model="m")}, "p1", "m")
    assert others_serve({"p2": prefill("p2")}, "p1", "m")  # a node of no model serves any
    assert not others_serve({"p2": prefill("p2", draining=True)}, "p1", "m")
    assert not others_serve({"p2": prefill("p2", model="other")}, "p1", "m")
    decode = NodeInfo(node_id="d1", role="decode", model="m")
    assert not others_serve({"d1": decode}, "p1", "m")


async def test_nak_retries_and_malformed_jobs_are_terminated(nats_server: NatsServer) -> None:
    bus = await connect(nats_server, "router")
    assert bus.nc is not None and bus.js is not None
    await bus.js.publish(PREFILL_SUBJECT, b"\x93garbage")
    await submit_job(bus, job("good"))
    consumer = await JobConsumer(bus).start()
    jobs = await consumer.fetch(batch=2, timeout=2.0)
    assert [j.job.attempt_id for j in jobs] == ["good"]
    assert bus.dropped[PREFILL_SUBJECT] == 1
    await jobs[0].nak(delay=0.2)
    again = await consumer.fetch(batch=1, timeout=3.0)
    assert [j.job.attempt_id for j in again] == ["good"] and again[0].num_delivered == 2
    await again[0].term()
    assert await consumer.fetch(batch=1, timeout=1.0) == []  # neither comes back
    await bus.close()


async def test_a_consumer_whose_remaking_failed_makes_itself_on_the_next_fetch(
    nats_server: NatsServer,
) -> None:
    """The shared consumer vanished (a NATS back without its store) and the first try to
    make it again failed (the server did not answer in time): the next fetch makes it, and
    jobs flow again. (It once stayed unmade for good: every later fetch failed.)"""
    bus = await connect(nats_server, "router")
    assert bus.js is not None
    consumer = await JobConsumer(bus).start()
    await bus.js.delete_consumer(PREFILL_STREAM, prefill_consumer(""))
    made, tries = consumer.start, 0

    async def flaky_start() -> JobConsumer:
        nonlocal tries
        tries += 1
        if tries == 1:
            raise TimeoutError
        return await made()

    consumer.start = flaky_start  # type: ignore[method-assign]
    with pytest.raises(TimeoutError):
        await consumer.fetch(batch=1, timeout=1.0)
    assert consumer.sub is None and await consumer.backlog() is None
    assert await consumer.fetch(batch=1, timeout=1.0) == []  # made again here
    await submit_job(bus, job("after"))
    jobs = await consumer.fetch(batch=1, timeout=3.0)
    assert [j.job.attempt_id for j in jobs] == ["after"] and tries == 2
    await jobs[0].ack()
    await bus.close()


async def test_registry_join_update_and_leave_by_ttl(nats_server: NatsServer) -> None:
    bus = await connect(nats_server, "watcher")
    node_bus = await connect(nats_server, "decode-1")
    watcher: asyncio.Task[None] | None = None
    try:
        registry = await NodeRegistry(bus, ttl=FAST.node_ttl).start()
        events: list[RegistryEvent] = []
        errors: list[Exception] = []
        seen_leave = asyncio.Event()

        async def watch() -> None:
            while True:  # as the router's NodeTable does: a watch that fails is started again
                try:
                    async for ev in registry.watch():
                        if ev.kind == "synced":  # the snapshot's end: not a node's event
                            synced.set()
                        else:
                            events.append(ev)
                        if ev.kind == "leave":
                            seen_leave.set()
                except Exception as exc:  # a server request timed out under load
                    errors.append(exc)
                    await asyncio.sleep(0.2)

        synced = asyncio.Event()
        watcher = asyncio.create_task(watch())
        # The watch is set up before the node beats: what follows is the live part only.
        await asyncio.wait_for(synced.wait(), timeout=10)
        node_registry = await NodeRegistry(node_bus, ttl=FAST.node_ttl).start()
        beats = asyncio.create_task(
            node_registry.run_heartbeats(
                lambda: node_info("decode-1", "decode", free_kv_blocks=10), interval=0.3
            )
        )

        async def joined_and_updated() -> bool:
            kinds = {e.kind for e in events}
            return {"join", "update"} <= kinds and "decode-1" in await registry.nodes()

        # Beating until the watch has seen a join and an update, and a read lists the node.
        await wait_until("decode-1's join and an update, and decode-1 listed", joined_and_updated)
        beats.cancel()
        stopped = time.monotonic()
        # By the expiry marker (about TTL + 1 s), or, if a loaded server's marker is lost
        # to the watcher, by the entry going unrefreshed: either way within a deadline.
        try:
            await asyncio.wait_for(seen_leave.wait(), timeout=stale_after(FAST.node_ttl) + 3)
        except TimeoutError:
            seen = [e.kind for e in events]
            raise AssertionError(f"no leave; the watch saw {seen}, failed {errors}") from None
        gone_after = time.monotonic() - stopped
        assert "decode-1" not in await registry.nodes()
        kinds = [e.kind for e in events]
        assert kinds[0] == "join" and "update" in kinds and kinds[-1] == "leave"
        assert gone_after <= stale_after(FAST.node_ttl) + 1.0
    finally:
        if watcher is not None:
            watcher.cancel()
        await node_bus.close()
        await bus.close()


async def test_an_entry_left_unrefreshed_leaves_the_watch_even_with_no_marker(
    nats_server: NatsServer,
) -> None:
    """A watcher that missed an entry's expiry marker still sees its node leave: the entry
    states its TTL, and one unrefreshed well past it is gone, even while another node's
    heartbeats keep the watch busy. An entry stating no TTL (an older node) leaves by its
    marker only."""
    bus = await connect(nats_server, "watcher-2")
    beats: asyncio.Task[None] | None = None
    try:
        registry = await NodeRegistry(bus, ttl=FAST.node_ttl).start()
        assert bus.js is not None
        # The stream keeps both entries for 30 s: no marker comes during the test.
        stating = node_info("decode-7", "decode", ttl=FAST.node_ttl)
        silent = node_info("decode-6", "decode")
        for info in (stating, silent):
            key = f"$KV.{NODES_BUCKET}.decode.{info.node_id}"
            await bus.js.publish(key, encode(info), msg_ttl=30)
        # A live node refreshing faster than the watch looks for stale entries.
        live = await NodeRegistry(bus, ttl=FAST.node_ttl).start()
        beats = asyncio.create_task(
            live.run_heartbeats(lambda: node_info("decode-8", "decode"), interval=STALE_CHECK / 3)
        )
        left: list[str] = []
        started = time.monotonic()

        async def first_leave() -> None:
            async for ev in registry.watch():
                if ev.kind == "leave":
                    left.append(ev.node_id)
                    return

        await asyncio.wait_for(first_leave(), timeout=stale_after(FAST.node_ttl) + 3)
        assert left == ["decode-7"]
        assert time.monotonic() - started >= stale_after(FAST.node_ttl) - 0.5
        assert {"decode-6", "decode-7", "decode-8"} <= set(await registry.nodes())
    finally:
        if beats is not None:
            beats.cancel()
        await bus.close()


async def test_a_registry_entry_gone_between_listing_and_reading_skips_only_itself(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node leaving while the registry is read: its entry is listed, then gone when read
    (NATS answers the read with "deleted"). The read skips it and still returns the others
    (it once gave up on the rest, and a node read after the gone one went missing)."""
    bus = await connect(nats_server, "reader")
    registry = await NodeRegistry(bus, ttl=30).start()
    for name in ("decode-1", "decode-2", "decode-3"):
        await registry.heartbeat(node_info(name, "decode"))
    assert bus.js is not None
    listed = await live_keys(bus.js, NODES_BUCKET)
    assert listed == ["decode.decode-1", "decode.decode-2", "decode.decode-3"]
    await registry.remove("decode", "decode-1")  # first in the listing, gone when read

    async def stale_listing(*_: object) -> list[str]:
        return listed

    monkeypatch.setattr("shared.bus.registry.live_keys", stale_listing)
    assert set(await registry.nodes()) == {"decode-2", "decode-3"}
    await bus.close()


async def test_a_buckets_live_keys_leave_out_deleted_ones_and_come_whole(
    nats_server: NatsServer,
) -> None:
    """The key listing the registry and the journal read: empty for an empty bucket, a
    deleted key left out, and every one of many reads whole (nats-py's own `keys()` could
    end a listing before its first key arrived, and a CI run read an empty registry)."""
    bus = await connect(nats_server, "lister")
    try:
        assert bus.js is not None
        assert await live_keys(bus.js, NODES_BUCKET) == []
        registry = await NodeRegistry(bus, ttl=30).start()
        for name in ("decode-1", "decode-2", "decode-3"):
            await registry.heartbeat(node_info(name, "decode"))
        await registry.remove("decode", "decode-2")
        for _ in range(50):
            assert await live_keys(bus.js, NODES_BUCKET) == ["decode.decode-1", "decode.decode-3"]
        await registry.remove("decode", "decode-1")
        await registry.remove("decode", "decode-3")
        assert await live_keys(bus.js, NODES_BUCKET) == []  # only delete markers left
    finally:
        await bus.close()


async def test_journal_survives_clients(nats_server: NatsServer) -> None:
    bus = await connect(nats_server, "router-1")
    journal = await RequestJournal(bus).start()
    await journal.put(JournalEntry(request_id="r9", state="decoding"))
    await bus.close()
    other = await connect(nats_server, "router-2")
    journal2 = await RequestJournal(other).start()
    entry = await journal2.get("r9")
    assert entry is not None and entry.state == "decoding" and entry.updated_at > 0
    assert [e.request_id for e in await journal2.entries()] == ["r9"]
    await journal2.delete("r9")
    assert await journal2.get("r9") is None
    await other.close()


async def test_clients_reconnect_after_server_restart(nats_server: NatsServer) -> None:
    bus = await connect(nats_server, "svc")
    await submit_job(bus, job("before"))
    nats_server.stop()
    for _ in range(100):
        if not bus.is_connected:
            break
        await asyncio.sleep(0.05)
    assert not bus.is_connected
    await asyncio.to_thread(nats_server.start)
    for _ in range(200):
        if bus.is_connected:
            break
        await asyncio.sleep(0.05)
    assert bus.is_connected
    await submit_job(bus, job("after"))
    assert bus.js is not None
    assert (await bus.js.stream_info(PREFILL_STREAM)).state.messages == 2  # file storage kept
    assert bus.reconnects >= 1
    await bus.close()


async def test_trace_context_travels_in_headers(nats_server: NatsServer) -> None:
    trace.set_tracer_provider(TracerProvider())
    tracer = trace.get_tracer("test")
    bus = await connect(nats_server, "svc")
    assert bus.nc is not None
    got: asyncio.Future[tuple[dict[str, str], bytes]] = asyncio.get_running_loop().create_future()

    async def handler(msg) -> None:  # type: ignore[no-untyped-def]
        if not got.done():
            got.set_result((dict(msg.headers or {}), msg.data))

    await bus.nc.subscribe("tandem.tokens.x", cb=handler)
    with tracer.start_as_current_span("router") as span:
        await bus.publish("tandem.tokens.x", TokenDelta(attempt_id="x", seq=0, token_ids=[5]))
        trace_id = span.get_span_context().trace_id
    headers, data = await asyncio.wait_for(got, 5)
    assert "traceparent" in headers
    remote = trace.get_current_span(extract_context(headers)).get_span_context()
    assert remote.trace_id == trace_id
    assert decode(data, TokenDelta).token_ids == [5]
    await bus.close()


async def test_oversize_body_is_refused_before_it_breaks_the_connection(
    nats_server: NatsServer,
) -> None:
    bus = await connect(nats_server, "svc")
    with pytest.raises(Exception, match="exceed"):
        await bus.publish("x", TokenDelta(attempt_id="x", text="a" * (600 * 1024)))
    await bus.publish("x", TokenDelta(attempt_id="x", text="ok"))  # still connected
    assert bus.is_connected
    await bus.close()


async def test_server_with_credentials_refuses_others_fast() -> None:
    auth = BusAuth.generate()
    with NatsServer(extra_config=auth.server_config()) as server:
        bus = await Bus(server.url, "member", auth).connect()
        assert bus.is_connected
        await bus.close()
        for wrong in (None, BusAuth(user=auth.user, password="not-the-password")):
            started = time.monotonic()
            with pytest.raises(TandemError, match="refused"):
                await Bus(server.url, "stranger", wrong).connect()
            # No reconnect loop: bad credentials do not get better with retries.
            assert time.monotonic() - started < 5.0


def test_user_without_password_is_a_clear_error() -> None:
    with pytest.raises(TandemError, match="go together"):
        BusAuth(user="tandem").connect_kwargs()


async def test_a_cached_registry_view_is_read_again_only_when_it_must_be(
    nats_server: NatsServer,
) -> None:
    """A prefill node's hand-offs read the registry once a second, not once each: again
    when the view is stale, when the wanted node is not in it, or when told to."""
    bus = await connect(nats_server, "cached-view")
    try:
        registry = await NodeRegistry(bus, ttl=30).start()
        await registry.heartbeat(node_info("decode-1", "decode"))
        view = CachedNodes(registry, refresh=60.0)
        assert set(await view.nodes()) == {"decode-1"} and view.reads == 1
        await registry.heartbeat(node_info("decode-2", "decode"))
        assert set(await view.nodes("decode-1")) == {"decode-1"}  # from the last read
        assert view.reads == 1
        assert set(await view.nodes("decode-2")) == {"decode-1", "decode-2"}  # unknown: read
        await registry.heartbeat(node_info("decode-3", "decode"))
        assert "decode-3" in await view.nodes(fresh=True) and view.reads == 3
        view.refresh = 0.0  # stale at once: every call reads
        await registry.heartbeat(node_info("decode-4", "decode"))
        assert "decode-4" in await view.nodes() and view.reads == 4
    finally:
        await bus.close()
