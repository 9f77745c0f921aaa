"""KV block events: nodes publish which blocks they stored or evicted; routers index them.

A node's store calls `stored`/`evicted` synchronously (from its event loop or engine
callbacks); the publisher batches them and flushes on the JetStream KV-event stream in
order, so a block stored then evicted is never seen the other way round. The queue is
bounded: past its limit the oldest events are dropped (counted), because the index is a
routing hint and a stale hint costs only a cache miss.

`KVIndex` is the router's view: for each node, the set of block hashes it holds. It
replays the stream from its start (an ordered consumer), then follows it live; a node that
leaves the registry is dropped from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from nats.js.api import DeliverPolicy

from shared.bus.client import Bus
from shared.bus.messages import KVEvent, KVEventOp, decode
from shared.bus.topology import KV_EVENTS_SUBJECT, kv_events_subject
from shared.errors import WireFormatError
from shared.tasks import cancel_and_wait

log = logging.getLogger("tandem.kv_events")

MAX_HASHES_PER_EVENT = 4096  # 16-byte hashes: an event stays far below NATS' payload limit
MAX_PENDING_HASHES = 200_000
# Blocks the index takes from a node that advertises no KV block count (a kvcache node)
UNADVERTISED_CAPACITY = 1 << 20
FLUSH_INTERVAL = 0.05


class KVEventPublisher:
    def __init__(self, bus: Bus, node_id: str) -> None:
        self.bus = bus
        self.node_id = node_id
        self.pending: deque[tuple[KVEventOp, list[bytes]]] = deque()
        self.pending_hashes = 0
        self.dropped = 0
        self.published = 0
        self._task: asyncio.Task[None] | None = None

    def stored(self, hashes: Sequence[bytes]) -> None:
        self._add("stored", hashes)

    def evicted(self, hashes: Sequence[bytes]) -> None:
        self._add("evicted", hashes)

    def cleared(self) -> None:
        """This node holds nothing (it just started): forget what an earlier run announced."""
        self.pending.append(("cleared", []))

    def _add(self, op: KVEventOp, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return
        if self.pending and self.pending[-1][0] == op:
            self.pending[-1][1].extend(hashes)
        else:
            self.pending.append((op, list(hashes)))
        self.pending_hashes += len(hashes)
        while self.pending_hashes > MAX_PENDING_HASHES and len(self.pending) > 1:
            _, old = self.pending.popleft()
            self.pending_hashes -= len(old)
            self.dropped += len(old)

    def start(self) -> KVEventPublisher:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL)
            try:
                await self.flush()
            except Exception as exc:  # NATS down: the events wait (bounded) for its return
                log.warning("KV events not published yet: %s", exc)
                await asyncio.sleep(0.5)

    async def flush(self) -> None:
        subject = kv_events_subject(self.node_id)
        while self.pending:
            op, hashes = self.pending[0]
            chunk = hashes[:MAX_HASHES_PER_EVENT]
            event = KVEvent(node_id=self.node_id, op=op, block_hashes=chunk, timestamp=time.time())
            await self.bus.js_publish(subject, event)
            del hashes[: len(chunk)]
            self.pending_hashes -= len(chunk)
            self.published += len(chunk)
            if not hashes:
                self.pending.popleft()

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), 1.0)


class KVIndex:
    """Which node holds which block, from the KV-event stream.

    What an event may add is bounded (a forged or runaway publisher must not grow the
    router): `capacity` says, per node id, how many blocks the node can hold (its advertised
    KV blocks), or None for a node not in the registry, whose "stored" events are refused
    (removals are always applied). Without `capacity` (tools, tests) every node is taken
    at `UNADVERTISED_CAPACITY`.
    """

    def __init__(self, capacity: Callable[[str], int | None] | None = None) -> None:
        self.by_node: dict[str, set[bytes]] = {}
        self.events = 0
        self.refused = 0  # hashes of "stored" events not indexed (unknown node, or full)
        self.capacity = capacity or (lambda _node: UNADVERTISED_CAPACITY)
        self._sub: object | None = None

    def apply(self, event: KVEvent) -> None:
        self.events += 1
        if event.op == "cleared":
            self.by_node.pop(event.node_id, None)
            return
        if event.op == "evicted":
            if (held := self.by_node.get(event.node_id)) is not None:
                held.difference_update(event.block_hashes)
            return
        if event.op != "stored":
            return
        cap = self.capacity(event.node_id)
        if cap is None:
            self.refused += len(event.block_hashes)
            return
        held = self.by_node.setdefault(event.node_id, set())
        if len(held) + len(event.block_hashes) <= cap:  # the usual case: room for them all
            held.update(event.block_hashes)
            return
        room = max(0, cap - len(held))
        new = [h for h in event.block_hashes if h not in held]
        if len(new) > room:
            self.refused += len(new) - room
            new = new[:room]
        held.update(new)

    def drop_node(self, node_id: str) -> None:
        self.by_node.pop(node_id, None)

    def prefix_blocks(self, node_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` the node holds."""
        return self.union_prefix_blocks([node_id], hashes)

    def union_prefix_blocks(self, node_ids: Sequence[str], hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` some node among `node_ids` holds (sharded stores)."""
        sets = [self.by_node[n] for n in node_ids if n in self.by_node]
        n = 0
        for h in hashes:
            if not any(h in s for s in sets):
                break
            n += 1
        return n

    async def follow(self, bus: Bus) -> None:
        """Replay the stream, then apply events as they come (until the bus closes)."""
        assert bus.js is not None

        async def on_event(msg: object) -> None:
            data = getattr(msg, "data", b"")
            subject = getattr(msg, "subject", KV_EVENTS_SUBJECT)
            try:
                event = decode(data, KVEvent)
            except WireFormatError as exc:
                bus.count_drop(subject, str(exc))
                return
            if subject != kv_events_subject(event.node_id):  # a node speaks for itself only
                bus.count_drop(subject, f"a KV event of {event.node_id!r} on another's subject")
                return
            self.apply(event)

        self._sub = await bus.js.subscribe(
            f"{KV_EVENTS_SUBJECT}.>",
            cb=on_event,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )

    async def refollow(self, bus: Bus) -> None:
        """After a reconnect: a restarted server lost this ordered consumer, which then hears
        nothing more. Drop it, forget what it taught, replay the stream (kept on disk)."""
        old, self._sub = self._sub, None
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()  # type: ignore[attr-defined]
        self.by_node.clear()
        for attempt in range(20):
            try:
                await self.follow(bus)
                return
            except Exception as exc:  # JetStream still starting: try again shortly
                log.debug("following KV events again, attempt %d: %r", attempt + 1, exc)
                await asyncio.sleep(0.5)
        log.warning("could not follow the KV-event stream again after a reconnect")
