"""A decode node: receives KV transfers into its paged pool and runs the continuous batch.

EngineCore calls (import, step, abort) all run on one dedicated thread, in order, so the
engine needs no locks and the event loop stays free for NATS and the data plane while a
step computes. A transfer is accepted only if it was announced by a DecodeAssignment first
(the node reserves room then), within its deadline and of the announced size.

A router may also send a request straight here (`on_prefill`) when this node's pool holds
all but a short tail of its prompt: the node prefills the tail itself, no KV moves. The
pool's stored and evicted blocks go out as KV events for that routing, and blocks this
node fills go to the kvcache service (when an uploader is given).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from nats.aio.msg import Msg
from opentelemetry import context as otel_context

from services.decode.gather import ArrivalWindow
from services.decode.local_prefill import LocalPrefill
from services.decode.presence import Presence
from services.decode.standby import Standby
from services.decode.streams import Streams
from shared.bus.client import Bus
from shared.bus.journal import RequestJournal
from shared.bus.kv_events import KVEventPublisher
from shared.bus.messages import NodeInfo
from shared.bus.registry import NodeRegistry, decode_entry
from shared.bus.topology import (
    PING_STALLED,
    assign_subject,
    cancel_subject,
    local_prefill_subject,
    prefetch_subject,
)
from shared.connector.checkpoints import Checkpointing, CheckpointWriter
from shared.connector.deltas import delta_from_output
from shared.connector.planes import CheckpointSettings, KVPlanes
from shared.connector.pool_events import PoolEvents
from shared.connector.prefix_cache import PrefixCache
from shared.connector.receiver import KVReceiver
from shared.engine.interface import EngineCore
from shared.engine.types import StepOutput
from shared.runtime.cancels import read_cancel
from shared.runtime.engine_thread import EngineThread
from shared.telemetry.metrics import NodeMetrics

if TYPE_CHECKING:
    from shared.runtime.core_share import LentCores

log = logging.getLogger("tandem.decode")
T = TypeVar("T")


class DecodeWorker:
    """Holds the engine (and the one thread it runs on), the streams it runs, and its parts:
    the KV receiver, local prefills, the standby and checkpoints."""

    def __init__(
        self,
        engine: EngineCore,
        bus: Bus,
        node_id: str,
        planes: KVPlanes | None = None,
        registry: NodeRegistry | None = None,
        drain_timeout: float = 30.0,
        lease: float = 5.0,
        prefix: PrefixCache | None = None,
        checkpoints: CheckpointSettings | None = None,
        journal: RequestJournal | None = None,
        thread: EngineThread | None = None,
        stall_timeout: float = 20.0,
    ) -> None:
        self.engine = engine
        self.bus = bus
        self.node_id = node_id
        self.planes = planes  # None: no data plane (tests)
        self.presence = Presence(registry, lease, drain_timeout)
        self.thread = thread or EngineThread()  # the engine was built on it (why: engine_thread)
        # Every engine of this process, this one's included, when it hosts several models
        # (their steps share the thread); empty alone.
        self.siblings: list[EngineCore] = []
        self.host = ""  # the process's first node id when it hosts several models
        self.stall_timeout = stall_timeout
        self.loop = asyncio.get_running_loop()  # built inside the service coroutine
        self.steps = 0
        self.lent: LentCores | None = None  # the host's lent cores (core_share.py), if any
        self.arrivals = ArrivalWindow()  # an idle node admits a wave whole (gather.py)
        self.metrics = NodeMetrics("decode")
        self.streams = Streams(node_id, engine.served_name)
        self.receiver = KVReceiver(
            self,
            engine,
            bus,
            self.metrics,
            node_id,
            planes.transport_name if planes else "",
        )
        self.local = LocalPrefill(self, engine, bus, self.streams, self.metrics, prefix)
        self.standby = Standby(self, engine, bus, prefix)
        uploader, tails = planes.checkpoint_uploaders(checkpoints) if planes else (None, None)
        if uploader is not None and checkpoints is not None:
            engine.exchange.checkpoint_every = checkpoints.every
        records = None
        if uploader is not None and journal is not None:
            records = CheckpointWriter(
                journal, node_id, self.streams.__contains__, uploader.client.pin
            )
        self.checkpoints = Checkpointing(
            engine, self.streams.running_contexts, uploader, tails, records
        )
        # What this node's pool holds goes out as KV events, so routers can send a request
        # whose prefix lives here straight to this node. Collected on the engine thread,
        # published after each step.
        self.pool_events = PoolEvents(engine, KVEventPublisher(bus, node_id))
        self._add_metrics()

    def _add_metrics(self) -> None:
        m, engine = self.metrics, self.engine
        m.gauge("tandem_kv_blocks_used", "KV blocks in use", lambda: engine.pool.num_used)
        m.gauge("tandem_kv_blocks_free", "KV blocks free", lambda: engine.pool.num_free)
        m.gauge("tandem_decode_running_sequences", "Running batch", lambda: engine.num_running)
        m.gauge("tandem_decode_waiting_sequences", "Queued sequences", lambda: engine.num_waiting)
        m.gauge(
            "tandem_standby_prefetched_blocks",
            "KV blocks loaded ahead of a failover, as another stream's standby",
            lambda: self.standby.prefetched_blocks,
        )
        m.gauge(
            "tandem_decode_lent_steps",
            "Steps run on the cores lent by idle prefill nodes beside this one (core_share.py)",
            lambda: self.lent.lent_steps if self.lent is not None else 0,
        )
        self.checkpoints.add_metrics(m)

    @property
    def draining(self) -> bool:
        """Taking no new work: shutting down, or its engine is hung."""
        return self.presence.draining or self.stalled()

    def stalled(self) -> bool:
        """An engine call has run past the stall timeout: the engine hangs (a step takes
        well under a second). The event loop still answers, so the node says so itself."""
        return self.thread.busy_for() > self.stall_timeout

    def health(self) -> str:
        """The answer to a router's probe: 'ok', or why this node's streams should move."""
        if self.stalled():
            return f"{PING_STALLED}: an engine call has run {self.thread.busy_for():.0f}s"
        return "ok"

    async def on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.thread.call(fn, *args)

    def admitted(
        self, request_id: str, token_subject: str, handoff: int, ctx: otel_context.Context
    ) -> None:
        self.streams.start(request_id, token_subject, handoff, ctx)
        self.streams.wake.set()

    def free_blocks(self) -> int:
        return (
            self.engine.pool.num_free - self.receiver.reserved_blocks() - self.local.reserved_blocks
        )

    # ---- control plane ------------------------------------------------------------------

    async def on_cancel(self, msg: Msg) -> None:
        cancel = read_cancel(self.bus, msg, self.node_id)
        if cancel is None:
            return
        rid = cancel.attempt_id
        arriving = self.receiver.drop(rid)
        self.local.cancel(rid, known=arriving or rid in self.streams)
        if rid in self.streams:
            # one aimed at this node: a failover moved it on; a broadcast one: it is over
            self._end_stream(rid, -1, "cancelled", over=not cancel.node_id)
            await self.on_engine(self.engine.abort, rid)
            log.info("cancelled %s: %s", rid, cancel.reason)

    # ---- the batch loop -----------------------------------------------------------------

    async def _publish(self, out: StepOutput) -> None:
        subject = self.streams.subjects.get(out.request_id)
        if subject is None:
            return
        handoff = self.streams.handoffs[out.request_id]  # read before a finish ends the stream
        if out.num_output_tokens == 1:  # prefilled here (routed for its cached prefix)
            self.metrics.prefix_lookup_tokens.inc(out.num_prompt_tokens)
            self.metrics.prefix_hit_tokens.inc(out.num_cached_tokens)
        self.local.resumed_here(out)
        if out.finished:
            self._end_stream(
                out.request_id, out.num_output_tokens, out.finish_reason or "", over=True
            )
        delta = delta_from_output(out, self.node_id, handoff)
        try:
            await self.bus.publish(subject, delta)
        except Exception as exc:  # a lost delta ends as a stalled stream at the router
            log.warning("delta for %s not published: %s", out.request_id, exc)

    async def run(self, stop: asyncio.Event) -> None:
        self.checkpoints.start()
        try:
            await self._run_steps(stop.is_set, stop)
            await self._drain()
        finally:
            await self.checkpoints.close()
            await self.pool_events.publisher.close()

    def _busy(self) -> bool:
        return self.engine.has_unfinished() or bool(self.receiver.expected)

    async def _drain(self) -> None:
        """Stop taking work and finish what runs, for at most the drain timeout; then the
        node leaves the registry and the routers resume whatever still runs on other nodes."""
        self.presence.draining = True
        await self.presence.announce(self.info())
        deadline = time.monotonic() + self.presence.drain_timeout
        if self._busy():
            log.info(
                "draining: %d sequences running, %d arriving; up to %.0fs",
                self.engine.num_running + self.engine.num_waiting,
                len(self.receiver.expected),
                self.presence.drain_timeout,
            )

        def finished() -> bool:
            return not self._busy() or time.monotonic() > deadline

        await self._run_steps(finished, asyncio.Event())
        if self._busy():
            log.warning("drain timed out: the routers resume the rest elsewhere")

    async def _run_steps(self, done: Callable[[], bool], stop: asyncio.Event) -> None:
        while not done():
            await self._check_lease()
            self.receiver.expire()
            if not self.engine.has_unfinished():
                await self._idle(stop)
                self.receiver.expire()
                continue
            if wait := self.arrivals.wait(self.engine.num_running, self.engine.num_waiting):
                await asyncio.sleep(wait)
                continue
            started, chunked = time.perf_counter(), self.engine.stats.chunked_steps
            outs = await self.on_engine(self._step)
            self.metrics.step_seconds.observe(time.perf_counter() - started)
            self.metrics.chunked_steps.inc(self.engine.stats.chunked_steps - chunked)
            self.metrics.batch_size.observe(len(outs))
            self.metrics.tokens.inc(len(outs))
            self.steps += 1
            for out in outs:
                await self._publish(out)

    async def _idle(self, stop: asyncio.Event) -> None:
        """Nothing to step: wait for a stream to start, `stop`, or a second to pass."""
        wake = self.streams.wake
        wake.clear()
        waiter = asyncio.create_task(wake.wait())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, stopper}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        stopper.cancel()

    def _step(self) -> list[StepOutput]:
        """On the engine thread: one step, then copy out the blocks it filled (before reuse)."""
        if self.lent is None:
            outs = self.engine.step()
        else:
            self.lent.before_step()
            try:
                outs = self.engine.step()
            finally:
                self.lent.after_step()
        evicted, named = self.pool_events.take()
        if evicted or named:
            self.loop.call_soon_threadsafe(self.pool_events.publish, evicted, named)
        self.checkpoints.take()
        return outs

    async def _check_lease(self) -> None:
        """Cut off from NATS for longer than the lease: drop every sequence (freeing its
        blocks). The routers declared this node dead and resumed its requests elsewhere."""
        silent = self.presence.out_of_contact()
        if silent is None or not self._busy():
            return
        log.warning(
            "no contact with NATS for %.1fs (lease %.1fs): dropping %d sequences",
            silent,
            self.presence.lease,
            self.engine.num_running + self.engine.num_waiting,
        )
        self.metrics.lease_lost.inc()
        for rid in list(self.streams.subjects):
            self._end_stream(rid, -1, "lease lost", over=False)
        self.receiver.expected.clear()
        await self.on_engine(self.engine.cancel_all)

    def _end_stream(self, request_id: str, tokens: int, reason: str, over: bool) -> None:
        """It left this node; `over`: the request itself ended (else it goes on elsewhere)."""
        self.checkpoints.forget(request_id, over)
        self.streams.end(request_id, tokens, reason, self.steps)

    def info(self) -> NodeInfo:
        return decode_entry(
            self.node_id,
            running=self.engine.num_running,
            waiting=self.engine.num_waiting,
            free_blocks=self.free_blocks(),
            total_blocks=self.engine.pool.num_blocks,
            data_address=self.planes.address if self.planes is not None else "",
            hash_key=self.engine.hash_key,
            block_size=self.engine.block_size,
            engine=self.engine.kind,
            draining=self.draining,
            model=self.engine.served_name,
            host_running=self.host_running(),
            hosted_models=max(1, len(self.siblings)),
            host=self.host,
        )

    def host_running(self) -> int:
        """Sequences this node's process runs or queues for every model it hosts
        (`siblings`, set by a process hosting several: services/decode/main.py); alone, 0
        (the router then counts its own `running`). Queued ones count: a request waiting
        for its local prefill when a heartbeat goes out would otherwise leave its process
        looking idle to the next request of another model."""
        if not self.siblings:
            return 0
        return sum(e.num_running + e.num_waiting for e in self.siblings)

    async def subscribe(self) -> None:
        assert self.bus.nc is not None
        await self.bus.nc.subscribe(assign_subject(self.node_id), cb=self.receiver.on_assign)
        await self.bus.nc.subscribe(cancel_subject(), cb=self.on_cancel)
        await self.bus.nc.subscribe(local_prefill_subject(self.node_id), cb=self.local.on_prefill)
        await self.bus.nc.subscribe(prefetch_subject(self.node_id), cb=self.standby.on_prefetch)
        self.pool_events.publisher.cleared()
        self.pool_events.publisher.start()

    def close(self) -> None:
        self.thread.close()
