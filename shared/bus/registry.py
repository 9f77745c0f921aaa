"""Node registry in a JetStream KV bucket: heartbeats with per-key TTL, and watchers.

Each node writes its NodeInfo under `<role>.<node id>` with a per-message TTL; a node that
stops heartbeating vanishes when the TTL lapses and the bucket's limit marker tells
watchers (a PURGE entry), so a dead node leaves the registry without anyone deleting it.
The role leads the key so that NATS permissions can keep each role to its own entries
(`$KV.tandem-nodes.<role>.>`): a prefill identity cannot write a decode node's entry.
Readers take an entry only if the role inside it is the one its key names.

A watcher does not depend on the marker alone: an entry not refreshed for well past its
own TTL (which the entry states) is taken as gone too. The marker lives one TTL itself,
and a watcher whose consumer was re-created in that window (under load) never sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.js.kv import KeyValue, StopIterSentinel

from shared.bus.client import Bus
from shared.bus.kv_keys import live_keys
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
        if not info.ttl:
            info = msgspec.structs.replace(info, ttl=self.ttl)
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
        assert self.kv is not None and self.bus.js is not None
        out: dict[str, NodeInfo] = {}
        try:
            keys = await live_keys(self.bus.js, NODES_BUCKET)
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
        """Joins, updates and leaves as they happen (starting with current entries as joins).
        A leave comes from the entry's expiry marker, or from the entry going unrefreshed
        for `stale_after` its TTL (see the module docstring)."""
        assert self.kv is not None
        watcher = await self.kv.watchall()
        known: dict[str, str] = {}  # key → node id
        deadline: dict[str, float] = {}  # key → when it is stale if not refreshed (monotonic)
        checked = time.monotonic()
        try:
            while True:
                # Looked at every STALE_CHECK seconds, also while other nodes' updates keep
                # coming (on a large cluster they never pause): a refresh still queued would
                # be one that came `stale_after` late, and its node rejoins with it.
                now = time.monotonic()
                if now - checked >= STALE_CHECK:
                    checked = now
                    for key in [k for k, at in deadline.items() if at < now]:
                        del deadline[key]
                        node_id = known.pop(key, None)
                        if node_id is not None:
                            log.warning("registry entry %s not refreshed: taken as gone", key)
                            yield RegistryEvent("leave", node_id, None)
                try:
                    entry = await watcher.updates(timeout=STALE_CHECK)
                except nats.errors.TimeoutError:
                    continue
                if isinstance(entry, StopIterSentinel):
                    return
                if entry is None:  # end of the initial snapshot: the nodes alive now are known
                    yield RegistryEvent("synced", "", None)
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    deadline.pop(entry.key, None)
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
                if info.ttl > 0:  # an older node states none: its marker alone counts
                    deadline[entry.key] = time.monotonic() + stale_after(info.ttl)
                kind = "update" if entry.key in known else "join"
                known[entry.key] = info.node_id
                yield RegistryEvent(kind, info.node_id, info)
        finally:
            await watcher.stop()


class CachedNodes:
    """A registry read reused for `refresh` seconds, for callers on a request's critical
    path: a read is a round trip per entry (6-20 ms measured for a prefill node's hand-off
    on a 2-core host with five entries, more on a larger cluster). Read afresh when stale,
    when asked for a node it does not list (one that joined since), or when told to
    (`fresh`: after every listed node failed). An empty read (the registry unreadable)
    keeps the last view. `min_interval`: at most one read that often, whatever asks (a
    caller whose misses a stranger can cause: the kvcache node's peers)."""

    def __init__(
        self, registry: NodeRegistry, refresh: float = 1.0, min_interval: float = 0.0
    ) -> None:
        self.registry = registry
        self.refresh = refresh
        self.min_interval = min_interval
        self.view: dict[str, NodeInfo] = {}
        self.reads = 0  # registry reads made
        self._read_at = -float("inf")

    async def nodes(self, wanted: str = "", fresh: bool = False) -> dict[str, NodeInfo]:
        now = time.monotonic()
        stale = now - self._read_at > self.refresh
        due = now - self._read_at >= self.min_interval
        if due and (fresh or stale or (wanted and wanted not in self.view)):
            found = await self.registry.nodes()
            self.reads += 1
            self._read_at = now
            if found or not self.view:
                self.view = found
        return self.view


STALE_CHECK = 0.5  # seconds between looks for unrefreshed entries, when no update comes


def stale_after(ttl: float) -> float:
    """How long an entry with this TTL may go unrefreshed before a watcher takes its node
    as gone: well past the TTL (heartbeats come every TTL/3), so the marker normally
    decides and this only catches a lost one."""
    return 3 * ttl + 2.0


def entry_key(role: str, node_id: str) -> str:
    """A node's key in the registry bucket: its role first (see the module docstring)."""
    return f"{role}.{node_id}"


def node_info(
    node_id: str, role: NodeRole, now: float | None = None, **fields: float | str
) -> NodeInfo:
    """A NodeInfo stamped with the current time (`now`: a simulation's clock)."""
    stamp = time.time() if now is None else now
    return NodeInfo(node_id=node_id, role=role, timestamp=stamp, **fields)  # type: ignore[arg-type]


# What a model node reports of its load, written once: the nodes' `info()` and the planner's
# simulated nodes (tandem/plan/simulator.py) build their entries with these.


def decode_entry(
    node_id: str,
    *,
    running: int,
    waiting: int,
    free_blocks: int,
    total_blocks: int,
    now: float | None = None,
    **fields: float | str,
) -> NodeInfo:
    """A decode node's entry: its load is what runs (decoding, or prefilling chunk by
    chunk) and what waits; its free blocks net of those promised to arrivals under way,
    never below 0 (promises can outrun the pool for a moment)."""
    return node_info(
        node_id, "decode", now, load=running + waiting, running=running,
        free_kv_blocks=max(0, free_blocks), total_kv_blocks=total_blocks, **fields,
    )  # fmt: skip


def prefill_entry(
    node_id: str,
    *,
    batch: int,
    free_blocks: int,
    total_blocks: int,
    now: float | None = None,
    **fields: float | str,
) -> NodeInfo:
    """A prefill node's entry: its load is the batch it fetched, until the batch's last
    hand-off (its queue is the shared stream's, which the router does not count)."""
    return node_info(
        node_id, "prefill", now, load=batch, free_kv_blocks=free_blocks,
        total_kv_blocks=total_blocks, **fields,
    )  # fmt: skip
