"""A decode node: receives KV transfers into its paged pool and runs the continuous batch.

Engine calls (import, step, abort) all run on one dedicated thread, in order, so the
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
import concurrent.futures
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from nats.aio.msg import Msg
from opentelemetry import trace

from services.decode.checkpoints import CheckpointWriter
from services.decode.local_prefill import LocalPrefill
from services.decode.receiver import Expected, KVReceiver
from services.decode.standby import Standby
from shared.bus.client import Bus
from shared.bus.kv_events import KVEventPublisher, PoolEvents
from shared.bus.messages import Cancel, DecodeAssignment, NodeInfo, decode
from shared.bus.registry import node_info
from shared.bus.topology import (
    assign_subject,
    cancel_subject,
    is_token_subject,
    local_prefill_subject,
    prefetch_subject,
)
from shared.deltas import delta_from_output
from shared.engine.block_exchange import CheckpointPoint
from shared.engine.engine import Engine
from shared.engine.outputs import StepOutput
from shared.errors import TandemError, WireFormatError
from shared.kvclient.prefix_cache import PrefixCache
from shared.kvclient.tails import TailUploader
from shared.kvclient.uploader import BlockUploader
from shared.telemetry.metrics import NodeMetrics
from shared.telemetry.tracing import tracer

log = logging.getLogger("tandem.decode")
TRACER = tracer("decode")
UNKNOWN_CANCEL_TTL = 30.0  # seconds a cancel for an unknown request is remembered
MAX_UNKNOWN_CANCELS = 4096


class DecodeWorker(KVReceiver, LocalPrefill, Standby):
    def __init__(
        self,
        engine: Engine,
        bus: Bus,
        node_id: str,
        data_address: str = "",
        transport_name: str = "",
        uploader: BlockUploader | None = None,
        drain_timeout: float = 30.0,
        checkpoints: CheckpointWriter | None = None,
        lease: float = 5.0,
        prefix: PrefixCache | None = None,
        tails: TailUploader | None = None,
    ) -> None:
        self.engine = engine
        self.prefix = prefix  # loads cached prefixes from kvcache for local prefills
        self.resuming: dict[str, int] = {}  # resumed here, first token pending: context size
        self.admitting: dict[str, bool] = {}  # local prefills being admitted → cancelled?
        self.prefetching = 0  # standby prefetches under way
        self.prefetched_blocks = 0
        # Cancels for requests this node did not know (yet): a local prefill of one still
        # queued behind others here must not start after its router gave up on it.
        self.unknown_cancels: OrderedDict[str, float] = OrderedDict()
        self.checkpoints = checkpoints  # records of how far each sequence is stored
        # A node with no round trip to NATS for `lease` seconds (`last_contact`) gives up its
        # sequences: the routers have resumed them elsewhere; their blocks are freed.
        self.lease = lease
        self.last_contact: Callable[[], float] | None = None
        self.drain_timeout = drain_timeout
        self.draining = False
        # Set by the service: publishes a heartbeat now (routers learn of the drain at once).
        self.announce: Callable[[], Awaitable[None]] | None = None
        # Blocks this node fills (generated tokens) go to the kvcache service, so the next
        # turn of a conversation finds its whole history cached.
        self.uploader = uploader
        engine.exchange.collect_filled = uploader is not None
        # And each running sequence's partial last block after every step: a resume
        # elsewhere then recomputes one token, not up to a block.
        self.tails = tails
        engine.tails.collect = tails is not None
        if tails is not None:
            tails.on_lost = engine.tails.resend
        # What this node's pool holds goes out as KV events, so routers can send a request
        # whose prefix lives here straight to this node. Collected on the engine thread,
        # published after each step.
        self.events = KVEventPublisher(bus, node_id)
        self.pool_events = PoolEvents(engine, self.events)
        self.loop = asyncio.get_running_loop()  # built inside the service coroutine
        self.transport_name = transport_name
        self.data_address = data_address
        self.bus = bus
        self.node_id = node_id
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.expected: dict[str, Expected] = {}
        self.subjects: dict[str, str] = {}  # request id → token subject
        self.wake = asyncio.Event()
        self.failures = 0
        self.steps = 0
        self.metrics = NodeMetrics("decode")
        m = self.metrics
        m.gauge("tandem_kv_blocks_used", "KV blocks in use", lambda: engine.pool.num_used)
        m.gauge("tandem_kv_blocks_free", "KV blocks free", lambda: engine.pool.num_free)
        m.gauge("tandem_decode_running_sequences", "Running batch", lambda: engine.num_running)
        m.gauge("tandem_decode_waiting_sequences", "Queued sequences", lambda: engine.num_waiting)
        m.gauge(
            "tandem_standby_prefetched_blocks",
            "KV blocks loaded ahead of a failover, as another stream's standby",
            lambda: self.prefetched_blocks,
        )
        if tails is not None:
            m.gauge("tandem_checkpoint_tails_stored", "Partial blocks stored", lambda: tails.stored)
            m.gauge(
                "tandem_checkpoint_tails_lost",
                "Partial blocks the store could not extend: sent again whole",
                lambda: tails.lost,
            )
        self.receive_started: dict[str, int] = {}  # transfer id → ns, for the receive span
        self.stream_spans: dict[str, trace.Span] = {}

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    # ---- control plane ------------------------------------------------------------------

    def reserved_blocks(self) -> int:
        return sum(e.blocks for e in self.expected.values())

    async def on_assign(self, msg: Msg) -> None:
        if self.draining:  # before any validation: a draining node takes nothing
            await msg.respond(b"refused: draining")
            return
        try:
            assignment = decode(msg.data, DecodeAssignment)
            snap = assignment.snapshot
            if snap is None:
                raise WireFormatError("assignment without a snapshot")
            if not is_token_subject(assignment.token_subject):
                raise WireFormatError(f"bad token subject {assignment.token_subject[:80]!r}")
            self.engine.validate(snap.request_id, snap.prompt_ids, snap.params, snap.output_ids)
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            await msg.respond(b"refused: malformed assignment")
            return
        except TandemError as exc:
            await msg.respond(b"refused: " + exc.message.encode())
            return
        need = self.engine.scheduler.blocks_for(len(snap.prompt_ids) + snap.params.max_tokens)
        now_blocks = self.engine.scheduler.blocks_for(snap.num_computed)
        if self.engine.pool.num_free - self.reserved_blocks() < now_blocks + 1:
            await msg.respond(b"refused: not enough free KV blocks")
            return
        if need > self.engine.pool.num_blocks:
            await msg.respond(b"refused: request larger than this node's KV pool")
            return
        self.expected[assignment.transfer_id] = Expected(
            snap,
            assignment.token_subject,
            assignment.deadline or time.time() + 30,
            now_blocks,
            assignment.transfer_secret,
        )
        await msg.respond(b"ok")

    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = decode(msg.data, Cancel)
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            return
        if cancel.node_id and cancel.node_id != self.node_id:
            return  # meant for one other node (a failover leaving it)
        known = cancel.request_id in self.subjects or cancel.request_id in self.admitting
        if self.expected.pop(cancel.request_id, None) is None and not known:
            self._remember_cancel(cancel.request_id)
        if cancel.request_id in self.admitting:  # on_prefill drops it once admitted
            self.admitting[cancel.request_id] = True
        if cancel.request_id in self.subjects:
            self.subjects.pop(cancel.request_id, None)
            self._end_stream(cancel.request_id, -1, "cancelled")
            await self._run(self.engine.abort, cancel.request_id)
            log.info("cancelled %s: %s", cancel.request_id, cancel.reason)

    def _remember_cancel(self, request_id: str) -> None:
        now = time.monotonic()
        self.unknown_cancels[request_id] = now
        self.unknown_cancels.move_to_end(request_id)
        while self.unknown_cancels and (
            len(self.unknown_cancels) > MAX_UNKNOWN_CANCELS
            or next(iter(self.unknown_cancels.values())) < now - UNKNOWN_CANCEL_TTL
        ):
            self.unknown_cancels.popitem(last=False)

    def cancelled_before(self, request_id: str) -> bool:
        at = self.unknown_cancels.get(request_id)
        return at is not None and time.monotonic() - at < UNKNOWN_CANCEL_TTL

    # ---- the batch loop -----------------------------------------------------------------

    async def _publish(self, out: StepOutput) -> None:
        subject = self.subjects.get(out.request_id)
        if subject is None:
            return
        if out.num_output_tokens == 1:  # prefilled here (routed for its cached prefix)
            self.metrics.prefix_lookup_tokens.inc(out.num_prompt_tokens)
            self.metrics.prefix_hit_tokens.inc(out.num_cached_tokens)
        self.resumed_here(out)
        if out.finished:
            self.subjects.pop(out.request_id, None)
            self._end_stream(out.request_id, out.num_output_tokens, out.finish_reason or "")
        delta = delta_from_output(out, self.node_id)
        try:
            await self.bus.publish(subject, delta)
        except Exception as exc:  # a lost delta ends as a stalled stream at the router
            log.warning("delta for %s not published: %s", out.request_id, exc)

    async def run(self, stop: asyncio.Event) -> None:
        if self.uploader is not None:
            self.uploader.start()
        if self.tails is not None:
            self.tails.start()
        try:
            await self._run_steps(stop.is_set, stop)
            await self._drain()
        finally:
            if self.uploader is not None:
                await self.uploader.drain(2.0)
                await self.uploader.close()
            if self.tails is not None:
                await self.tails.close()
            await self.events.close()

    async def _drain(self) -> None:
        """Stop taking work and finish what runs, for at most `drain_timeout`; then the node
        leaves the registry and the routers resume whatever still runs on other nodes."""
        self.draining = True
        if self.announce is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.announce(), 1.0)
        deadline = time.monotonic() + self.drain_timeout

        def busy() -> bool:
            return self.engine.has_unfinished() or bool(self.expected)

        if busy():
            log.info(
                "draining: %d sequences running, %d arriving; up to %.0fs",
                self.engine.num_running + self.engine.num_waiting,
                len(self.expected),
                self.drain_timeout,
            )
        await self._run_steps(lambda: not busy() or time.monotonic() > deadline, asyncio.Event())
        if busy():
            log.warning("drain timed out: the routers resume the rest elsewhere")

    async def _run_steps(self, done: Callable[[], bool], stop: asyncio.Event) -> None:
        while not done():
            await self._check_lease()
            self._expire()
            if not self.engine.has_unfinished():
                self.wake.clear()
                waiter = asyncio.create_task(self.wake.wait())
                stopper = asyncio.create_task(stop.wait())
                await asyncio.wait(
                    {waiter, stopper}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                )
                waiter.cancel()
                stopper.cancel()
                self._expire()
                continue
            started = time.perf_counter()
            outs = await self._run(self._step)
            self.metrics.step_seconds.observe(time.perf_counter() - started)
            self.metrics.batch_size.observe(len(outs))
            self.metrics.tokens.inc(len(outs))
            self.steps += 1
            for out in outs:
                await self._publish(out)

    def _step(self) -> list[StepOutput]:
        """On the engine thread: one step, then copy out the blocks it filled (before reuse)."""
        outs = self.engine.step()
        evicted, named = self.pool_events.take()
        if evicted or named:
            self.loop.call_soon_threadsafe(self.pool_events.publish, evicted, named)
        if self.uploader is not None:
            hashes, blocks = self.engine.exchange.take_filled_blocks()
            points = self.engine.exchange.take_checkpoint_points()
            if hashes:
                self.loop.call_soon_threadsafe(self._checkpoint, hashes, blocks, points)
        if self.tails is not None:
            tails = self.engine.tails.take()
            if tails:
                self.loop.call_soon_threadsafe(self.tails.submit, tails)
        return outs

    def _checkpoint(
        self, hashes: Sequence[bytes], blocks: list[memoryview], points: list[CheckpointPoint]
    ) -> None:
        """On the event loop (it owns `stream_spans`): hand filled blocks to the uploader,
        linked to the requests running now (those that filled them); once stored, their
        sequences' checkpoint records follow."""
        assert self.uploader is not None
        running = [span.get_span_context() for span in self.stream_spans.values()]
        writer = self.checkpoints
        after = (lambda: writer.stored(points)) if writer is not None and points else None
        self.uploader.submit(hashes, blocks, running, on_stored=after)

    async def _check_lease(self) -> None:
        """Cut off from NATS for longer than the lease: drop every sequence (freeing its
        blocks). The routers declared this node dead and resumed its requests elsewhere."""
        if self.last_contact is None or time.monotonic() - self.last_contact() < self.lease:
            return
        if not (self.engine.has_unfinished() or self.expected):
            return
        log.warning(
            "no contact with NATS for %.1fs (lease %.1fs): dropping %d sequences",
            time.monotonic() - self.last_contact(),
            self.lease,
            self.engine.num_running + self.engine.num_waiting,
        )
        self.metrics.lease_lost.inc()
        for rid in list(self.subjects):
            self._end_stream(rid, -1, "lease lost")
        self.subjects.clear()
        self.expected.clear()
        await self._run(self.engine.cancel_all)

    def _end_stream(self, request_id: str, tokens: int, reason: str) -> None:
        if self.tails is not None:
            self.tails.forget(request_id)
        span = self.stream_spans.pop(request_id, None)
        if span is None:
            return
        if tokens >= 0:
            span.set_attribute("tandem.completion_tokens", tokens)
        span.set_attribute("tandem.finish_reason", reason)
        span.set_attribute("tandem.engine_steps_total", self.steps)
        span.end()

    def _expire(self) -> None:
        now = time.time()
        for tid in [t for t, e in self.expected.items() if e.deadline < now]:
            self.expected.pop(tid, None)

    def info(self) -> NodeInfo:
        return node_info(
            self.node_id,
            "decode",
            data_address=self.data_address,
            load=self.engine.num_running + self.engine.num_waiting,
            running=self.engine.num_running,
            free_kv_blocks=max(0, self.engine.pool.num_free - self.reserved_blocks()),
            total_kv_blocks=self.engine.pool.num_blocks,
            hash_key=self.engine.hash_extra.decode(),
            block_size=self.engine.config.block_size,
            draining=self.draining,
        )

    async def subscribe(self) -> None:
        assert self.bus.nc is not None
        await self.bus.nc.subscribe(assign_subject(self.node_id), cb=self.on_assign)
        await self.bus.nc.subscribe(cancel_subject(), cb=self.on_cancel)
        await self.bus.nc.subscribe(local_prefill_subject(self.node_id), cb=self.on_prefill)
        await self.bus.nc.subscribe(prefetch_subject(self.node_id), cb=self.on_prefetch)
        self.events.cleared()
        self.events.start()

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)
