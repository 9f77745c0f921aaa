"""A prefill node: pulls jobs, prefills them in batches, hands the KV to decode nodes.

Jobs come from the node's own queue (steered here by a router: this pool holds their
prefix) and the shared one (intake.py). Per job: drop it if cancelled or past its deadline;
load the longest cached prefix of its prompt from the kvcache service beyond what this
node's own pool holds (`shared/connector/prefix_cache.py`); prefill only the rest (batched
with the jobs that arrived together, in steps: shared/engine/prefill_steps.py) on the
engine thread; as each step ends, hand its sequences to decode nodes (handoff.py), store
their newly computed full blocks in the kvcache service in the background, and announce
what the pool now holds (and evicted) as KV events.

Stopped (SIGTERM: a scale-down), the node drains: its entry says so at once, so routers
steer nothing more to it and, when it was its model's last prefill node, a conditional
router prefills on decode nodes from then on; it serves what is already queued for it (its
own queue, and the shared one when no other prefill node of its model is up: nobody else
would) until fetches have found nothing for DRAIN_QUIET, or no decode node takes KV; its
hand-offs stop retrying DRAIN_TIMEOUT after the stop. Without it, jobs steered to a
stopping node, or queued as the last one left, waited for a node that never came.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Generator

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry.trace import Span, Status, StatusCode
from prometheus_client import Counter

from services.prefill.batch_record import count_batch, start_spans
from services.prefill.handoff import RETRY_DELAY, HandOff
from services.prefill.intake import JobIntake, one_per_request, others_serve
from shared.bus.client import Bus
from shared.bus.kv_events import KVEventPublisher
from shared.bus.messages import NodeInfo, TokenDelta
from shared.bus.registry import NodeRegistry, prefill_entry
from shared.bus.topology import cancel_subject, is_token_subject
from shared.bus.tracing import extract_context
from shared.bus.workqueue import ReceivedJob, keep_alive
from shared.connector.planes import KVPlanes
from shared.connector.pool_events import PoolEvents
from shared.connector.prefix_cache import PrefixCache
from shared.connector.sender import KVSender
from shared.engine.interface import EngineCore
from shared.engine.prefill_steps import Prefilled, PrefillRequest, prefill_steps
from shared.engine.types import SequenceState, StepOutput
from shared.errors import CapacityError, TandemError
from shared.kv.block_hash import BlockHash
from shared.runtime.cancels import RecentCancels, read_cancel
from shared.runtime.core_share import CoreClaim
from shared.runtime.engine import torch_threads
from shared.runtime.engine_thread import EngineThread
from shared.runtime.options import PREFILL_MAX_BATCH
from shared.telemetry.metrics import NodeMetrics

log = logging.getLogger("tandem.prefill")

KEEP_ALIVE_INTERVAL = 2.0  # in_progress for held jobs: well inside the queue's ack_wait
# Stopping: fetching goes on until fetches have found nothing for DRAIN_QUIET (longer than
# the jobs a router queued before its registry watch showed this node draining take to
# arrive, and than a nak's RETRY_DELAY), and hand-offs stop retrying DRAIN_TIMEOUT after
# the stop (within the 60 s grace Kubernetes gives a prefill pod, and the 40 s Docker gives
# a clone by default).
DRAIN_QUIET = 1.0
DRAIN_TIMEOUT = 30.0


class PrefillWorker:
    def __init__(
        self,
        engine: EngineCore,
        bus: Bus,
        planes: KVPlanes,
        registry: NodeRegistry,
        node_id: str,
        max_batch: int = PREFILL_MAX_BATCH,
        thread: EngineThread | None = None,
        idle_threads: int = 0,
        claim: CoreClaim | None = None,
    ) -> None:
        self.engine = engine
        self.prefix = PrefixCache(engine, planes.cache)
        self.bus = bus
        self.planes = planes
        self.registry = registry
        self.node_id = node_id
        self.max_batch = max_batch
        self.thread = thread or EngineThread()  # the engine was built on it (why: engine_thread)
        self.idle_threads = idle_threads  # for a batch of jobs sent `alone` (0: as ever)
        self.claim = claim  # the cores a decode node borrows while this node idles, if any
        self.cancelled = RecentCancels()
        self.queue_depth = 0
        self.draining = False  # stopped: serving only what is already queued for it
        self.leaving = asyncio.Event()  # drained: hand-offs retry no more
        self.metrics = NodeMetrics("prefill")
        self.metrics.gauge(
            "tandem_prefill_queue_depth",
            "Jobs fetched and not yet handed off",
            lambda: self.queue_depth,
        )
        self.metrics.gauge(
            "tandem_kv_blocks_used", "KV blocks in use", lambda: engine.pool.num_used
        )
        self.batches = Counter(
            "tandem_prefill_batches",
            "Batches prefilled, by the torch threads they ran on",
            ["threads"],
            registry=self.metrics.registry,
        )
        # What this node's pool holds goes out as KV events: routers steer a job to the
        # prefill node holding its prefix. Collected on the engine thread, sent from the loop.
        self.pool_events = PoolEvents(engine, KVEventPublisher(bus, node_id))
        self.prefix.add_metrics(self.metrics)

    async def on_cancel(self, msg: Msg) -> None:
        cancel = read_cancel(self.bus, msg, self.node_id)
        if cancel is None:
            return
        self.cancelled.add(cancel.attempt_id)

    def info(self) -> NodeInfo:
        return prefill_entry(
            self.node_id,
            batch=self.queue_depth,
            free_blocks=self.engine.pool.num_free,
            total_blocks=self.engine.pool.num_blocks,
            data_address=self.planes.address,
            hash_key=self.engine.hash_key,
            block_size=self.engine.block_size,
            engine=self.engine.kind,
            model=self.engine.served_name,
            draining=self.draining,
        )

    async def run(self, stop: asyncio.Event) -> None:
        assert self.bus.nc is not None
        await self.bus.nc.subscribe(cancel_subject(), cb=self.on_cancel)
        intake = await JobIntake(self.bus, self.node_id, self.engine.served_name).start()
        handoff = HandOff(
            self.node_id,
            self.engine,
            self.bus,
            KVSender(self.node_id, self.engine, self.bus, self.planes.transport, self.metrics),
            self.registry,
            self.cancelled,
            self.leaving,
            self._fail,
            draining=lambda: self.draining,
        )
        self.prefix.start()
        events = self.pool_events.publisher
        events.cleared()  # a restarted node's pool is empty, whatever it held before
        events.start()
        said = asyncio.create_task(self._say_draining(stop))
        try:
            while not stop.is_set():
                await self._serve(await self._fetch(intake), handoff)
            await self._drain(intake, handoff)
        finally:
            self.leaving.set()
            said.cancel()
            await intake.stop()
            await self.prefix.close()
            await events.close()

    async def _fetch(self, intake: JobIntake, shared: bool = True) -> list[ReceivedJob]:
        try:
            return await intake.fetch(self.max_batch, shared)
        except Exception as exc:  # disconnected: the client reconnects on its own
            log.warning("fetch failed: %r", exc)
            await asyncio.sleep(0.5)
            return []

    async def _serve(self, jobs: list[ReceivedJob], handoff: HandOff) -> None:
        live = []
        for job in jobs:
            if job.job.attempt_id in self.cancelled or not await self._admissible(job):
                await job.term()
            elif job.job.deadline and time.time() > job.job.deadline:
                await self._fail(job, "request expired before prefill")
                await job.term()
            else:
                live.append(job)
        live = await one_per_request(live)
        if live:
            self.queue_depth = len(live)
            alive = asyncio.create_task(keep_alive(live, KEEP_ALIVE_INTERVAL))
            try:
                await self._prefill_batch(live, handoff)
            finally:
                alive.cancel()
                self.queue_depth = 0

    async def _say_draining(self, stop: asyncio.Event) -> None:
        """Once stopped: the entry says so at once (not after the batch in progress), and
        hand-offs give up DRAIN_TIMEOUT later."""
        await stop.wait()
        self.draining = True
        with contextlib.suppress(Exception):  # best effort: the entry expires by TTL anyway
            await asyncio.wait_for(self.registry.heartbeat(self.info()), 1.0)
        await asyncio.sleep(DRAIN_TIMEOUT)
        self.leaving.set()

    async def _drain(self, intake: JobIntake, handoff: HandOff) -> None:
        """Serve what is queued for this node (module docstring), while a decode node
        takes KV (all draining: the stack is going down, and the jobs wait for it)."""
        start = quiet = time.monotonic()
        served = 0
        while not self.leaving.is_set():
            if not await handoff.has_takers():
                log.info("no decode node takes KV: %d jobs served after the stop", served)
                return
            nodes = await handoff.decode_nodes.nodes()  # (a second's view: cached)
            others = others_serve(nodes, self.node_id, self.engine.served_name)
            jobs = await self._fetch(intake, shared=not others)
            now = time.monotonic()
            if jobs:
                served, quiet = served + len(jobs), now
                await self._serve(jobs, handoff)
            elif now - quiet >= DRAIN_QUIET and now - start >= DRAIN_QUIET:
                log.info("drained: %d jobs served after the stop", served)
                return
        log.warning("drain timed out after %.0fs: jobs may still be queued", DRAIN_TIMEOUT)

    async def _prefill_batch(self, jobs: list[ReceivedJob], handoff: HandOff) -> None:
        """Load the jobs' cached prefixes, prefill them step by step on the engine thread
        (shortest first: prefill_steps.py), and as each step ends hand its requests to
        their decode nodes and store their new blocks, while the next step computes."""
        fetched = time.time_ns()
        # keyed as the engine names sequences (str): on a node, the attempt id
        contexts: dict[str, otel_context.Context] = {
            j.job.attempt_id: extract_context(j.headers) for j in jobs
        }
        compute = start_spans(jobs, contexts, fetched, self.node_id, self.engine.served_name)
        prefixes = await asyncio.gather(
            *(
                self.prefix.load(
                    j.job.prompt_ids + j.job.output_ids,
                    contexts[j.job.attempt_id],
                    j.job.params.cache_salt,
                )
                for j in jobs
            )
        )
        # All of a batch's jobs sent while their router served nothing else: the decode
        # node beside this one is idle, so its core may take a share of the prompt. Not
        # when any job is not: a parallel region would wait at each barrier for the thread
        # that shares a stepping decode node's core (docs/benchmarks-log.md).
        threads = self.idle_threads if all(j.job.alone for j in jobs) else 0
        requests: list[PrefillRequest] = [
            (j.job.attempt_id, j.job.prompt_ids, j.job.params) for j in jobs
        ]
        # failovers and resumed streams: the tokens already delivered
        resumed: dict[str, list[int]] = {
            j.job.attempt_id: j.job.output_ids for j in jobs if j.job.output_ids
        }
        steps = prefill_steps(self.engine, requests, resumed)
        by_id: dict[str, ReceivedJob] = {j.job.attempt_id: j for j in jobs}
        left = dict(by_id)  # not prefilled yet
        done: list[Prefilled] = []
        handing: list[asyncio.Future[list[None]]] = []  # each step's hand-offs, under way
        used = 0
        if self.claim is not None:  # the decode node beside this one gives back our core
            await self.claim.acquire()
        try:
            while left:
                try:
                    results, used = await self.thread.call(
                        self._step, [] if handing else prefixes, steps, threads
                    )
                except TandemError as exc:
                    self._publish_kv_events()
                    await self._batch_failed(list(left.values()), compute, exc)
                    break
                self._publish_kv_events()
                for out, _, _ in results:
                    left.pop(out.request_id)
                    span = compute[out.request_id]
                    span.set_attribute("tandem.threads", used)
                    span.set_attribute("tandem.step", len(handing) + 1)
                    span.end()
                done += results
                # this step's first tokens and hand-offs go out while the next one computes
                handing.append(
                    asyncio.gather(
                        *(
                            self._hand_off_and_store(
                                handoff, by_id[out.request_id], out, snap, frame, contexts, compute
                            )
                            for out, snap, frame in results
                        )
                    )
                )
        finally:
            # on the engine thread: whatever is left of the batch (nothing, unless this
            # loop failed between steps) is cancelled there, before the next batch starts
            await self.thread.call(steps.close)
            if self.claim is not None:
                self.claim.release()
        if done:
            self.batches.labels(str(used)).inc()
            count_batch(self.metrics, jobs, by_id, done, fetched)
        await asyncio.gather(*handing)

    def _step(
        self,
        prefixes: list[tuple[list[BlockHash], list[memoryview]]],
        steps: Generator[list[Prefilled], None, None],
        threads: int,
    ) -> tuple[list[Prefilled], int]:
        """On the engine thread: place loaded prefix blocks (before a batch's first step:
        nothing between), then run the batch's next step on `threads` torch threads (0: the
        node's count); returns its prefilled requests and the count they ran on."""
        for hashes, blocks in prefixes:
            if blocks:
                self.engine.exchange.import_cached_blocks(hashes, blocks)
        with torch_threads(threads) as used:
            return next(steps), used

    async def _hand_off_and_store(
        self,
        handoff: HandOff,
        received: ReceivedJob,
        out: StepOutput,
        snap: SequenceState | None,
        frame: memoryview | None,
        contexts: dict[str, otel_context.Context],
        compute: dict[str, Span],
    ) -> None:
        """Hand a prefilled sequence over, then queue its new blocks for kvcache. In this
        order because the store's copies, checksums and sends share the node's core and
        event loop with the hand-off: queued first, they stretched the gap before a
        stream's second token (measured, 240-token prompts: the transfer started 9-14 ms
        after the first token, against 3 ms now). A later prompt finds the blocks a
        hand-off later."""
        await handoff.run(received, out, snap, frame, contexts[out.request_id])
        if frame is not None:
            job = received.job
            request = compute[out.request_id].get_span_context()
            self.prefix.store(
                job.prompt_ids + job.output_ids, out, frame, request, job.params.cache_salt
            )

    async def _batch_failed(
        self, jobs: list[ReceivedJob], compute: dict[str, Span], exc: TandemError
    ) -> None:
        for j in jobs:
            compute[j.job.attempt_id].set_status(Status(StatusCode.ERROR, exc.message))
            compute[j.job.attempt_id].end()
            if isinstance(exc, CapacityError):  # this batch did not fit: retry, maybe
                await j.nak(delay=RETRY_DELAY)  # smaller or on another node
            else:
                await self._fail(j, exc.message)
                await j.term()

    def _publish_kv_events(self) -> None:
        """On the loop, once the engine thread is done with a batch (nothing else of this
        node allocates blocks there meanwhile): what it placed and what it evicted."""
        self.pool_events.publish(*self.pool_events.take())

    async def _admissible(self, job: ReceivedJob) -> bool:
        """Check one job alone, so a bad one never fails the batch it would have joined."""
        if not is_token_subject(job.job.token_subject):
            self.metrics.errors.labels("bad_job").inc()
            log.warning("job %s names no valid token subject: dropped", job.job.attempt_id)
            return False
        if not self.engine.serves(job.job.model):  # steered here wrongly
            await self._fail(
                job, f"this node serves {self.engine.served_name!r}, not {job.job.model!r}"
            )
            return False
        try:
            j = job.job
            self.engine.validate(j.attempt_id, j.prompt_ids, j.params, j.output_ids)
        except TandemError as exc:
            await self._fail(job, exc.message)
            return False
        return True

    async def _fail(self, job: ReceivedJob, reason: str) -> None:
        self.metrics.errors.labels("request_failed").inc()
        if is_token_subject(job.job.token_subject):
            await self.bus.publish(
                job.job.token_subject,
                TokenDelta(
                    attempt_id=job.job.attempt_id,
                    error=reason,
                    node_id=self.node_id,
                    handoff=job.job.handoff,
                ),
            )

    def close(self) -> None:
        self.thread.close()
        if self.claim is not None:
            self.claim.close()
