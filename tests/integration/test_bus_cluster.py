"""The control plane on a real three-server NATS JetStream cluster (as on Kubernetes):
with `replicas=3` every stream and bucket is kept on all three, so losing any one server
loses no prefill job and no journal entry, and clients carry on through another server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from shared.bus.client import Bus
from shared.bus.ids import AttemptId, RequestId
from shared.bus.journal import RequestJournal
from shared.bus.messages import JournalEntry, PrefillJob
from shared.bus.server import NatsServer, free_port
from shared.bus.topology import (
    JOURNAL_BUCKET,
    PREFILL_STREAM,
    TopologyConfig,
    ensure_topology,
)
from shared.bus.workqueue import JobConsumer, submit_job
from shared.errors import TandemError
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

CLUSTERED = TopologyConfig(replicas=3, ack_wait=2.0)


def start_cluster() -> list[NatsServer]:
    """Three servers routed to each other, each on free ports."""
    ports = [free_port() for _ in range(3)]
    routes = ", ".join(f'"nats://127.0.0.1:{p}"' for p in ports)
    servers = [
        NatsServer(
            extra_config=(
                f'server_name: "tandem-{i}"\n'
                f'cluster {{ name: "tandem", listen: "127.0.0.1:{ports[i]}",'
                f" routes: [{routes}] }}\n"
            )
        )
        for i in range(3)
    ]
    try:
        for server in servers:
            server.start()
    except BaseException:
        for server in servers:
            server.cleanup()
        raise
    return servers


@pytest.fixture
def cluster() -> Iterator[list[NatsServer]]:
    # The route ports are picked free, released, and bound again by the servers: another
    # process (or a server's own client port) can take one in between. Pick again then.
    for attempt in range(3):
        try:
            servers = start_cluster()
            break
        except TandemError as e:
            if "address already in use" not in str(e) or attempt == 2:
                raise
    try:
        yield servers
    finally:
        for server in servers:
            server.cleanup()


async def topology_when_ready(bus: Bus, cfg: TopologyConfig, timeout: float = 30.0) -> None:
    """The cluster elects its JetStream leader a few seconds after the servers listen."""
    assert bus.js is not None
    deadline = time.monotonic() + timeout
    while True:
        try:
            await ensure_topology(bus.js, cfg)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def job(n: int) -> PrefillJob:
    return PrefillJob(
        attempt_id=AttemptId(f"r-{n}"), prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=4)
    )


async def test_streams_on_three_servers_survive_the_loss_of_one(
    cluster: list[NatsServer],
) -> None:
    urls = ",".join(s.url for s in cluster)
    router = await Bus(urls, "router").connect()
    await topology_when_ready(router, CLUSTERED)
    assert router.js is not None
    for name in (PREFILL_STREAM, f"KV_{JOURNAL_BUCKET}"):
        info = await router.js.stream_info(name)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2, name
    journal = await RequestJournal(router).start()
    for n in range(20):
        await submit_job(router, job(n))
        await journal.put(JournalEntry(request_id=RequestId(f"r-{n}"), state="decoding"))

    # Lose the server that leads the job stream (the worst one to lose), for good.
    leader = (await router.js.stream_info(PREFILL_STREAM)).cluster
    assert leader is not None and leader.leader is not None
    victim = next(s for i, s in enumerate(cluster) if leader.leader == f"tandem-{i}")
    victim.stop()

    worker = await Bus(urls, "prefill").connect()
    got: set[str] = set()
    deadline = time.monotonic() + 60
    consumer: JobConsumer | None = None
    while len(got) < 20 and time.monotonic() < deadline:
        try:  # a new stream leader is elected within seconds
            consumer = consumer or await JobConsumer(worker).start()
            for received in await consumer.fetch(batch=20, timeout=1.0):
                got.add(str(received.job.attempt_id))
                await received.ack()
        except Exception:
            consumer = None
            await asyncio.sleep(0.5)
    assert got == {f"r-{n}" for n in range(20)}  # every job, none lost
    after = await RequestJournal(worker).start()
    for n in range(20):
        entry = await after.get(f"r-{n}")
        assert entry is not None and entry.state == "decoding"
    # The cluster still takes writes with one server gone (two of three are a quorum).
    await journal.put(JournalEntry(request_id=RequestId("r-new"), state="queued"))
    assert (await after.get("r-new")) is not None
    await worker.close()
    await router.close()


async def test_a_single_server_refuses_three_replicas(nats_server: NatsServer) -> None:
    """Asking one server for replicated streams is a clear error at start-up, not a
    silently unreplicated deployment."""
    bus = await Bus(nats_server.url, "node").connect()
    assert bus.js is not None
    with pytest.raises(Exception, match=r"(?i)replica"):
        await ensure_topology(bus.js, CLUSTERED)
    await bus.close()
