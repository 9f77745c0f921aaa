"""A prefill node's hand-off of a prefilled sequence to a decode node.

Publish the first token as delta 0; ask the chosen decode node to expect the transfer (it
may refuse while full: try the others, with backoff, until the request's deadline); send
the KV over the data plane; ack the job only after the decode node confirmed receipt. A
failed hand-off is nak'ed for a retry (delta 0 is then re-sent and the router drops the
duplicate).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Container

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from shared.bus.client import Bus
from shared.bus.ids import handoff_transfer_id
from shared.bus.messages import DecodeAssignment, NodeInfo, encode, read_reply
from shared.bus.registry import CachedNodes, NodeRegistry
from shared.bus.topology import assign_subject
from shared.bus.tracing import inject_headers
from shared.bus.workqueue import ReceivedJob
from shared.connector.deltas import delta_from_output
from shared.connector.snapshots import to_wire
from shared.engine.interface import EngineCore
from shared.engine.types import SequenceState, StepOutput
from shared.telemetry.logs import bind
from shared.telemetry.metrics import NodeMetrics
from shared.telemetry.tracing import tracer
from shared.transport.base import TransferError, Transport
from shared.transport.frames import make_header, new_secret

log = logging.getLogger("tandem.prefill")
TRACER = tracer("prefill")

ASSIGN_TIMEOUT = 5.0
TRANSFER_TIMEOUT = 30.0
RETRY_DELAY = 0.5
HANDOFF_PATIENCE = 60.0  # seconds to keep retrying full decode nodes before giving up


class HandOff:
    """A prefill worker's part: its prefilled sequences, each to a decode node."""

    def __init__(
        self,
        node_id: str,
        engine: EngineCore,
        bus: Bus,
        transport: Transport,
        registry: NodeRegistry,
        metrics: NodeMetrics,
        cancelled: Container[str],
        stopping: asyncio.Event,
        fail: Callable[[ReceivedJob, str], Awaitable[None]],
    ) -> None:
        self.node_id = node_id
        self.engine = engine  # its KV layout and block count, for the transfer header
        self.bus = bus
        self.transport = transport
        self.registry = registry
        self.decode_nodes = CachedNodes(registry)  # one read serves a second's hand-offs
        self.metrics = metrics
        self.cancelled = cancelled  # request ids the worker heard cancelled
        self.stopping = stopping  # the node's stop: no more retries
        self.fail = fail  # tells the router the request failed

    async def run(
        self,
        job: ReceivedJob,
        out: StepOutput,
        snap: SequenceState | None,
        frame: memoryview | None,
        ctx: otel_context.Context,
    ) -> None:
        bind(request_id=job.job.attempt_id)  # this task's log lines carry the request id
        with TRACER.start_as_current_span("prefill.handoff", context=ctx):
            log.info("prefilled: %d prompt tokens", out.num_prompt_tokens)
            try:
                await self._hand_off(job, out, snap, frame)
            except Exception as exc:  # one request's failure must not stop the node
                log.exception("hand-off failed")
                with contextlib.suppress(Exception):
                    await self.fail(job, f"internal error in prefill hand-off: {exc!r}")
                    await job.term()

    async def _hand_off(
        self,
        job: ReceivedJob,
        out: StepOutput,
        snap: SequenceState | None,
        frame: memoryview | None,
    ) -> None:
        await self._publish_first(job, out)
        if snap is None or frame is None:  # finished on its first token
            await job.ack()
            return
        tried: set[str] = set()
        deadline = min(time.time() + HANDOFF_PATIENCE, job.job.deadline or float("inf"))
        delay = 0.05
        # Decode nodes refuse while full; keep the computed KV and retry them (with backoff)
        # rather than recomputing later, until the request's deadline.
        fresh = False  # the first pass from the last registry read; retries read afresh
        while time.time() < deadline and not self.stopping.is_set():
            for node in await self._decode_candidates(job.job.decode_node, fresh):
                if job.job.attempt_id in self.cancelled:
                    await job.term()
                    return
                tried.add(node.node_id)
                if await self._send_to(node, job, snap, frame):
                    await job.ack()
                    return
            await job.in_progress()  # still ours: do not let ack_wait redeliver it
            fresh = True
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)
        log.warning("no decode node took %s (tried %s)", job.job.attempt_id, sorted(tried))
        if job.num_delivered >= 3:
            await self.fail(job, "no decode node accepted the request")
            await job.term()
        else:
            await job.nak(delay=RETRY_DELAY)

    async def _decode_candidates(self, preferred: str, fresh: bool = False) -> list[NodeInfo]:
        # only nodes that key their blocks as this one does: the same model and dtype
        # (an older node, without a hash key, is taken on trust)
        key = self.engine.hash_key
        nodes = [
            n
            for n in (await self.decode_nodes.nodes(preferred, fresh)).values()
            if n.role == "decode" and not n.draining and n.hash_key in ("", key)
        ]
        nodes.sort(key=lambda n: (n.node_id != preferred, -n.free_kv_blocks))
        return nodes

    async def _send_to(
        self, node: NodeInfo, job: ReceivedJob, snap: SequenceState, frame: memoryview
    ) -> bool:
        with TRACER.start_as_current_span(
            "kv.transfer.send",
            attributes={
                "tandem.decode_node": node.node_id,
                "tandem.transport": self.transport.name,
                "tandem.bytes": len(frame),
            },
        ) as span:
            started = time.perf_counter()
            ok = await self._assign_and_send(node, job, snap, frame)
            elapsed = time.perf_counter() - started
            span.set_attribute("tandem.accepted", ok)
            if ok:
                span.set_attribute("tandem.gbps", len(frame) / max(elapsed, 1e-9) / 1e9)
                self.metrics.transfer_bytes.labels("send").inc(len(frame))
                self.metrics.transfer_seconds.labels("send").observe(elapsed)
            else:
                span.set_status(Status(StatusCode.ERROR, "decode node refused or transfer failed"))
            return ok

    async def _assign_and_send(
        self, node: NodeInfo, job: ReceivedJob, snap: SequenceState, frame: memoryview
    ) -> bool:
        assert self.bus.nc is not None
        rid = job.job.attempt_id
        assignment = DecodeAssignment(
            transfer_id=handoff_transfer_id(rid, job.job.handoff),
            snapshot=to_wire(snap),
            token_subject=job.job.token_subject,
            prefill_node=self.node_id,
            deadline=time.time() + TRANSFER_TIMEOUT,
            transfer_secret=new_secret(),
            handoff=job.job.handoff,
            model=self.engine.served_name,
        )
        try:
            reply = await self.bus.nc.request(
                assign_subject(node.node_id),
                encode(assignment),
                timeout=ASSIGN_TIMEOUT,
                headers=inject_headers(),
            )
        except Exception as exc:
            log.warning("assign %s to %s failed: %s", rid, node.node_id, exc)
            return False
        answer = read_reply(reply.data)
        if not answer.accepted:
            log.info("%s refused %s: %s", node.node_id, rid, answer.reason)
            return False
        payload = frame
        header = make_header(
            rid,
            assignment.transfer_id,
            payload,
            chunk_bytes=self.engine.layout.bytes_per_block,
            num_blocks=self.engine.blocks_for(snap.num_computed),
            traceparent=inject_headers().get("traceparent", ""),
            secret=assignment.transfer_secret,
        )
        trace.get_current_span().set_attribute("tandem.blocks", header.num_blocks)
        try:
            await self.transport.send(node.data_address, header, payload, timeout=TRANSFER_TIMEOUT)
        except TransferError as exc:
            log.warning("KV transfer of %s to %s failed: %s", rid, node.node_id, exc)
            return False
        return True

    async def _publish_first(self, job: ReceivedJob, out: StepOutput) -> None:
        with TRACER.start_as_current_span("prefill.first_token"):
            delta = delta_from_output(out, self.node_id, job.job.handoff)
            await self.bus.publish(job.job.token_subject, delta)
