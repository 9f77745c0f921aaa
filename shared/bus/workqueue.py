"""The prefill job queue: JetStream work queue with a durable pull consumer.

Delivery contract: a job is acked only when its work is done (for prefill: the decode node
confirmed receipt of the KV). A worker that dies before acking lets `ack_wait` lapse and
the job goes to another worker; `nak(delay)` asks for a retry later; a malformed job is
`term()`ed (never redelivered) and counted. Jobs are published with `Nats-Msg-Id` = request
id, so a router that retries a publish stores the job once.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared.bus.client import Bus
from shared.bus.ids import handoff_transfer_id
from shared.bus.messages import PrefillJob, decode
from shared.bus.topology import (
    PREFILL_STREAM,
    ensure_job_consumer,
    prefill_consumer,
    prefill_node_consumer,
    prefill_node_subject,
    prefill_subject,
)
from shared.errors import WireFormatError

BACKLOG_TIMEOUT = 0.5  # seconds a consumer's backlog query may take before it counts unknown


async def submit_job(bus: Bus, job: PrefillJob, prefill_node: str = "") -> None:
    """Queue a job once (a retried publish is de-duplicated by the id of the attempt's
    handoff: a failover's job is a new message). With `prefill_node`, only that node's
    consumer takes it (steered to where its prefix lives); otherwise whichever prefill
    node of its model asks first."""
    msg_id = handoff_transfer_id(job.attempt_id, job.handoff)
    subject = prefill_node_subject(prefill_node) if prefill_node else prefill_subject(job.model)
    await bus.js_publish(subject, job, msg_id=msg_id)


async def purge_steered(bus: Bus, node_id: str) -> None:
    """Drop the jobs waiting in a lost node's own queue (their requests fail over; kept,
    a node coming back under that id would compute them for nothing). Best effort."""
    if bus.js is None:
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(
            bus.js.purge_stream(PREFILL_STREAM, subject=prefill_node_subject(node_id)), 5.0
        )


@dataclass
class ReceivedJob:
    job: PrefillJob
    msg: Msg

    @property
    def num_delivered(self) -> int:
        return int(self.msg.metadata.num_delivered)

    @property
    def headers(self) -> dict[str, str]:
        return dict(self.msg.headers or {})

    async def ack(self) -> None:
        await self.msg.ack()

    async def nak(self, delay: float | None = None) -> None:
        await self.msg.nak(delay=delay)

    async def term(self) -> None:
        await self.msg.term()

    async def in_progress(self) -> None:
        """Reset the ack timer for a job that is still being worked on."""
        await self.msg.in_progress()


async def keep_alive(jobs: list[ReceivedJob], interval: float) -> None:
    """Reset the ack timer of jobs being worked on every `interval` s (cancel to stop).

    Lets `ack_wait` be short, so a job held by a node that died is redelivered within
    seconds, while a live node's long prefill or slow hand-off keeps its jobs.
    """
    while True:
        await asyncio.sleep(interval)
        for job in jobs:
            with contextlib.suppress(Exception):  # already acked or terminated: nothing to do
                await job.in_progress()


class JobConsumer:
    """A prefill node's handle on its model's shared durable consumer, or (`node_id`) on
    its own."""

    def __init__(self, bus: Bus, node_id: str = "", model: str = "") -> None:
        self.bus = bus
        self.node_id = node_id
        self.model = model
        self.sub: JetStreamContext.PullSubscription | None = None

    async def start(self) -> JobConsumer:
        assert self.bus.js is not None
        subject, durable = prefill_subject(self.model), prefill_consumer(self.model)
        if self.node_id:
            subject = prefill_node_subject(self.node_id)
            durable = prefill_node_consumer(self.node_id)
        if self.node_id or self.model:  # (ensure_topology makes the one of no model)
            await ensure_job_consumer(self.bus.js, durable, subject)
        self.sub = await self.bus.js.pull_subscribe(subject, durable=durable, stream=PREFILL_STREAM)
        return self

    async def backlog(self, timeout: float = BACKLOG_TIMEOUT) -> int | None:
        """Jobs this consumer has not delivered yet plus those delivered and not yet
        acknowledged (one JetStream API request: no pull, no waiting on an empty queue), or
        None if the server did not answer in time (or the consumer is being made again)."""
        if self.sub is None:
            return None
        try:
            info = await asyncio.wait_for(self.sub.consumer_info(), timeout)
        except (TimeoutError, nats.errors.Error):
            return None
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def stop(self) -> None:
        """Stop pulling; jobs fetched but not acked are redelivered to other workers."""
        if self.sub is not None:
            with contextlib.suppress(Exception):  # already gone with the connection
                await self.sub.unsubscribe()
            self.sub = None

    async def fetch(self, batch: int = 8, timeout: float = 1.0) -> list[ReceivedJob]:
        """Up to `batch` valid jobs (waits at most `timeout`); malformed ones are terminated."""
        if self.sub is None:
            # Not started, or its making again below failed (the stream was not back, or
            # the server did not answer in time): try again now, not never.
            await self.start()
            return []
        try:
            msgs = await self.sub.fetch(batch=batch, timeout=timeout)
        except TimeoutError:  # nats' own TimeoutError, or asyncio's from inside fetch
            return []
        except (nats.js.errors.ServiceUnavailableError, nats.js.errors.NotFoundError):
            # The consumer is gone: a NATS that came back without its store (the node's
            # reconnect made the stream again, not this consumer). Made again here, so
            # jobs flow on instead of waiting out their first-token timeout; if the
            # stream is not back yet, this raises and the next fetch tries again.
            await self.stop()
            await self.start()
            return []
        jobs: list[ReceivedJob] = []
        for msg in msgs:
            try:
                jobs.append(ReceivedJob(decode(msg.data, PrefillJob), msg))
            except WireFormatError as exc:
                self.bus.count_drop(msg.subject, str(exc))
                await msg.term()
        return jobs
