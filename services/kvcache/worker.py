"""A kvcache node: stores blocks sent to it and serves the longest stored prefix on request.

put: a KVPut request announces a transfer and its block hashes; the blocks then arrive over
the data plane and are stored one by one. get: a KVGet request names hashes and where to
send them; the node answers how many leading blocks it has and sends them as one transfer.
Every store and eviction is published as a KV event, so routers know what lives here.
put_tails/get_tail do the same for running requests' partial last blocks, kept apart
(`services.kvcache.tails`); a put of tails says at once which pieces it cannot use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from services.kvcache.peers import NOT_A_PEER, Peers
from services.kvcache.pins import CheckpointPins
from services.kvcache.prefault import keep_faulted_in
from services.kvcache.store import DISK, MEMORY, BlockSizeError, BlockStore
from services.kvcache.tails import TailStore
from services.kvcache.warm import WarmSender
from shared.buffers import uninitialised
from shared.bus.client import Bus
from shared.bus.kv_events import KVEventPublisher
from shared.bus.messages import (
    KVGet,
    KVGetReply,
    KVGetTail,
    KVPin,
    KVPurge,
    KVPurgeReply,
    KVPut,
    KVPutTails,
    KVPutTailsReply,
    KVTailReply,
    KVUnpin,
    M,
    NodeInfo,
    accepted,
    decode,
    encode,
    refused,
)
from shared.bus.registry import node_info
from shared.bus.topology import kvcache_subject
from shared.bus.tracing import extract_context
from shared.errors import WireFormatError
from shared.tasks import cancel_and_wait
from shared.telemetry.metrics import NodeMetrics
from shared.telemetry.tracing import tracer
from shared.transport.base import TransferError, TransferRejected, Transport
from shared.transport.frames import TransferHeader, make_header, secret_matches

log = logging.getLogger("tandem.kvcache")
TRACER = tracer("kvcache")

PUT_TIMEOUT = 30.0
SEND_TIMEOUT = 30.0
MAX_BLOCKS_PER_REQUEST = 4096
MAX_TAILS_PER_PUT = 1024
MAX_TAIL_TOKENS = 4096  # more than any block size
MAX_TAIL_PUT_BYTES = 64 << 20  # one put's buffer; the tail store's own bound evicts
# Puts announced and not yet arrived: each is a promise of memory, so bounded; an
# announcement expires after PUT_TIMEOUT whether or not its transfer came.
MAX_PENDING_PUTS = 4096
# Gets being sent: each holds a copy of its blocks until the transfer ends. Beyond this a
# get is answered with no hits (the asker recomputes): bounded memory under a get storm.
MAX_SENDING_BYTES = 1 << 30


class KVCacheWorker:
    def __init__(
        self,
        store: BlockStore,
        bus: Bus,
        transport: Transport,
        node_id: str,
        tails: TailStore | None = None,
        peers: Peers | None = None,
    ) -> None:
        """`peers`: the addresses it may send to (peers.py); None sends wherever asked
        (a worker built alone, in tests)."""
        self.store = store
        self.peers = peers
        self.tails = tails if tails is not None else TailStore(64 << 20)
        self.bus = bus
        self.transport = transport
        self.node_id = node_id
        self.events = KVEventPublisher(bus, node_id)
        store.on_evict = self.events.evicted
        self.puts: dict[str, tuple[KVPut | KVPutTails, float]] = {}
        self.failures = 0
        self.lookups = 0
        self._sends: set[asyncio.Task[None]] = set()
        self._sending_bytes = 0  # payload copies held by the sends in `_sends`
        self.pins = CheckpointPins(store)
        self.warm = WarmSender(bus, transport, self.may_send_to)
        self.metrics = _metrics(store, self.tails, lambda: self.lookups)
        self._prefault: asyncio.Task[None] | None = None

    async def subscribe(self) -> None:
        assert self.bus.nc is not None
        await self.bus.nc.subscribe(kvcache_subject(self.node_id, "put"), cb=self.on_put)
        await self.bus.nc.subscribe(kvcache_subject(self.node_id, "get"), cb=self.on_get)
        await self.bus.nc.subscribe(
            kvcache_subject(self.node_id, "put_tails"), cb=self.on_put_tails
        )
        await self.bus.nc.subscribe(kvcache_subject(self.node_id, "get_tail"), cb=self.on_get_tail)
        await self.bus.nc.subscribe(kvcache_subject(self.node_id, "pin"), cb=self.on_pin)
        await self.bus.nc.subscribe(kvcache_subject(self.node_id, "unpin"), cb=self.on_unpin)
        await self.bus.nc.subscribe(kvcache_subject(self.node_id, "warm"), cb=self.warm.on_warm)
        # Operators only: no node role may publish here (shared/bus/permissions.py).
        await self.bus.nc.subscribe(kvcache_subject(self.node_id, "purge"), cb=self.on_purge)
        self.events.cleared()  # a fresh store: whatever an earlier run announced is gone
        self.events.start()
        self._prefault = asyncio.create_task(keep_faulted_in(self.store), name="prefault")

    async def close(self) -> None:
        self.warm.close()
        await cancel_and_wait(self._prefault)
        await self.events.close()

    async def on_put(self, msg: Msg) -> None:
        with TRACER.start_as_current_span(
            "kvcache.put", context=extract_context(dict(msg.headers or {}))
        ) as span:
            span.set_attribute("tandem.node_id", self.node_id)
            await self._on_put(msg)

    async def _on_put(self, msg: Msg) -> None:
        put = await self._read(msg, KVPut, refused, self._check_put)
        if put is not None:
            await self._expect_put(msg, put, accepted())

    def _check_put(self, put: KVPut) -> None:
        if not put.block_hashes or put.block_bytes <= 0:
            raise WireFormatError("put needs block hashes and a block size")
        if len(put.block_hashes) > MAX_BLOCKS_PER_REQUEST:
            raise WireFormatError("too many blocks in one put")
        try:  # a new size is a new class (a model of another KV layout), within a bound
            self.store.size_class(put.block_bytes)
        except BlockSizeError as exc:
            raise WireFormatError(str(exc)) from exc

    async def _read(
        self,
        msg: Msg,
        kind: type[M],
        refusal: Callable[[str], bytes],
        check: Callable[[M], None] | None = None,
    ) -> M | None:
        """The request decoded and checked; None once it was refused (answered with
        `refusal(reason)` and counted as a dropped message)."""
        try:
            request = decode(msg.data, kind)
            if check is not None:
                check(request)
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            await msg.respond(refusal(str(exc)))
            return None
        return request

    async def may_send_to(self, address: str, subject: str) -> bool:
        """Whether a get's reply address is a registered node's data plane (else the
        request is counted as dropped: a node identity aiming this node's sends)."""
        if self.peers is None or await self.peers.allows(address):
            return True
        self.bus.count_drop(subject, NOT_A_PEER)  # logged there
        return False

    async def _expect_put(self, msg: Msg, put: KVPut | KVPutTails, reply: bytes) -> None:
        """Accept the announced transfer (until PUT_TIMEOUT) and say so, if there is room."""
        self._expire_puts()
        if len(self.puts) >= MAX_PENDING_PUTS:
            self.bus.count_drop(msg.subject, "too many puts pending")
            refusal = "too many puts pending; try later"
            if isinstance(put, KVPutTails):
                await msg.respond(encode(KVPutTailsReply(error=refusal)))
            else:
                await msg.respond(refused(refusal))
            return
        self.puts.pop(put.transfer_id, None)  # announced again: its deadline restarts
        self.puts[put.transfer_id] = (put, time.monotonic() + PUT_TIMEOUT)
        await msg.respond(reply)

    def _expire_puts(self) -> None:
        """Forget announcements past their deadline: kept in announcement order, so the
        expired ones are at the front."""
        now = time.monotonic()
        while self.puts:
            oldest = next(iter(self.puts))
            if self.puts[oldest][1] > now:
                return
            del self.puts[oldest]

    async def on_get(self, msg: Msg) -> None:
        with TRACER.start_as_current_span(
            "kvcache.get", context=extract_context(dict(msg.headers or {}))
        ) as span:
            span.set_attribute("tandem.node_id", self.node_id)
            await self._on_get(msg, span)

    async def _on_get(self, msg: Msg, span: trace.Span) -> None:
        get = await self._read(msg, KVGet, lambda why: encode(KVGetReply(error=why)), _check_get)
        if get is None:
            return
        if not await self.may_send_to(get.reply_address, msg.subject):
            await msg.respond(encode(KVGetReply(error=NOT_A_PEER)))
            return
        self.lookups += 1
        first = get.block_hashes[0] if get.block_hashes else b""
        asked = len(get.block_hashes) * self.store.block_size(first)
        if self._sending_bytes + asked > MAX_SENDING_BYTES:  # busy: the asker recomputes
            self.bus.count_drop(msg.subject, "too many bytes being sent")
            await msg.respond(encode(KVGetReply(hits=0, block_bytes=0)))
            return
        payload, sums, size = self.store.prefix_payload(get.block_hashes)
        span.set_attribute("tandem.blocks_asked", len(get.block_hashes))
        span.set_attribute("tandem.blocks_hit", len(sums))
        await msg.respond(encode(KVGetReply(hits=len(sums), block_bytes=size)))
        if sums:
            self._start_send(get, payload, sums)

    async def on_put_tails(self, msg: Msg) -> None:
        put = await self._read(
            msg, KVPutTails, lambda why: encode(KVPutTailsReply(error=why)), _check_put_tails
        )
        if put is None:
            return
        # Checked now to tell the sender at once; each piece is checked again on arrival.
        missing = [t.attempt_id for t in put.tails if not self.tails.continues(t)]
        await self._expect_put(msg, put, encode(KVPutTailsReply(missing=missing)))

    async def on_pin(self, msg: Msg) -> None:
        try:
            pin = decode(msg.data, KVPin)
            if len(pin.block_hashes) > MAX_BLOCKS_PER_REQUEST or not 0 < len(pin.attempt_id) <= 128:
                raise WireFormatError("a pin names 1 to 4,096 blocks of one attempt")
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            return
        self.pins.pin(pin.attempt_id, pin.node_id[:128], pin.block_hashes)

    async def on_unpin(self, msg: Msg) -> None:
        try:
            unpin = decode(msg.data, KVUnpin)
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            return
        for attempt_id in unpin.attempt_ids[:MAX_BLOCKS_PER_REQUEST]:
            self.pins.unpin(attempt_id, unpin.node_id[:128], unpin.over)

    async def on_purge(self, msg: Msg) -> None:
        purge = await self._read(msg, KVPurge, lambda why: encode(KVPurgeReply(error=why)))
        if purge is None:
            return
        if not purge.producer:
            await msg.respond(encode(KVPurgeReply(error="name the producer to purge")))
            return
        gone = self.store.purge(purge.producer)
        self.events.evicted(gone)  # routers stop sending prefixes here for them
        log.warning("purged %d blocks stored by %s", len(gone), purge.producer[:128])
        await msg.respond(encode(KVPurgeReply(removed=len(gone))))

    async def on_get_tail(self, msg: Msg) -> None:
        get = await self._read(msg, KVGetTail, lambda why: encode(KVTailReply(error=why)))
        if get is None:
            return
        if not await self.may_send_to(get.reply_address, msg.subject):
            await msg.respond(encode(KVTailReply(error=NOT_A_PEER)))
            return
        found = self.tails.get(get.attempt_id)
        if found is None:
            await msg.respond(encode(KVTailReply()))
            return
        tail, data = found
        await msg.respond(encode(KVTailReply(tail=tail, nbytes=len(data))))
        self._start_send(get, memoryview(data), None)

    def _start_send(
        self, get: KVGet | KVGetTail, payload: memoryview, sums: list[int] | None
    ) -> None:
        """Send `payload` where `get` asks, in the background (the get is answered first)."""
        ctx = otel_context.get_current()
        task = asyncio.create_task(self._send(get, payload, sums, ctx))
        self._sends.add(task)
        self._sending_bytes += len(payload)

        def done(task: asyncio.Task[None], size: int = len(payload)) -> None:
            self._sends.discard(task)
            self._sending_bytes -= size

        task.add_done_callback(done)

    async def _send(
        self,
        get: KVGet | KVGetTail,
        payload: memoryview,
        sums: list[int] | None,
        ctx: otel_context.Context,
    ) -> None:
        transfer_id, address = get.transfer_id, get.reply_address
        with TRACER.start_as_current_span(
            "kv.transfer.send",
            context=ctx,
            attributes={"tandem.node_id": self.node_id, "tandem.bytes": len(payload)},
        ) as span:
            header = make_header(
                "kvcache-get",
                transfer_id,
                payload,
                chunk_bytes=len(payload) // len(sums) if sums else len(payload),
                known_checksums=sums,  # the stored blocks' own, verified on read
                secret=get.transfer_secret,
            )
            try:
                await self.transport.send(address, header, payload, timeout=SEND_TIMEOUT)
            except TransferError as exc:
                self.failures += 1
                span.set_status(Status(StatusCode.ERROR, exc.message))
                log.warning("get %s to %s failed: %s", transfer_id, address, exc)

    # ---- ReceiveHandler (puts) ------------------------------------------------------------

    def allocate(self, header: TransferHeader) -> memoryview:
        entry = self.puts.get(header.transfer_id)
        if entry is None or time.monotonic() > entry[1]:
            self.puts.pop(header.transfer_id, None)
            raise TransferRejected("put was not announced", transfer_id=header.transfer_id)
        put = entry[0]
        if not secret_matches(put.transfer_secret, header):
            raise TransferRejected("wrong transfer secret", transfer_id=header.transfer_id)
        if isinstance(put, KVPutTails):
            nbytes = tails_bytes(put)
        else:
            nbytes = len(put.block_hashes) * put.block_bytes
        if header.nbytes != nbytes:
            raise TransferRejected("put size does not match its announcement")
        return uninitialised(header.nbytes)

    async def complete(self, header: TransferHeader, payload: memoryview) -> None:
        put, _ = self.puts.pop(header.transfer_id)
        if isinstance(put, KVPutTails):
            at = 0
            for tail in put.tails:
                end = at + (len(tail.token_ids) - tail.first) * put.row_bytes
                self.tails.put(tail, payload[at:end])
                at = end
            return
        stored = []
        try:
            for i, block_hash in enumerate(put.block_hashes):
                start = i * put.block_bytes
                block = payload[start : start + put.block_bytes]
                if self.store.put(block_hash, block, put.producer):
                    stored.append(block_hash)
        except BlockSizeError as exc:  # (its class was made when the put was announced)
            log.warning("put %s refused: %s", header.transfer_id, exc)
        self.events.stored(stored)

    def failed(self, header: TransferHeader | None, reason: str) -> None:
        self.failures += 1
        self.metrics.errors.labels("transfer_" + reason.split(":")[0]).inc()
        log.warning("transfer %s failed: %s", header.transfer_id if header else "?", reason)

    def info(self) -> NodeInfo:
        self.tails.expire()  # called every heartbeat: stale tails go within a lease
        self.pins.expire()
        return node_info(
            self.node_id,
            "kvcache",
            data_address=self.transport.address,
            load=len(self.store),
        )


def _check_get(get: KVGet) -> None:
    if len(get.block_hashes) > MAX_BLOCKS_PER_REQUEST:
        raise WireFormatError("too many blocks in one get")
    # A prefix's chained hashes never repeat: a get naming one block many times would
    # have it copied (and sent) as often.
    if len(set(get.block_hashes)) != len(get.block_hashes):
        raise WireFormatError("a get names the same block twice")


def _check_put_tails(put: KVPutTails) -> None:
    if not put.tails or put.row_bytes <= 0:
        raise WireFormatError("put_tails needs tails and a row size")
    if len(put.tails) > MAX_TAILS_PER_PUT:
        raise WireFormatError("too many tails in one put")
    if any(not 0 <= t.first < len(t.token_ids) <= MAX_TAIL_TOKENS for t in put.tails):
        raise WireFormatError("a tail's rows are out of range")
    if tails_bytes(put) > MAX_TAIL_PUT_BYTES:
        raise WireFormatError("too many tail bytes in one put")


def tails_bytes(put: KVPutTails) -> int:
    """The size of the transfer a put of tails announces: the rows of each, from its first."""
    return sum(len(t.token_ids) - t.first for t in put.tails) * put.row_bytes


def _metrics(store: BlockStore, tails: TailStore, lookups: Callable[[], int]) -> NodeMetrics:
    """The node's gauges, read from its stores when scraped."""
    m, st = NodeMetrics("kvcache"), store.stats
    m.gauge(
        "tandem_kvcache_memory_bytes",
        "Bytes of blocks in memory",
        lambda: store.used_bytes(MEMORY),
    )
    m.gauge("tandem_kvcache_disk_bytes", "Bytes of blocks on disk", lambda: store.used_bytes(DISK))
    m.gauge("tandem_kvcache_blocks", "Stored blocks", lambda: len(store))
    m.gauge("tandem_kvcache_pinned_blocks", "Blocks pinned (in use)", lambda: len(store.pins))
    m.gauge("tandem_kvcache_lookups", "Prefix lookups served", lookups)
    m.gauge("tandem_kvcache_hit_blocks", "Block lookups that hit", lambda: st.hits)
    m.gauge("tandem_kvcache_miss_blocks", "Block lookups that missed", lambda: st.misses)
    m.gauge("tandem_kvcache_corrupt_blocks", "Blocks dropped on a bad checksum", lambda: st.corrupt)
    m.gauge("tandem_kvcache_evicted_blocks", "Blocks dropped from every tier", lambda: st.evicted)
    m.gauge("tandem_kvcache_spilled_blocks", "Blocks moved from memory to disk", lambda: st.spilled)
    m.gauge(
        "tandem_kvcache_promoted_blocks",
        "Blocks moved from disk to memory",
        lambda: st.promoted,
    )
    m.gauge("tandem_kvcache_rejected_blocks", "Blocks not stored (all pinned)", lambda: st.rejected)
    m.gauge(
        "tandem_kvcache_disk_out_of_space",
        "Disk slabs refused: the file system had no room (the tier acted as full)",
        lambda: sum(disk.out_of_space for _, disk in store.classes.values()),
    )
    m.gauge("tandem_kvcache_tails", "Requests' partial blocks held", lambda: len(tails))
    m.gauge("tandem_kvcache_tail_bytes", "Bytes of partial blocks", lambda: tails.used_bytes)
    m.gauge("tandem_kvcache_tails_served", "Partial blocks sent", lambda: tails.served)
    m.gauge(
        "tandem_kvcache_tails_broken",
        "Partial blocks dropped for a piece not continuing them",
        lambda: tails.broken,
    )
    return m
