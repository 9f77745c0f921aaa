"""The KV connector's sending side of a hand-off (a prefill node): announce a prefilled
sequence to a decode node (a DecodeAssignment it may refuse) and send its KV over the data
plane, with the transfer's secret. Which node to try, and the job's fate, are the caller's
(services/prefill/handoff.py)."""

from __future__ import annotations

import logging
import time

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from shared.bus.client import Bus
from shared.bus.ids import handoff_transfer_id
from shared.bus.messages import DecodeAssignment, NodeInfo, PrefillJob, encode, read_reply
from shared.bus.topology import assign_subject
from shared.bus.tracing import inject_headers
from shared.connector.snapshots import to_wire
from shared.engine.interface import EngineCore
from shared.engine.types import SequenceState
from shared.telemetry.metrics import NodeMetrics
from shared.telemetry.tracing import tracer
from shared.transport.base import TransferError, Transport
from shared.transport.frames import make_header, new_secret

log = logging.getLogger("tandem.prefill")
TRACER = tracer("prefill")

ASSIGN_TIMEOUT = 5.0
TRANSFER_TIMEOUT = 30.0


class KVSender:
    """A prefill node's part: prefilled sequences' KV, each to the decode node named."""

    def __init__(
        self,
        node_id: str,
        engine: EngineCore,
        bus: Bus,
        transport: Transport,
        metrics: NodeMetrics,
    ) -> None:
        self.node_id = node_id
        self.engine = engine  # its KV layout and block count, for the transfer header
        self.bus = bus
        self.transport = transport
        self.metrics = metrics

    @property
    def address(self) -> str:
        """Where this node's data plane listens (its registry entry says so)."""
        return self.transport.address

    async def send(
        self, node: NodeInfo, job: PrefillJob, snap: SequenceState, frame: memoryview
    ) -> bool:
        """Announce the transfer to `node` and send `snap`'s KV; False if it refused or the
        transfer failed (the caller may try another node)."""
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
        self, node: NodeInfo, job: PrefillJob, snap: SequenceState, frame: memoryview
    ) -> bool:
        assert self.bus.nc is not None
        rid = job.attempt_id
        assignment = DecodeAssignment(
            transfer_id=handoff_transfer_id(rid, job.handoff),
            snapshot=to_wire(snap),
            token_subject=job.token_subject,
            prefill_node=self.node_id,
            deadline=time.time() + TRANSFER_TIMEOUT,
            transfer_secret=new_secret(),
            handoff=job.handoff,
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
