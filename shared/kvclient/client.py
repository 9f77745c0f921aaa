"""Client side of the kvcache service: put blocks by hash, get the longest stored prefix.

`put`/`get` talk to one named node. `store`/`load_prefix` spread blocks over every live
kvcache node by rendezvous hashing (`shared.kv.sharding`) and are what the prefill and
decode nodes use, and `store_tails`/`load_tail` do the same for running requests' partial
last blocks (on the node that owns the request id). All are best effort by design: the cache
only ever saves work, so a kvcache node that is down or slow makes them return less (logged,
counted, the node skipped for a few seconds), never an error for the request and never a
long wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator, Sequence

from shared.bus.client import Bus
from shared.bus.ids import AttemptId
from shared.bus.messages import (
    KVGet,
    KVGetReply,
    KVGetTail,
    KVPin,
    KVPut,
    KVPutTails,
    KVPutTailsReply,
    KVTail,
    KVTailReply,
    KVUnpin,
    KVWarm,
    Message,
    NodeInfo,
    decode,
    encode,
    read_reply,
)
from shared.bus.registry import CachedNodes, NodeRegistry
from shared.bus.topology import kvcache_subject
from shared.bus.tracing import inject_headers
from shared.errors import TandemError
from shared.kv.block_hash import BlockHash
from shared.kv.sharding import owner, shard
from shared.kv.tail import TailBlock
from shared.transport.base import Transport
from shared.transport.frames import make_header, new_secret
from shared.transport.pending import PendingTransfers

log = logging.getLogger("tandem.kvclient")

REQUEST_TIMEOUT = 2.0
TRANSFER_TIMEOUT = 10.0
NODES_REFRESH = 1.0  # seconds a registry read is reused
DOWN_BACKOFF = 3.0  # seconds a failed kvcache node is skipped
# Seconds an unpin still goes to a kvcache node no longer listed: the pins' lease there
# (services/kvcache/pins.py), past which it has released them itself.
UNPIN_MEMORY = 60.0


class KVCacheError(TandemError):
    http_status = 503
    error_type = "kvcache_error"


class KVCacheClient:
    """Needs a transport whose receive handler is `pending` (for gets)."""

    def __init__(
        self,
        bus: Bus,
        transport: Transport,
        pending: PendingTransfers,
        registry: NodeRegistry | None = None,
    ) -> None:
        self.bus = bus
        self.transport = transport
        self.pending = pending
        self.registry = registry
        # the registry view, read again once a second (or when told to: `nodes(fresh=True)`)
        self.view = CachedNodes(registry, refresh=NODES_REFRESH) if registry is not None else None
        self.failures = 0
        self._nodes: list[NodeInfo] = []
        self._down_until: dict[str, float] = {}
        self._seen: dict[str, float] = {}  # kvcache node → when it was last listed

    # ---- one node ---------------------------------------------------------------------------

    async def put(
        self, node_id: str, address: str, hashes: list[bytes], blocks: bytes | memoryview
    ) -> None:
        if not hashes or len(blocks) % len(hashes):
            raise KVCacheError("blocks must split evenly into one per hash")
        announce = KVPut(
            transfer_id=f"put-{uuid.uuid4().hex}",
            block_hashes=hashes,
            block_bytes=len(blocks) // len(hashes),
            transfer_secret=new_secret(),
            producer=self.bus.name,
        )
        reply = read_reply(await self._ask(node_id, "put", announce))
        if not reply.accepted:
            raise KVCacheError(f"kvcache {node_id} refused put: {reply.reason}")
        await self._send(address, "put", announce, memoryview(blocks), announce.block_bytes)

    async def _send(
        self, address: str, op: str, announce: KVPut | KVPutTails, payload: memoryview, chunk: int
    ) -> None:
        """Send an announced put's bytes as one transfer, checksummed per `chunk` bytes."""
        header = make_header(
            f"kvcache-{op}",
            announce.transfer_id,
            payload,
            chunk_bytes=chunk,
            secret=announce.transfer_secret,
        )
        await self.transport.send(address, header, payload, timeout=TRANSFER_TIMEOUT)

    async def get(self, node_id: str, hashes: list[bytes], max_bytes: int) -> list[memoryview]:
        """The stored blocks of the longest stored prefix of `hashes` (possibly none), as
        views of the one buffer they arrived in."""
        with self._incoming("get", max_bytes) as (transfer_id, secret, arrived):
            ask = KVGet(
                transfer_id=transfer_id,
                block_hashes=hashes,
                reply_address=self.transport.address,
                transfer_secret=secret,
            )
            reply = decode(await self._ask(node_id, "get", ask), KVGetReply)
            if reply.error:
                raise KVCacheError(f"kvcache {node_id}: {reply.error}")
            if reply.hits == 0:
                return []
            data = await asyncio.wait_for(arrived, TRANSFER_TIMEOUT)
        size = reply.block_bytes
        return [data[i * size : (i + 1) * size] for i in range(reply.hits)]  # views: no copy

    async def warm(self, node_id: str, timeout: float = TRANSFER_TIMEOUT) -> None:
        """Have kvcache node `node_id` open (or reuse) the connection its gets to this node
        take, proven by a one-byte transfer (`services/kvcache/warm.py`); raises
        KVCacheError if it refuses, TimeoutError if the byte does not come in time."""
        with self._incoming("warm", 1) as (transfer_id, secret, arrived):
            ask = KVWarm(
                transfer_id=transfer_id,
                reply_address=self.transport.address,
                transfer_secret=secret,
            )
            reply = read_reply(await self._ask(node_id, "warm", ask))
            if not reply.accepted:
                raise KVCacheError(f"kvcache {node_id} refused to warm: {reply.reason}")
            await asyncio.wait_for(arrived, timeout)

    @contextlib.contextmanager
    def _incoming(
        self, kind: str, max_bytes: int
    ) -> Iterator[tuple[str, str, asyncio.Future[memoryview]]]:
        """A transfer id and secret this node accepts one reply transfer for, while inside."""
        transfer_id = f"{kind}-{uuid.uuid4().hex}"
        secret = new_secret()
        arrived = self.pending.expect(transfer_id, max_bytes, TRANSFER_TIMEOUT, secret)
        try:
            yield transfer_id, secret, arrived
        finally:
            self.pending.forget(transfer_id)

    async def _ask(self, node_id: str, op: str, ask: Message) -> bytes:
        assert self.bus.nc is not None
        raw = await self.bus.nc.request(
            kvcache_subject(node_id, op),
            encode(ask),
            timeout=REQUEST_TIMEOUT,
            headers=inject_headers(),
        )
        return bytes(raw.data)

    # ---- sharded over every live kvcache node ----------------------------------------------

    async def nodes(self, fresh: bool = False) -> list[NodeInfo]:
        """Live kvcache nodes (the registry view reused for a second; `fresh`: read now),
        skipping failed ones."""
        now = time.monotonic()
        if self.view is not None:
            try:
                found = await asyncio.wait_for(self.view.nodes(fresh=fresh), REQUEST_TIMEOUT)
                self._nodes = sorted(
                    (n for n in found.values() if n.role == "kvcache"), key=lambda n: n.node_id
                )
                self._seen.update((n.node_id, now) for n in self._nodes)
            except Exception as exc:  # no registry now: keep the last view
                log.warning("kvcache node list unavailable: %s", exc)
        return [n for n in self._nodes if self._down_until.get(n.node_id, 0.0) <= now]

    def _mark_down(self, node: NodeInfo, what: str, exc: BaseException) -> None:
        self.failures += 1
        self._down_until[node.node_id] = time.monotonic() + DOWN_BACKOFF
        log.warning(
            "kvcache %s unavailable for %s (%s); serving without it for %.0fs",
            node.node_id,
            what,
            str(exc) or type(exc).__name__,
            DOWN_BACKOFF,
        )

    async def _shards(self, hashes: Sequence[bytes]) -> list[tuple[NodeInfo, list[int]]]:
        """Each live node with the positions of the `hashes` it owns (none: no nodes)."""
        nodes = {n.node_id: n for n in await self.nodes()}
        if not nodes or not hashes:
            return []
        return [(nodes[n], positions) for n, positions in shard(hashes, list(nodes)).items()]

    async def store(self, hashes: Sequence[bytes], blocks: Sequence[bytes | memoryview]) -> int:
        """Put blocks on their owning nodes; returns how many were handed over."""

        async def put_group(node: NodeInfo, positions: list[int]) -> int:
            try:
                await self.put(
                    node.node_id,
                    node.data_address,
                    [hashes[i] for i in positions],
                    b"".join(blocks[i] for i in positions),
                )
                return len(positions)
            except Exception as exc:
                self._mark_down(node, "put", exc)
                return 0

        done = await asyncio.gather(*(put_group(n, p) for n, p in await self._shards(hashes)))
        return sum(done)

    async def pin(self, attempt_id: AttemptId, hashes: Sequence[bytes]) -> None:
        """Ask each owning node to keep its share of `hashes` for `attempt_id` on this node's
        behalf (no answer awaited: a pin lost only leaves the blocks evictable, as without)."""
        assert self.bus.nc is not None
        for node, positions in await self._shards(hashes):
            pin = KVPin(
                attempt_id=attempt_id,
                node_id=self.bus.name,
                block_hashes=[hashes[i] for i in positions],
            )
            await self.bus.nc.publish(kvcache_subject(node.node_id, "pin"), encode(pin))

    async def unpin(self, attempt_ids: list[AttemptId], over: bool) -> None:
        """Release these sequences' pins on every kvcache node known: this node's, or every
        node's (`over`: the requests ended). From the node list already read when there is
        one (a registry read under load can take seconds), nodes marked down included, and
        every node listed within the pins' lease: a pin must not outlive its request for
        want of a fresh or complete list (a registry read under load skips slow entries)."""
        assert self.bus.nc is not None
        unpin = KVUnpin(attempt_ids=attempt_ids, node_id=self.bus.name, over=over)
        if not self._nodes:
            await self.nodes()
        now = time.monotonic()
        for node_id, at in list(self._seen.items()):
            if now - at > UNPIN_MEMORY:
                del self._seen[node_id]
                continue
            await self.bus.nc.publish(kvcache_subject(node_id, "unpin"), encode(unpin))

    async def load_prefix(self, hashes: Sequence[bytes], block_bytes: int) -> list[memoryview]:
        """The blocks of the longest prefix of `hashes` that the live nodes hold together."""
        shards = await self._shards(hashes)
        if not shards:
            return []

        async def get_group(
            node: NodeInfo, positions: list[int]
        ) -> tuple[list[int], list[memoryview]]:
            try:
                got = await self.get(
                    node.node_id, [hashes[i] for i in positions], len(positions) * block_bytes
                )
            except Exception as exc:
                self._mark_down(node, "get", exc)
                got = []
            if any(len(b) != block_bytes for b in got):  # another model's blocks: unusable
                log.warning("kvcache %s sent blocks of the wrong size", node.node_id)
                got = []
            return positions, got

        found: dict[int, memoryview] = {}
        end = len(hashes)
        for positions, got in await asyncio.gather(*(get_group(n, p) for n, p in shards)):
            found.update(zip(positions, got, strict=False))
            if len(got) < len(positions):  # this node's first miss ends the joint prefix
                end = min(end, positions[len(got)])
        return [found[i] for i in range(end)]

    # ---- requests' partial last blocks (tails), on the node owning the request id ----------

    async def _tail_owner(self, request_id: str) -> NodeInfo | None:
        nodes = {n.node_id: n for n in await self.nodes()}
        return nodes[owner(request_id.encode(), list(nodes))] if nodes else None

    async def store_tails(self, tails: Sequence[TailBlock]) -> list[str]:
        """Store these requests' tails (whole ones replace, pieces extend); returns the
        request ids whose tail is not stored whole now: their node is down, or it lacks the
        rows a piece continues. Only a whole tail helps those."""
        lost: list[str] = []
        groups: dict[str, tuple[NodeInfo, list[TailBlock]]] = {}
        for tail in tails:
            node = await self._tail_owner(tail.request_id)
            if node is None:
                lost.append(tail.request_id)
            else:
                groups.setdefault(node.node_id, (node, []))[1].append(tail)

        async def put_group(node: NodeInfo, group: list[TailBlock]) -> list[str]:
            try:
                return await self._put_tails(node, group)
            except Exception as exc:
                self._mark_down(node, "put_tails", exc)
                return [t.request_id for t in group]

        for missing in await asyncio.gather(*(put_group(n, g) for n, g in groups.values())):
            lost.extend(missing)
        return lost

    async def _put_tails(self, node: NodeInfo, tails: list[TailBlock]) -> list[str]:
        """One put of tails to `node`; the request ids of pieces it cannot use."""
        row = len(tails[0].data) // tails[0].rows
        if any(len(t.data) != t.rows * row for t in tails):
            raise KVCacheError("tails of one put must hold rows of one size")
        announce = KVPutTails(
            transfer_id=f"tails-{uuid.uuid4().hex}",
            tails=[
                KVTail(AttemptId(t.request_id), t.start, bytes(t.parent), t.token_ids, t.first)
                for t in tails
            ],
            row_bytes=row,
            transfer_secret=new_secret(),
        )
        reply = decode(await self._ask(node.node_id, "put_tails", announce), KVPutTailsReply)
        if reply.error:
            raise KVCacheError(f"kvcache {node.node_id} refused put_tails: {reply.error}")
        payload = memoryview(b"".join(t.data for t in tails))
        # Checksummed per MiB, not per tail: a piece may be a single ~46 KB row.
        await self._send(node.data_address, "put_tails", announce, payload, 1 << 20)
        return list(reply.missing)

    async def load_tail(
        self, attempt_id: AttemptId, row_bytes: int, max_rows: int
    ) -> TailBlock | None:
        """The attempt's stored tail, whole (None: none, or its node is unavailable)."""
        node = await self._tail_owner(attempt_id)
        if node is None:
            return None
        try:
            return await self._get_tail(node, attempt_id, row_bytes, max_rows)
        except Exception as exc:
            self._mark_down(node, "get_tail", exc)
            return None

    async def _get_tail(
        self, node: NodeInfo, attempt_id: AttemptId, row_bytes: int, max_rows: int
    ) -> TailBlock | None:
        with self._incoming("tail", row_bytes * max_rows) as (transfer_id, secret, arrived):
            ask = KVGetTail(
                transfer_id=transfer_id,
                attempt_id=attempt_id,
                reply_address=self.transport.address,
                transfer_secret=secret,
            )
            reply = decode(await self._ask(node.node_id, "get_tail", ask), KVTailReply)
            if reply.error:
                raise KVCacheError(f"kvcache {node.node_id}: {reply.error}")
            t = reply.tail
            if t is None or t.attempt_id != attempt_id or t.first:
                return None
            if not 0 < len(t.token_ids) <= max_rows or reply.nbytes != len(t.token_ids) * row_bytes:
                return None  # another model's rows: unusable
            data = await asyncio.wait_for(arrived, TRANSFER_TIMEOUT)
        return TailBlock(t.attempt_id, t.start, BlockHash(t.parent), t.token_ids, data)
