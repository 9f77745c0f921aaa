"""Node registry in a JetStream KV bucket: heartbeats with per-key TTL, and watchers.

Each node writes its NodeInfo under `<role>.<node id>` with a per-message TTL; a node that
stops heartbeating vanishes when the TTL lapses and the bucket's limit marker tells
watchers (a PURGE entry), so a dead node leaves the registry without anyone deleting it.
The role leads the key so that NATS permissions can keep each role to its own entries
(`$KV.tandem-nodes.<role>.>`): a prefill identity cannot write a decode node's entry.
Readers take an entry only if the role inside it is the one its key names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from nats.js.errors import NoKeysError
from nats.js.kv import KeyValue

from shared.bus.client import Bus
from shared.bus.messages import NodeInfo, NodeRole, decode, encode
from shared.bus.topology import NODES_BUCKET
from shared.errors import WireFormatError

log = logging.getLogger("tandem.registry")


@dataclass(frozen=True)
class RegistryEvent:
    kind: str  # "join" | "update" | "leave" | "synced" (the initial snapshot is complete)
    node_id: str
    info: NodeInfo | None


class NodeRegistry:
    def __init__(self, bus: Bus, ttl: float = 6.0) -> None:
        self.bus = bus
        self.ttl = max(1.0, ttl)  # NATS per-message TTL has one-second granularity
        self.kv: KeyValue | None = None
        # When a round trip to NATS last worked (monotonic): the node's contact with the
        # cluster. A node cut off longer than its lease gives up its work (see decode).
        self.last_ok = time.monotonic()

    async def start(self) -> NodeRegistry:
        assert self.bus.js is not None
        self.kv = await self.bus.js.key_value(NODES_BUCKET)
        return self

    async def heartbeat(self, info: NodeInfo) -> None:
        assert self.bus.js is not None
        await self.bus.js.publish(
            f"$KV.{NODES_BUCKET}.{entry_key(info.role, info.node_id)}",
            encode(info),
            msg_ttl=self.ttl,
        )

    async def run_heartbeats(
        self, make_info: Callable[[], NodeInfo], interval: float | None = None
    ) -> None:
        """Heartbeat forever (cancel the task to stop); errors are logged, never fatal."""
        period = interval or self.ttl / 3
        contact = asyncio.create_task(self._keep_contact(period))
        try:
            while True:
                try:
                    await self.heartbeat(make_info())
                except Exception as exc:  # the connection may be down; keep trying
                    log.warning("heartbeat failed: %s", exc)
                await asyncio.sleep(period)
        finally:
            contact.cancel()

    async def _keep_contact(self, period: float) -> None:
        """`last_ok`: when a round trip to the server (PING/PONG) last worked. Not the
        heartbeat's JetStream ack: a restarted server answers before its streams are back,
        and a node that reaches NATS is reachable by the routers."""
        assert self.bus.nc is not None
        while True:
            try:
                await self.bus.nc.flush(timeout=max(1, round(period)))
                self.last_ok = time.monotonic()
            except Exception as exc:  # cut off, or reconnecting
                log.debug("no round trip to NATS: %r", exc)
            await asyncio.sleep(period / 2)

    async def remove(self, role: str, node_id: str) -> None:
        assert self.kv is not None
        await self.kv.delete(entry_key(role, node_id))

    async def nodes(self) -> dict[str, NodeInfo]:
        """The registry's current live entries ({} if it cannot be read now). An entry that
        goes while they are read (a node leaving) is skipped, not the rest with it."""
        assert self.kv is not None
        out: dict[str, NodeInfo] = {}
        try:
            keys = await self.kv.keys()
        except NoKeysError:
            return out
        except Exception as exc:  # NATS away or slow: no view now (callers keep theirs)
            log.warning("registry not readable: %r", exc)
            return out
        for key in keys:
            try:
                entry = await self.kv.get(key)
            except Exception as exc:  # deleted since it was listed, or one slow read
                log.debug("registry entry %s not read: %r", key, exc)
                continue
            if entry.value:
                with contextlib.suppress(WireFormatError):
                    info = decode(entry.value, NodeInfo)
                    if key == entry_key(info.role, info.node_id):  # else: forged
                        out[info.node_id] = info
        return out

    async def watch(self) -> AsyncIterator[RegistryEvent]:
        """Joins, updates and leaves as they happen (starting with current entries as joins)."""
        assert self.kv is not None
        watcher = await self.kv.watchall()
        known: dict[str, str] = {}  # key → node id
        try:
            async for entry in watcher:
                if entry is None:  # end of the initial snapshot: the nodes alive now are known
                    yield RegistryEvent("synced", "", None)
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    node_id = known.pop(entry.key, None)
                    if node_id is not None:
                        yield RegistryEvent("leave", node_id, None)
                    continue
                try:
                    info = decode(entry.value, NodeInfo)
                    if entry.key != entry_key(info.role, info.node_id):
                        raise WireFormatError("an entry under another role's or node's key")
                except WireFormatError as exc:
                    self.bus.count_drop(f"$KV.{NODES_BUCKET}.{entry.key}", str(exc))
                    continue
                kind = "update" if entry.key in known else "join"
                known[entry.key] = info.node_id
                yield RegistryEvent(kind, info.node_id, info)
        finally:
            await watcher.stop()


def entry_key(role: str, node_id: str) -> str:
    """A node's key in the registry bucket: its role first (see the module docstring)."""
    return f"{role}.{node_id}"


def node_info(node_id: str, role: NodeRole, **fields: int | str) -> NodeInfo:
    """A NodeInfo stamped with the current time."""
    return NodeInfo(node_id=node_id, role=role, timestamp=time.time(), **fields)  # type: ignore[arg-type]
