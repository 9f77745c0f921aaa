"""Client side of the kvcache service: put blocks by hash, get the longest stored prefix."""

from __future__ import annotations

import uuid

from shared.bus.client import Bus
from shared.bus.messages import KVGet, KVGetReply, KVPut, decode, encode
from shared.bus.topology import kvcache_subject
from shared.bus.tracing import inject_headers
from shared.errors import TandemError
from shared.transport.base import Transport
from shared.transport.frames import make_header
from shared.transport.pending import PendingTransfers

REQUEST_TIMEOUT = 5.0
TRANSFER_TIMEOUT = 30.0


class KVCacheError(TandemError):
    http_status = 503
    error_type = "kvcache_error"


class KVCacheClient:
    """Needs a transport whose receive handler is `pending` (for gets)."""

    def __init__(self, bus: Bus, transport: Transport, pending: PendingTransfers) -> None:
        self.bus = bus
        self.transport = transport
        self.pending = pending

    async def put(self, node_id: str, address: str, hashes: list[bytes], blocks: bytes) -> None:
        assert self.bus.nc is not None
        if not hashes or len(blocks) % len(hashes):
            raise KVCacheError("blocks must split evenly into one per hash")
        transfer_id = f"put-{uuid.uuid4().hex}"
        announce = KVPut(
            transfer_id=transfer_id, block_hashes=hashes, block_bytes=len(blocks) // len(hashes)
        )
        reply = await self.bus.nc.request(
            kvcache_subject(node_id, "put"),
            encode(announce),
            timeout=REQUEST_TIMEOUT,
            headers=inject_headers(),
        )
        if reply.data != b"ok":
            raise KVCacheError(
                f"kvcache {node_id} refused put: {reply.data.decode(errors='replace')}"
            )
        payload = memoryview(blocks)
        header = make_header("kvcache-put", transfer_id, payload, chunk_bytes=announce.block_bytes)
        await self.transport.send(address, header, payload, timeout=TRANSFER_TIMEOUT)

    async def get(self, node_id: str, hashes: list[bytes], max_bytes: int) -> list[bytes]:
        """The stored blocks of the longest stored prefix of `hashes` (possibly none)."""
        assert self.bus.nc is not None
        transfer_id = f"get-{uuid.uuid4().hex}"
        arrived = self.pending.expect(transfer_id, max_bytes, TRANSFER_TIMEOUT)
        try:
            ask = KVGet(
                transfer_id=transfer_id, block_hashes=hashes, reply_address=self.transport.address
            )
            raw = await self.bus.nc.request(
                kvcache_subject(node_id, "get"),
                encode(ask),
                timeout=REQUEST_TIMEOUT,
                headers=inject_headers(),
            )
            reply = decode(raw.data, KVGetReply)
            if reply.error:
                raise KVCacheError(f"kvcache {node_id}: {reply.error}")
            if reply.hits == 0:
                return []
            data = await arrived
        finally:
            self.pending.forget(transfer_id)
        size = reply.block_bytes
        return [data[i * size : (i + 1) * size] for i in range(reply.hits)]
