"""A kvcache node: stores blocks sent to it and serves the longest stored prefix on request.

put: a KVPut request announces a transfer and its block hashes; the blocks then arrive over
the data plane and are stored one by one. get: a KVGet request names hashes and where to
send them; the node answers how many leading blocks it has and sends them as one transfer.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg
from opentelemetry import trace

from services.kvcache.store import BlockStore
from shared.bus.client import Bus
from shared.bus.messages import KVGet, KVGetReply, KVPut, NodeInfo, decode, encode
from shared.bus.registry import node_info
from shared.bus.topology import kvcache_subject
from shared.bus.tracing import extract_context
from shared.errors import WireFormatError
from shared.telemetry.metrics import NodeMetrics
from shared.telemetry.tracing import tracer
from shared.transport.base import TransferError, TransferRejected, Transport
from shared.transport.frames import TransferHeader, make_header

log = logging.getLogger("tandem.kvcache")
TRACER = tracer("kvcache")

PUT_TIMEOUT = 30.0
SEND_TIMEOUT = 30.0
MAX_BLOCKS_PER_REQUEST = 4096


class KVCacheWorker:
    def __init__(self, store: BlockStore, bus: Bus, transport: Transport, node_id: str) -> None:
        self.store = store
        self.bus = bus
        self.transport = transport
        self.node_id = node_id
        self.puts: dict[str, tuple[KVPut, float]] = {}
        self.failures = 0
        self._sends: set[asyncio.Task[None]] = set()
        self.metrics = NodeMetrics("kvcache")
        m = self.metrics
        m.gauge("tandem_kvcache_bytes", "Bytes of stored blocks", lambda: store.used_bytes)
        m.gauge("tandem_kvcache_blocks", "Stored blocks", lambda: len(store.blocks))
        m.gauge("tandem_kvcache_evicted_blocks", "Blocks evicted so far", lambda: store.evictions)
        m.gauge("tandem_kvcache_hit_blocks", "Block lookups that hit", lambda: store.hits)
        m.gauge("tandem_kvcache_miss_blocks", "Block lookups that missed", lambda: store.misses)

    async def subscribe(self) -> None:
        assert self.bus.nc is not None
        await self.bus.nc.subscribe(kvcache_subject(self.node_id, "put"), cb=self.on_put)
        await self.bus.nc.subscribe(kvcache_subject(self.node_id, "get"), cb=self.on_get)

    async def on_put(self, msg: Msg) -> None:
        with TRACER.start_as_current_span(
            "kvcache.put", context=extract_context(dict(msg.headers or {}))
        ) as span:
            span.set_attribute("tandem.node_id", self.node_id)
            await self._on_put(msg)

    async def _on_put(self, msg: Msg) -> None:
        try:
            put = decode(msg.data, KVPut)
            if not put.block_hashes or put.block_bytes <= 0:
                raise WireFormatError("put needs block hashes and a block size")
            if len(put.block_hashes) > MAX_BLOCKS_PER_REQUEST:
                raise WireFormatError("too many blocks in one put")
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            await msg.respond(b"refused: " + str(exc).encode())
            return
        self.puts[put.transfer_id] = (put, time.monotonic() + PUT_TIMEOUT)
        await msg.respond(b"ok")

    async def on_get(self, msg: Msg) -> None:
        with TRACER.start_as_current_span(
            "kvcache.get", context=extract_context(dict(msg.headers or {}))
        ) as span:
            span.set_attribute("tandem.node_id", self.node_id)
            await self._on_get(msg, span)

    async def _on_get(self, msg: Msg, span: trace.Span) -> None:
        try:
            get = decode(msg.data, KVGet)
            if len(get.block_hashes) > MAX_BLOCKS_PER_REQUEST:
                raise WireFormatError("too many blocks in one get")
        except WireFormatError as exc:
            self.bus.count_drop(msg.subject, str(exc))
            await msg.respond(encode(KVGetReply(error=str(exc))))
            return
        blocks = self.store.prefix(get.block_hashes)
        size = len(blocks[0]) if blocks else 0
        span.set_attribute("tandem.blocks_asked", len(get.block_hashes))
        span.set_attribute("tandem.blocks_hit", len(blocks))
        await msg.respond(encode(KVGetReply(hits=len(blocks), block_bytes=size)))
        if blocks:
            task = asyncio.create_task(self._send(get, blocks))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _send(self, get: KVGet, blocks: list[bytes]) -> None:
        payload = memoryview(b"".join(blocks))
        header = make_header("kvcache-get", get.transfer_id, payload, chunk_bytes=len(blocks[0]))
        try:
            await self.transport.send(get.reply_address, header, payload, timeout=SEND_TIMEOUT)
        except TransferError as exc:
            self.failures += 1
            log.warning("get %s to %s failed: %s", get.transfer_id, get.reply_address, exc)

    # ---- ReceiveHandler (puts) ------------------------------------------------------------

    def allocate(self, header: TransferHeader) -> memoryview:
        entry = self.puts.get(header.transfer_id)
        if entry is None or time.monotonic() > entry[1]:
            self.puts.pop(header.transfer_id, None)
            raise TransferRejected("put was not announced", transfer_id=header.transfer_id)
        put = entry[0]
        if header.nbytes != len(put.block_hashes) * put.block_bytes:
            raise TransferRejected("put size does not match its announcement")
        return memoryview(bytearray(header.nbytes))

    async def complete(self, header: TransferHeader, payload: memoryview) -> None:
        put, _ = self.puts.pop(header.transfer_id)
        for i, block_hash in enumerate(put.block_hashes):
            start = i * put.block_bytes
            self.store.put(block_hash, bytes(payload[start : start + put.block_bytes]))

    def failed(self, header: TransferHeader | None, reason: str) -> None:
        self.failures += 1
        log.warning("transfer %s failed: %s", header.transfer_id if header else "?", reason)

    def info(self) -> NodeInfo:
        return node_info(
            self.node_id,
            "kvcache",
            data_address=self.transport.address,
            load=len(self.store.blocks),
        )
