"""The cluster's store is bounded (issue 49: no JetStream quotas), on a real nats-server:
every stream and bucket has a size limit; a full job queue refuses the next job and keeps
the queued ones; a full journal refuses the next entry; the router turns either refusal
into a 503 to retry; and a bucket made before it had a limit gets one."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest
from nats.js.api import DiscardPolicy, KeyValueConfig, StorageType

from services.router.admission import stored
from shared.bus.client import Bus
from shared.bus.ids import AttemptId, RequestId
from shared.bus.journal import RequestJournal
from shared.bus.messages import JournalEntry, PrefillJob
from shared.bus.server import NatsServer
from shared.bus.topology import (
    JOURNAL_BUCKET,
    KV_EVENTS_STREAM,
    NODES_BUCKET,
    PREFILL_STREAM,
    TopologyConfig,
    ensure_topology,
)
from shared.bus.workqueue import submit_job
from shared.errors import CapacityError

pytestmark = pytest.mark.integration

SMALL = TopologyConfig(prefill_max_bytes=64 << 10, journal_max_bytes=64 << 10)
PROMPT = list(range(2000))  # ~4 KB a message


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    b = await Bus(nats_server.url, "store-test").connect()
    yield b
    await b.close()


async def test_every_stream_and_bucket_is_bounded(bus: Bus) -> None:
    assert bus.js is not None
    await ensure_topology(bus.js, TopologyConfig())
    cfg = TopologyConfig()
    for stream, limit in (
        (PREFILL_STREAM, cfg.prefill_max_bytes),
        (KV_EVENTS_STREAM, cfg.kv_events_max_bytes),
        (f"KV_{JOURNAL_BUCKET}", cfg.journal_max_bytes),
        (f"KV_{NODES_BUCKET}", cfg.nodes_max_bytes),
    ):
        assert (await bus.js.stream_info(stream)).config.max_bytes == limit, stream
    info = await bus.js.stream_info(PREFILL_STREAM)
    assert info.config.discard == DiscardPolicy.NEW  # full: refuse, never drop queued jobs


async def test_a_full_queue_and_journal_are_503s_and_lose_nothing(bus: Bus) -> None:
    assert bus.js is not None
    await ensure_topology(bus.js, SMALL)
    queued = 0
    with pytest.raises(CapacityError) as full:
        for i in range(1000):
            job = PrefillJob(attempt_id=AttemptId(f"cmpl-{i}"), prompt_ids=PROMPT)
            await stored("job", submit_job(bus, job))
            queued += 1
    assert full.value.http_status == 503 and 0 < queued < 1000
    info = await bus.js.stream_info(PREFILL_STREAM)
    assert info.state.messages == queued  # every job queued before it filled is still there
    journal = await RequestJournal(bus).start()
    written = 0
    with pytest.raises(CapacityError):
        for i in range(1000):
            entry = JournalEntry(request_id=RequestId(f"cmpl-{i}"), output_ids=PROMPT)
            await stored("request", journal.put(entry))
            written += 1
    assert 0 < written < 1000
    assert await journal.get(RequestId("cmpl-0")) is not None  # the first ones are intact


async def test_a_bucket_made_without_a_limit_gets_one(bus: Bus) -> None:
    assert bus.js is not None
    await bus.js.create_key_value(  # as a deployment of before made it
        KeyValueConfig(bucket=JOURNAL_BUCKET, history=1, storage=StorageType.FILE, ttl=3600.0)
    )
    assert (await bus.js.stream_info(f"KV_{JOURNAL_BUCKET}")).config.max_bytes in (-1, None)
    cfg = dataclasses.replace(TopologyConfig(), journal_ttl=3600.0)
    await ensure_topology(bus.js, cfg)
    info = await bus.js.stream_info(f"KV_{JOURNAL_BUCKET}")
    assert info.config.max_bytes == cfg.journal_max_bytes
