"""A prefill node's hand-off of a prefilled sequence to a decode node.

Publish the first token as delta 0; have the KV connector announce and send the KV to the
chosen decode node (shared/connector/sender.py; a full node refuses: try the others, with
backoff, until the request's deadline); ack the job only after the decode node confirmed
receipt. A
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

from services.prefill.handoff_rules import FIRST_DELAY, next_delay, offer_order, takes_kv_of
from shared.bus.client import Bus
from shared.bus.messages import NodeInfo
from shared.bus.registry import CachedNodes, NodeRegistry
from shared.bus.workqueue import ReceivedJob
from shared.connector.deltas import delta_from_output
from shared.connector.sender import KVSender
from shared.engine.interface import EngineCore
from shared.engine.types import SequenceState, StepOutput
from shared.telemetry.logs import bind
from shared.telemetry.tracing import tracer

log = logging.getLogger("tandem.prefill")
TRACER = tracer("prefill")

RETRY_DELAY = 0.5
HANDOFF_PATIENCE = 60.0  # seconds to keep retrying full decode nodes before giving up


class HandOff:
    """A prefill worker's part: its prefilled sequences, each to a decode node."""

    def __init__(
        self,
        node_id: str,
        engine: EngineCore,
        bus: Bus,
        sender: KVSender,
        registry: NodeRegistry,
        cancelled: Container[str],
        stopping: asyncio.Event,
        fail: Callable[[ReceivedJob, str], Awaitable[None]],
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.node_id = node_id
        self.engine = engine  # its hash key: which decode nodes may take its KV
        self.bus = bus
        self.sender = sender  # the KV connector's sending side
        self.registry = registry
        self.decode_nodes = CachedNodes(registry)  # one read serves a second's hand-offs
        self.cancelled = cancelled  # request ids the worker heard cancelled
        self.stopping = stopping  # set once the node's drain is over: no more retries
        self.fail = fail  # tells the router the request failed
        # the node is draining: a job no decode node takes goes back to the queue at once
        # (every decode node draining too: the stack is going down)
        self.draining = draining

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
        delay = FIRST_DELAY
        # Decode nodes refuse while full; keep the computed KV and retry them (with backoff)
        # rather than recomputing later, until the request's deadline.
        fresh = False  # the first pass from the last registry read; retries read afresh
        while time.time() < deadline and not self.stopping.is_set():
            candidates = await self._decode_candidates(job.job.decode_node, fresh)
            if not candidates and self.draining():
                break
            for node in candidates:
                if job.job.attempt_id in self.cancelled:
                    await job.term()
                    return
                tried.add(node.node_id)
                if await self.sender.send(node, job.job, snap, frame):
                    await job.ack()
                    return
            await job.in_progress()  # still ours: do not let ack_wait redeliver it
            fresh = True
            await asyncio.sleep(delay)
            delay = next_delay(delay)
        log.warning("no decode node took %s (tried %s)", job.job.attempt_id, sorted(tried))
        if job.num_delivered >= 3:
            await self.fail(job, "no decode node accepted the request")
            await job.term()
        else:
            await job.nak(delay=RETRY_DELAY)

    async def has_takers(self) -> bool:
        """Whether a decode node takes this node's KV now (by a second's view)."""
        return bool(await self._decode_candidates(""))

    async def _decode_candidates(self, preferred: str, fresh: bool = False) -> list[NodeInfo]:
        key = self.engine.hash_key
        known = (await self.decode_nodes.nodes(preferred, fresh)).values()
        return offer_order(
            (n for n in known if takes_kv_of(n, key)),
            preferred,
            name=lambda n: n.node_id,
            free_blocks=lambda n: n.free_kv_blocks,  # as its last heartbeat said
        )

    async def _publish_first(self, job: ReceivedJob, out: StepOutput) -> None:
        with TRACER.start_as_current_span("prefill.first_token"):
            delta = delta_from_output(out, self.node_id, job.job.handoff)
            await self.bus.publish(job.job.token_subject, delta)
