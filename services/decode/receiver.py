"""The decode node's data-plane side: which KV transfers it takes, and admitting them.

A transfer is accepted only if a DecodeAssignment announced it first (the node reserved
room then), before the announcement's deadline, of at most the announced size and carrying
the announcement's secret; once its checksums verify, its sequence joins the running batch.
A mixin of DecodeWorker (the attributes below are the worker's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from shared.buffers import uninitialised
from shared.bus.messages import SequenceSnapshot
from shared.bus.tracing import extract_context
from shared.engine.engine import Engine
from shared.errors import TandemError
from shared.telemetry.logs import bind
from shared.telemetry.metrics import NodeMetrics
from shared.telemetry.tracing import tracer
from shared.transport.base import TransferRejected
from shared.transport.frames import TransferHeader, secret_matches

log = logging.getLogger("tandem.decode")
TRACER = tracer("decode")


@dataclass
class Expected:
    snapshot: SequenceSnapshot
    token_subject: str
    deadline: float
    blocks: int
    secret: str


class KVReceiver:
    engine: Engine
    expected: dict[str, Expected]
    receive_started: dict[str, int]
    stream_spans: dict[str, trace.Span]
    subjects: dict[str, str]
    metrics: NodeMetrics
    transport_name: str
    node_id: str
    wake: asyncio.Event
    failures: int
    _run: Callable[..., Any]

    def allocate(self, header: TransferHeader) -> memoryview:
        exp = self.expected.get(header.transfer_id)
        if exp is None:
            raise TransferRejected("transfer was not announced", transfer_id=header.transfer_id)
        if time.time() > exp.deadline:
            self.expected.pop(header.transfer_id, None)
            raise TransferRejected("announcement expired", transfer_id=header.transfer_id)
        if not secret_matches(exp.secret, header):
            raise TransferRejected("wrong transfer secret", transfer_id=header.transfer_id)
        limit = exp.blocks * self.engine.layout.bytes_per_block + 64 * 1024
        if header.nbytes > limit:
            raise TransferRejected("transfer larger than announced", transfer_id=header.transfer_id)
        self.receive_started[header.transfer_id] = time.time_ns()
        return uninitialised(header.nbytes)

    async def complete(self, header: TransferHeader, payload: memoryview) -> None:
        now = time.time_ns()
        started = self.receive_started.pop(header.transfer_id, now)
        ctx = extract_context({"traceparent": header.traceparent} if header.traceparent else None)
        received = TRACER.start_span(
            "kv.transfer.receive",
            context=ctx,
            start_time=started,
            attributes={
                "tandem.bytes": header.nbytes,
                "tandem.blocks": header.num_blocks,
                "tandem.transport": self.transport_name,
                "tandem.gbps": header.nbytes / max(now - started, 1),
                "tandem.node_id": self.node_id,
            },
        )
        received.end(end_time=now)
        self.metrics.transfer_bytes.labels("receive").inc(header.nbytes)
        self.metrics.transfer_seconds.labels("receive").observe((now - started) / 1e9)
        exp = self.expected.pop(header.transfer_id, None)
        if exp is None:
            raise TransferRejected("transfer cancelled", transfer_id=header.transfer_id)
        rid = exp.snapshot.request_id
        bind(request_id=rid)
        with TRACER.start_as_current_span("decode.admission", context=ctx) as admission:
            try:
                await self._run(self.engine.add_snapshot, exp.snapshot, bytes(payload))
            except TandemError as exc:
                admission.set_status(Status(StatusCode.ERROR, exc.message))
                raise TransferRejected(exc.message, request_id=rid) from exc
            admission.set_attribute("tandem.running", self.engine.num_running)
            log.info(
                "admitted: %d KV tokens, %d running",
                exp.snapshot.num_computed,
                self.engine.num_running,
            )
        self.stream_spans[rid] = TRACER.start_span(
            "decode.stream", context=ctx, attributes={"tandem.node_id": self.node_id}
        )
        self.subjects[rid] = exp.token_subject
        self.wake.set()

    def failed(self, header: TransferHeader | None, reason: str) -> None:
        self.failures += 1
        if header is not None:  # a transfer that dies after allocate never reaches complete
            self.receive_started.pop(header.transfer_id, None)
        self.metrics.errors.labels("transfer_" + reason.split(":")[0]).inc()
        log.warning("transfer %s failed: %s", header.transfer_id if header else "?", reason)
