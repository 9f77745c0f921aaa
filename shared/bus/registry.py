"""Node registry in a JetStream KV bucket: heartbeats with per-key TTL, and watchers.

Each node writes its NodeInfo under its id with a per-message TTL; a node that stops
heartbeating vanishes when the TTL lapses and the bucket's limit marker tells watchers
(a PURGE entry), so a dead node leaves the registry without anyone deleting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from nats.js.kv import KeyValue

from shared.bus.client import Bus
from shared.bus.messages import NodeInfo, decode, encode
from shared.bus.topology import NODES_BUCKET
from shared.errors import WireFormatError

log = logging.getLogger("tandem.registry")


@dataclass(frozen=True)
class RegistryEvent:
    kind: str  # "join" | "update" | "leave"
    node_id: str
    info: NodeInfo | None


class NodeRegistry:
    def __init__(self, bus: Bus, ttl: float = 6.0) -> None:
        self.bus = bus
        self.ttl = max(1.0, ttl)  # NATS per-message TTL has one-second granularity
        self.kv: KeyValue | None = None
        # When a heartbeat last reached JetStream (monotonic): the node's contact with the
        # cluster. A node cut off longer than its lease gives up its work (see decode).
        self.last_ok = time.monotonic()

    async def start(self) -> NodeRegistry:
        assert self.bus.js is not None
        self.kv = await self.bus.js.key_value(NODES_BUCKET)
        return self

    async def heartbeat(self, info: NodeInfo) -> None:
        assert self.bus.js is not None
        await self.bus.js.publish(
            f"$KV.{NODES_BUCKET}.{info.node_id}", encode(info), msg_ttl=self.ttl
        )

    async def run_heartbeats(
        self, make_info: Callable[[], NodeInfo], interval: float | None = None
    ) -> None:
        """Heartbeat forever (cancel the task to stop); errors are logged, never fatal."""
        period = interval or self.ttl / 3
        while True:
            try:
                await self.heartbeat(make_info())
                self.last_ok = time.monotonic()
            except Exception as exc:  # the connection may be down; keep trying
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(period)

    async def remove(self, node_id: str) -> None:
        assert self.kv is not None
        await self.kv.delete(node_id)

    async def nodes(self) -> dict[str, NodeInfo]:
        """The registry's current live entries."""
        assert self.kv is not None
        out: dict[str, NodeInfo] = {}
        with contextlib.suppress(Exception):  # NoKeysError when empty
            for key in await self.kv.keys():
                entry = await self.kv.get(key)
                if entry.value:
                    with contextlib.suppress(WireFormatError):
                        out[key] = decode(entry.value, NodeInfo)
        return out

    async def watch(self) -> AsyncIterator[RegistryEvent]:
        """Joins, updates and leaves as they happen (starting with current entries as joins)."""
        assert self.kv is not None
        watcher = await self.kv.watchall()
        known: set[str] = set()
        try:
            async for entry in watcher:
                if entry is None:
                    continue  # end of the initial snapshot
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    if entry.key in known:
                        known.discard(entry.key)
                        yield RegistryEvent("leave", entry.key, None)
                    continue
                try:
                    info = decode(entry.value, NodeInfo)
                except WireFormatError as exc:
                    self.bus.count_drop(f"$KV.{NODES_BUCKET}.{entry.key}", str(exc))
                    continue
                kind = "update" if entry.key in known else "join"
                known.add(entry.key)
                yield RegistryEvent(kind, entry.key, info)
        finally:
            await watcher.stop()


def node_info(node_id: str, role: str, **fields: int | str) -> NodeInfo:
    """A NodeInfo stamped with the current time."""
    return NodeInfo(node_id=node_id, role=role, timestamp=time.time(), **fields)  # type: ignore[arg-type]
