"""A decode node prefilling a request itself: one a router sent here because this node's pool
holds most of its prompt, or a request resumed here after its node died.

The cached blocks of the context (prompt, plus the tokens generated before a resume)
beyond what this pool holds are loaded from the kvcache service first, so only the tail
after the last stored block is computed, with no prefill node and no KV transfer in the
way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode

from services.decode.local_rules import local_prefill_refusal
from services.decode.streams import DecodeNode, Streams
from shared.bus.client import Bus
from shared.bus.messages import PrefillJob, accepted, decode, refused
from shared.bus.topology import REPLY_BY_HEADER, is_token_subject
from shared.bus.tracing import extract_context
from shared.connector.prefix_cache import PrefixCache
from shared.engine.interface import EngineCore
from shared.engine.types import StepOutput
from shared.errors import InvalidRequestError, TandemError, WireFormatError
from shared.kv.block_hash import BlockHash
from shared.kv.tail import TailBlock
from shared.telemetry.logs import bind
from shared.telemetry.metrics import NodeMetrics
from shared.telemetry.tracing import tracer

log = logging.getLogger("tandem.decode")
TRACER = tracer("decode")
PREFIX_LOAD_TIMEOUT = 5.0
MAX_ADMITTING = 256  # admissions under way at once; more are refused (the router goes on)
UNKNOWN_CANCEL_TTL = 30.0  # seconds a cancel for an unknown request is remembered
MAX_UNKNOWN_CANCELS = 4096


class LocalPrefill:
    """A decode worker's part: requests it prefills itself, and the cancels that concern
    them."""

    def __init__(
        self,
        node: DecodeNode,
        engine: EngineCore,
        bus: Bus,
        streams: Streams,
        metrics: NodeMetrics,
        prefix: PrefixCache | None,
    ) -> None:
        self.node = node
        self.engine = engine
        self.bus = bus
        self.streams = streams
        self.metrics = metrics
        self.prefix = prefix  # loads cached prefixes (and tails) from kvcache
        self.admitting: dict[str, bool] = {}  # being admitted → cancelled meanwhile?
        self.reserved_blocks = 0  # blocks the admissions under way will need
        self.tasks: set[asyncio.Task[None]] = set()
        self.resuming: dict[str, int] = {}  # resumed here, first token pending: context size
        # Cancels for requests this node did not know (yet): a local prefill of one still
        # queued behind others here must not start after its router gave up on it.
        self.unknown_cancels: OrderedDict[str, float] = OrderedDict()

    def cancel(self, request_id: str, known: bool) -> None:
        """A cancel for `request_id`, which this node runs or expects a transfer of if
        `known`: an admission under way drops it once done; an unknown one is remembered."""
        if request_id in self.admitting:
            self.admitting[request_id] = True
        elif not known:
            self._remember_cancel(request_id)

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

    async def on_prefill(self, msg: Msg) -> None:
        """The subscription's callback: each request is admitted in a task of its own.

        nats-py runs a subscription's callbacks one after another, and an admission waits
        for the engine step under way (a prefill may take a second): awaited here, requests
        that arrived together entered the engine one per step, each prompt prefilled alone
        and every stream's first token a step later than the one before (W16: first tokens
        0.3 s apart, ITL p99 ~0.4 s; docs/benchmarks-log.md)."""
        if len(self.tasks) >= MAX_ADMITTING:
            await msg.respond(refused("too many admissions under way"))
            return
        task = asyncio.create_task(self._on_prefill(msg), name="local-prefill")
        self.tasks.add(task)
        task.add_done_callback(self._admitted)

    def _admitted(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("local prefill admission failed", exc_info=task.exception())

    async def _on_prefill(self, msg: Msg) -> None:
        """A router sends a request here to prefill locally: most of its prompt is cached."""
        ctx = extract_context(dict(msg.headers or {}))
        with TRACER.start_as_current_span("decode.local_prefill", context=ctx) as span:
            try:
                job = decode(msg.data, PrefillJob)
                if not is_token_subject(job.token_subject):
                    raise WireFormatError(f"bad token subject {job.token_subject[:80]!r}")
                reply_by = float((msg.headers or {}).get(REPLY_BY_HEADER, "inf"))
            except (WireFormatError, ValueError) as exc:
                self.bus.count_drop(msg.subject, str(exc))
                await msg.respond(refused("malformed job"))
                return
            if not self.engine.serves(job.model):
                await msg.respond(refused(f"this node serves {self.engine.served_name!r}"))
                return
            if job.attempt_id in self.admitting or job.attempt_id in self.streams:
                await msg.respond(refused("already here"))
                return
            if self.cancelled_before(job.attempt_id):  # its cancel overtook it in the queue
                await msg.respond(refused("cancelled"))
                return
            context = job.prompt_ids + job.output_ids  # a resumed request: its output too
            prompt_blocks = self.engine.blocks_for(len(context))
            no = local_prefill_refusal(self.node.free_blocks(), prompt_blocks, self.node.draining)
            if no is not None:
                await msg.respond(refused(no))
                return
            self.admitting[job.attempt_id] = False
            self.reserved_blocks += prompt_blocks  # others admitted meanwhile see it taken
            invalid = False
            try:
                refusal = await self._admit(job, context, reply_by)
            except InvalidRequestError as exc:  # not for this node's engine, whatever its load
                refusal, invalid = exc.message, True
            finally:
                cancelled = self.admitting.pop(job.attempt_id)
                self.reserved_blocks -= prompt_blocks
            if refusal is None and cancelled:  # the router gave up on this path meanwhile
                await self.node.on_engine(self.engine.abort, job.attempt_id)
                refusal = "cancelled"
            if refusal is not None:
                span.set_status(Status(StatusCode.ERROR, refusal))
                await msg.respond(refused(refusal, invalid))
                return
            if job.output_ids:
                self.resuming[job.attempt_id] = len(context)
            rid = job.attempt_id
            bind(request_id=rid)
            self.streams.start(rid, job.token_subject, job.handoff)
            await msg.respond(accepted())
            self.streams.wake.set()

    async def _admit(self, job: PrefillJob, context: list[int], reply_by: float) -> str | None:
        """Queue the request in the engine, its cached prefix placed first; why not if not.
        Only before `reply_by`: after it the router has sent the request another way, and
        admitting it here too would run it twice."""
        patience = reply_by - time.time() - 0.1
        (hashes, blocks), tail = await asyncio.gather(
            load_prefix(self.prefix, context, patience, job.params.cache_salt),
            self._load_tail(job, patience),
        )

        def admit() -> str | None:
            if time.time() > reply_by:
                return "the router stopped waiting"
            if hashes:  # cached, findable: the admission right after finds them
                self.engine.exchange.import_cached_blocks(hashes, blocks)
            salt = job.params.cache_salt
            fitted = self.engine.tails.fit(tail, context, salt) if tail is not None else None
            if tail is not None and fitted is None:
                log.info("the stored KV tail of %s does not fit its context", job.attempt_id)
            self.engine.add_request(
                job.prompt_ids, job.params, job.attempt_id, job.output_ids, fitted
            )
            return None

        try:
            refusal: str | None = await self.node.on_engine(admit)
        except InvalidRequestError:
            raise  # the caller tells the router it is the request, not the node
        except TandemError as exc:
            return exc.message
        return refusal

    async def _load_tail(self, job: PrefillJob, patience: float) -> TailBlock | None:
        """A resumed request's partial last block, from kvcache (best effort, like the
        prefix: without it the tokens after the last full block are recomputed). A new
        request has none."""
        patience = min(PREFIX_LOAD_TIMEOUT, patience)
        if not job.output_ids or self.prefix is None or self.prefix.cache is None or patience <= 0:
            return None
        layout = self.engine.layout
        try:
            return await asyncio.wait_for(
                self.prefix.cache.load_tail(
                    job.attempt_id, layout.bytes_per_slot, layout.block_size - 1
                ),
                patience,
            )
        except Exception as exc:
            log.warning("KV tail load from kvcache failed: %r", exc)
            return None

    def resumed_here(self, out: StepOutput) -> None:
        """A request resumed here sent its first token: count what was recomputed."""
        context = self.resuming.pop(out.request_id, None)
        if context is not None:  # resumed here: how much of its context was recomputed
            self.metrics.resume_recomputed.observe(context - out.num_cached_tokens)
            log.info(
                "resumed %s after %d tokens: %d of %d context tokens recomputed",
                out.request_id, out.num_output_tokens - 1,
                context - out.num_cached_tokens, context,
            )  # fmt: skip


async def load_prefix(
    prefix: PrefixCache | None, context: list[int], patience: float, cache_salt: str
) -> tuple[list[BlockHash], list[memoryview]]:
    """The cached blocks of `context` beyond this pool's, from kvcache (best effort, for at
    most `patience` seconds)."""
    patience = min(PREFIX_LOAD_TIMEOUT, patience)
    if prefix is None or patience <= 0:
        return [], []
    try:
        ctx = otel_context.get_current()
        loading = prefix.load(context, ctx, cache_salt)
        return await asyncio.wait_for(loading, patience)
    except Exception as exc:  # the tail is computed instead
        log.warning("prefix load from kvcache failed: %r", exc)
        return [], []
