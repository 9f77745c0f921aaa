"""A prefill node: pulls jobs, prefills them in batches, hands the KV to decode nodes.

Per job: drop it if cancelled or past its deadline; load the longest cached prefix of its
prompt from the kvcache service beyond what this node's own pool holds (prefix.py); prefill
only the rest (batched with the jobs that arrived together) on the engine thread; store the
newly computed full blocks in the kvcache service in the background; publish the first
token as delta 0; ask the chosen decode node to expect the transfer (it may refuse: try the
next decode node); send the KV over the data plane; ack the job only after the decode node
confirmed receipt. A failed hand-off is nak'ed for a retry (delta 0 is then re-sent and the
router drops the duplicate).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from shared.bus.client import Bus
from shared.bus.messages import Cancel, DecodeAssignment, NodeInfo, TokenDelta, decode, encode
from shared.bus.registry import NodeRegistry, node_info
from shared.bus.topology import assign_subject, cancel_subject, is_token_subject
from shared.bus.tracing import extract_context, inject_headers
from shared.bus.workqueue import JobConsumer, ReceivedJob, keep_alive
from shared.deltas import delta_from_output
from shared.engine.engine import Engine, StepOutput
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import SequenceSnapshot
from shared.errors import CapacityError, TandemError, WireFormatError
from shared.kv.block_hash import BlockHash
from shared.kvclient import KVCacheClient
from shared.prefix_cache import PrefixCache
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
KEEP_ALIVE_INTERVAL = 2.0  # in_progress for held jobs: well inside the queue's ack_wait
HANDOFF_PATIENCE = 60.0  # seconds to keep retrying full decode nodes before giving up


class PrefillWorker:
    def __init__(
        self,
        engine: Engine,
        bus: Bus,
        transport: Transport,
        registry: NodeRegistry,
        node_id: str,
        max_batch: int = 8,
        cache: KVCacheClient | None = None,
    ) -> None:
        self.engine = engine
        self.prefix = PrefixCache(engine, cache)
        self.bus = bus
        self.transport = transport
        self.registry = registry
        self.node_id = node_id
        self.max_batch = max_batch
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.cancelled: dict[str, float] = {}  # request id → when (kept a while)
        self.queue_depth = 0
        self.stopping = asyncio.Event()
        self.metrics = NodeMetrics("prefill")
        self.metrics.gauge(
            "tandem_prefill_queue_depth",
            "Jobs fetched and not yet handed off",
            lambda: self.queue_depth,
        )
        self.metrics.gauge(
            "tandem_kv_blocks_used", "KV blocks in use", lambda: engine.pool.num_used
        )
        self._resumed: dict[str, list[int]] = {}  # this batch's failovers: tokens delivered
        self.prefix.add_metrics(self.metrics)

    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = decode(msg.data, Cancel)
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            return
        if cancel.node_id and cancel.node_id != self.node_id:
            return  # meant for one other node (a failover leaving it): the request goes on
        self.cancelled[cancel.request_id] = time.time()
        cutoff = time.time() - 600
        for rid in [r for r, t in self.cancelled.items() if t < cutoff]:
            del self.cancelled[rid]

    def info(self) -> NodeInfo:
        return node_info(
            self.node_id, "prefill", load=self.queue_depth, data_address=self.transport.address
        )

    async def run(self, stop: asyncio.Event) -> None:
        assert self.bus.nc is not None
        await self.bus.nc.subscribe(cancel_subject(), cb=self.on_cancel)
        consumer = await JobConsumer(self.bus).start()
        self.stopping = stop
        self.prefix.start()
        try:
            await self._loop(consumer, stop)
        finally:
            await consumer.stop()
            await self.prefix.close()

    async def _loop(self, consumer: JobConsumer, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                jobs = await consumer.fetch(batch=self.max_batch, timeout=0.5)
            except Exception as exc:  # disconnected: the client reconnects on its own
                log.warning("fetch failed: %r", exc)
                await asyncio.sleep(0.5)
                continue
            live = []
            for job in jobs:
                if job.job.request_id in self.cancelled or not await self._admissible(job):
                    await job.term()
                elif job.job.deadline and time.time() > job.job.deadline:
                    await self._fail(job, "request expired before prefill")
                    await job.term()
                else:
                    live.append(job)
            live = await self._one_per_request(live)
            if live:
                self.queue_depth = len(live)
                alive = asyncio.create_task(keep_alive(live, KEEP_ALIVE_INTERVAL))
                try:
                    await self._prefill_batch(live)
                finally:
                    alive.cancel()
                    self.queue_depth = 0

    async def _prefill_batch(self, jobs: list[ReceivedJob]) -> None:
        requests: list[tuple[str, list[int], SamplingParams]] = []
        for j in jobs:
            requests.append((j.job.request_id, j.job.prompt_ids, j.job.sampling_params()))
        self._resumed = {j.job.request_id: j.job.output_ids for j in jobs if j.job.output_ids}
        loop = asyncio.get_running_loop()
        fetched = time.time_ns()
        contexts = {j.job.request_id: extract_context(j.headers) for j in jobs}
        for j in jobs:  # queue wait: from the job's JetStream timestamp to this fetch
            published = int(j.msg.metadata.timestamp.timestamp() * 1e9)
            wait = TRACER.start_span(
                "prefill.queue_wait",
                context=contexts[j.job.request_id],
                start_time=min(published, fetched),
                attributes={"tandem.node_id": self.node_id, "tandem.attempt": j.num_delivered},
            )
            wait.end(end_time=fetched)
        compute = {
            j.job.request_id: TRACER.start_span(
                "prefill.compute",
                context=contexts[j.job.request_id],
                attributes={
                    "tandem.prompt_tokens": len(j.job.prompt_ids),
                    "tandem.batch_size": len(jobs),
                    "tandem.batch_tokens": sum(len(x.job.prompt_ids) for x in jobs),
                    "tandem.node_id": self.node_id,
                },
            )
            for j in jobs
        }
        prefixes = await asyncio.gather(
            *(
                self.prefix.load(j.job.prompt_ids + j.job.output_ids, contexts[j.job.request_id])
                for j in jobs
            )
        )
        try:
            results = await loop.run_in_executor(
                self.thread, self._import_and_prefill, prefixes, requests
            )
        except TandemError as exc:
            for j in jobs:
                compute[j.job.request_id].set_status(Status(StatusCode.ERROR, exc.message))
                compute[j.job.request_id].end()
                if isinstance(exc, CapacityError):  # this batch did not fit: retry, maybe
                    await j.nak(delay=RETRY_DELAY)  # smaller or on another node
                else:
                    await self._fail(j, exc.message)
                    await j.term()
            return
        for span in compute.values():
            span.end()
        m = self.metrics
        m.step_seconds.observe((time.time_ns() - fetched) / 1e9)
        m.batch_size.observe(len(jobs))
        m.tokens.inc(sum(len(j.job.prompt_ids) for j in jobs))
        m.prefix_lookup_tokens.inc(sum(out.num_prompt_tokens for out, _, _ in results))
        m.prefix_hit_tokens.inc(sum(out.num_cached_tokens for out, _, _ in results))
        by_id = {j.job.request_id: j for j in jobs}
        for out, _, _ in results:
            resumed = by_id[out.request_id].job
            if resumed.output_ids:  # a failover or a resumed stream
                context = len(resumed.prompt_ids) + len(resumed.output_ids)
                recomputed = context - out.num_cached_tokens
                m.resume_recomputed.observe(recomputed)
                log.info(
                    "resumed %s after %d tokens: %d of %d context tokens recomputed",
                    out.request_id, len(resumed.output_ids), recomputed, context,
                )  # fmt: skip
        for out, _, frame in results:
            if frame is not None:
                job = by_id[out.request_id].job
                request = compute[out.request_id].get_span_context()
                self.prefix.store(job.prompt_ids + job.output_ids, out, frame, request)
        await asyncio.gather(
            *(
                self._traced_hand_off(
                    by_id[out.request_id], out, snap, frame, contexts[out.request_id]
                )
                for out, snap, frame in results
            )
        )

    def _import_and_prefill(
        self,
        prefixes: list[tuple[list[BlockHash], list[memoryview]]],
        requests: list[tuple[str, list[int], SamplingParams]],
    ) -> list[tuple[StepOutput, SequenceSnapshot | None, bytes | None]]:
        """On the engine thread: place loaded prefix blocks, then prefill (nothing between)."""
        for hashes, blocks in prefixes:
            if blocks:
                self.engine.import_cached_blocks(hashes, blocks)
        return self.engine.prefill_and_export(requests, self._resumed)

    async def _traced_hand_off(
        self,
        job: ReceivedJob,
        out: StepOutput,
        snap: SequenceSnapshot | None,
        frame: bytes | None,
        ctx: otel_context.Context,
    ) -> None:
        bind(request_id=job.job.request_id)  # this task's log lines carry the request id
        with TRACER.start_as_current_span("prefill.handoff", context=ctx):
            log.info("prefilled: %d prompt tokens", out.num_prompt_tokens)
            try:
                await self._hand_off(job, out, snap, frame)
            except Exception as exc:  # one request's failure must not stop the node
                log.exception("hand-off failed")
                with contextlib.suppress(Exception):
                    await self._fail(job, f"internal error in prefill hand-off: {exc!r}")
                    await job.term()

    async def _hand_off(
        self, job: ReceivedJob, out: StepOutput, snap: SequenceSnapshot | None, frame: bytes | None
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
        while time.time() < deadline and not self.stopping.is_set():
            for node in await self._decode_candidates(job.job.decode_node):
                if job.job.request_id in self.cancelled:
                    await job.term()
                    return
                tried.add(node.node_id)
                if await self._send_to(node, job, snap, frame):
                    await job.ack()
                    return
            await job.in_progress()  # still ours: do not let ack_wait redeliver it
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)
        log.warning("no decode node took %s (tried %s)", job.job.request_id, sorted(tried))
        if job.num_delivered >= 3:
            await self._fail(job, "no decode node accepted the request")
            await job.term()
        else:
            await job.nak(delay=RETRY_DELAY)

    async def _decode_candidates(self, preferred: str) -> list[NodeInfo]:
        nodes = [
            n
            for n in (await self.registry.nodes()).values()
            if n.role == "decode" and not n.draining
        ]
        nodes.sort(key=lambda n: (n.node_id != preferred, -n.free_kv_blocks))
        return nodes

    async def _send_to(
        self, node: NodeInfo, job: ReceivedJob, snap: SequenceSnapshot, frame: bytes
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
        self, node: NodeInfo, job: ReceivedJob, snap: SequenceSnapshot, frame: bytes
    ) -> bool:
        assert self.bus.nc is not None
        rid = job.job.request_id
        assignment = DecodeAssignment(
            transfer_id=job.job.transfer_id or rid,
            snapshot=snap,
            token_subject=job.job.token_subject,
            prefill_node=self.node_id,
            deadline=time.time() + TRANSFER_TIMEOUT,
            transfer_secret=new_secret(),
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
        if reply.data != b"ok":
            log.info("%s refused %s: %s", node.node_id, rid, reply.data.decode(errors="replace"))
            return False
        payload = memoryview(frame)
        header = make_header(
            rid,
            assignment.transfer_id,
            payload,
            chunk_bytes=self.engine.layout.bytes_per_block,
            num_blocks=self.engine.scheduler.blocks_for(snap.num_computed),
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
            await self.bus.publish(job.job.token_subject, delta_from_output(out, self.node_id))

    async def _one_per_request(self, jobs: list[ReceivedJob]) -> list[ReceivedJob]:
        """One job per request id in a batch: a failover resubmits a request (with the
        tokens delivered so far) that may still be queued; the resumed one wins."""
        kept: dict[str, ReceivedJob] = {}
        for job in jobs:
            other = kept.get(job.job.request_id)
            if other is not None:
                if len(job.job.output_ids) < len(other.job.output_ids):
                    job, other = other, job
                await other.term()
            kept[job.job.request_id] = job
        return list(kept.values())

    async def _admissible(self, job: ReceivedJob) -> bool:
        """Check one job alone, so a bad one never fails the batch it would have joined."""
        if not is_token_subject(job.job.token_subject):
            self.metrics.errors.labels("bad_job").inc()
            log.warning("job %s names no valid token subject: dropped", job.job.request_id)
            return False
        try:
            j = job.job
            self.engine.validate(j.request_id, j.prompt_ids, j.sampling_params(), j.output_ids)
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
                    request_id=job.job.request_id,
                    error=reason,
                    node_id=self.node_id,
                    attempt=job.job.transfer_id,
                ),
            )

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)
