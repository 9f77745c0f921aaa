"""The KV connector's receiving side of a hand-off (a decode node): which KV transfers it
takes, and admitting them into its engine.

A transfer is accepted only if a DecodeAssignment announced it first (the node reserved
room then), before the announcement's deadline, of at most the announced size and carrying
the announcement's secret; once its checksums verify, its sequence joins the engine's
batch and the node is told (`ReceivingNode.admitted`) to stream it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode

from shared.buffers import uninitialised
from shared.bus.client import Bus
from shared.bus.ids import AttemptId
from shared.bus.messages import DecodeAssignment, SequenceSnapshot, accepted, decode, refused
from shared.bus.topology import is_token_subject
from shared.bus.tracing import extract_context
from shared.connector.snapshots import from_wire
from shared.engine.interface import EngineCore
from shared.engine.limits import handoff_refusal
from shared.errors import TandemError, WireFormatError
from shared.telemetry.logs import bind
from shared.telemetry.metrics import NodeMetrics
from shared.telemetry.tracing import tracer
from shared.transport.base import TransferRejected
from shared.transport.frames import TransferHeader, secret_matches

log = logging.getLogger("tandem.decode")
TRACER = tracer("decode")
T = TypeVar("T")


class ReceivingNode(Protocol):
    """The node a receiver admits into, as the receiver sees it."""

    @property
    def draining(self) -> bool: ...

    async def on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on the engine thread (every engine call goes there, in order)."""
        ...

    def admitted(
        self, request_id: str, token_subject: str, handoff: int, ctx: otel_context.Context
    ) -> None:
        """A received sequence joined the batch: stream its tokens from now on."""
        ...


@dataclass
class Expected:
    snapshot: SequenceSnapshot
    token_subject: str
    deadline: float
    blocks: int
    secret: str
    handoff: int = 0


class KVReceiver:
    """A decode node's part: the transfers announced to it, received into its engine."""

    def __init__(
        self,
        node: ReceivingNode,
        engine: EngineCore,
        bus: Bus,
        metrics: NodeMetrics,
        node_id: str,
        transport_name: str,
    ) -> None:
        self.node = node
        self.engine = engine
        self.bus = bus
        self.metrics = metrics
        self.node_id = node_id
        self.transport_name = transport_name
        self.expected: dict[str, Expected] = {}  # transfer id → its announcement
        self.receive_started: dict[str, int] = {}  # transfer id → ns, for the receive span
        self.failures = 0

    def reserved_blocks(self) -> int:
        return sum(e.blocks for e in self.expected.values())

    async def on_assign(self, msg: Msg) -> None:
        if self.node.draining:  # before any validation: a draining node takes nothing
            await msg.respond(refused("draining"))
            return
        try:
            assignment = decode(msg.data, DecodeAssignment)
            snap = assignment.snapshot
            if snap is None:
                raise WireFormatError("assignment without a snapshot")
            if not is_token_subject(assignment.token_subject):
                raise WireFormatError(f"bad token subject {assignment.token_subject[:80]!r}")
            self.engine.validate(snap.attempt_id, snap.prompt_ids, snap.params, snap.output_ids)
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            await msg.respond(refused("malformed assignment"))
            return
        except TandemError as exc:
            await msg.respond(refused(exc.message))
            return
        if not self.engine.serves(assignment.model):
            await msg.respond(refused(f"this node serves {self.engine.served_name!r}"))
            return
        need = self.engine.blocks_for(len(snap.prompt_ids) + snap.params.max_tokens)
        now_blocks = self.engine.blocks_for(snap.num_computed)
        free = self.engine.pool.num_free - self.reserved_blocks()
        refusal = handoff_refusal(
            free, now_blocks, self.engine.num_waiting_midstream, self.engine.num_running
        )
        if refusal is not None:
            await msg.respond(refused(refusal))
            return
        if need > self.engine.pool.num_blocks:
            await msg.respond(refused("request larger than this node's KV pool"))
            return
        self.expected[assignment.transfer_id] = Expected(
            snap,
            assignment.token_subject,
            assignment.deadline or time.time() + 30,
            now_blocks,
            assignment.transfer_secret,
            assignment.handoff,
        )
        await msg.respond(accepted())

    def drop(self, attempt: AttemptId) -> bool:
        """Forget the transfers announced for a cancelled attempt, whatever handoff they
        are (the table is keyed by transfer id: a failover's is not the attempt id);
        False if there were none."""
        gone = [t for t, e in self.expected.items() if e.snapshot.attempt_id == attempt]
        for transfer_id in gone:
            del self.expected[transfer_id]
        return bool(gone)

    def expire(self) -> None:
        """Forget announcements past their deadline (their room is free again)."""
        now = time.time()
        for tid in [t for t, e in self.expected.items() if e.deadline < now]:
            self.expected.pop(tid, None)

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
        rid = exp.snapshot.attempt_id
        bind(request_id=rid)
        with TRACER.start_as_current_span("decode.admission", context=ctx) as admission:
            try:
                # the received buffer itself: imported into the pool, its one copy
                await self.node.on_engine(
                    self.engine.add_snapshot, from_wire(exp.snapshot), payload
                )
            except TandemError as exc:
                admission.set_status(Status(StatusCode.ERROR, exc.message))
                raise TransferRejected(exc.message, request_id=rid) from exc
            admission.set_attribute("tandem.running", self.engine.num_running)
            log.info(
                "admitted: %d KV tokens, %d running",
                exp.snapshot.num_computed,
                self.engine.num_running,
            )
        self.node.admitted(rid, exp.token_subject, exp.handoff, ctx)

    def failed(self, header: TransferHeader | None, reason: str) -> None:
        self.failures += 1
        if header is not None:  # a transfer that dies after allocate never reaches complete
            self.receive_started.pop(header.transfer_id, None)
        self.metrics.errors.labels("transfer_" + reason.split(":")[0]).inc()
        log.warning("transfer %s failed: %s", header.transfer_id if header else "?", reason)
