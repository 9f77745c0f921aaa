"""The router's view of the cluster: nodes from the registry, and the choice of decode node."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

from shared.bus.messages import NodeInfo, NodeRole
from shared.bus.registry import NodeRegistry
from shared.kv.block_hash import DEFAULT_BLOCK_SIZE
from shared.tasks import cancel_and_wait

log = logging.getLogger("tandem.router.nodes")
PREFILL_POOL = "prefill-pool"  # where a job waits for any prefill node (backlog key)
REWATCH_GRACE = 8.0  # seconds for every live node to heartbeat into a re-created registry
# An idle decode process's share for any model in `best_decode`: between none (another
# model runs there) and all: a model's requests gather on a process until it carries 10
# more sequences than an idle one, so that steady loads of several models do not start
# mixed on shared processes (a mix takes tens of seconds to sort itself out).
IDLE_SHARE = 0.5


def prefill_pool(model: str = "") -> str:
    """The backlog key of a model's prefill pool (its nodes share its queue)."""
    return f"{PREFILL_POOL}:{model}" if model else PREFILL_POOL


def room_left(free_blocks: int, sent: int, blocks_needed: int) -> int:
    """`NodeTable.room`'s estimate from its parts: free blocks by the last heartbeat, less
    `sent` requests since, each counted at this one's size."""
    return free_blocks - sent * blocks_needed


class NodeTable:
    def __init__(
        self, registry: NodeRegistry, colocated: bool = False, prefill_optional: bool = False
    ) -> None:
        self.registry = registry
        self.colocated = colocated  # decode nodes prefill every request: no prefill node needed
        # conditional: decode nodes prefill what finds no prefill node (a pool scaled to none)
        self.prefill_optional = prefill_optional
        self.nodes = {}
        self._task: asyncio.Task[None] | None = None
        # Requests sent to a decode node since its last heartbeat: keeps a burst from all
        # landing on the node that looked emptiest a moment ago.
        self.inflight: dict[str, int] = {}
        self.on_leave: list[Callable[[str], None]] = []
        self.left_at: dict[str, float] = {}  # departed node → its last heartbeat (unix time)
        self.heard_at: dict[str, float] = {}  # node → when its latest entry arrived (monotonic)
        # Prompt tokens sent to be prefilled and not yet answered by a first token, by where
        # (PREFILL_POOL or a decode node): what is queued ahead of the next prefill there,
        # fresher than any heartbeat (conditional.py weighs it). One entry per request.
        self.prefill_backlog: dict[str, tuple[str, int]] = {}
        self._backlog_tokens: dict[str, int] = {}

    @property
    def nodes(self) -> Mapping[str, NodeInfo]:
        """Every node by id, as the registry last said (read-only: `put` and `drop` change
        it, and keep the per-role lists every request's routing reads)."""
        return self._view

    @nodes.setter
    def nodes(self, nodes: Mapping[str, NodeInfo]) -> None:
        self._nodes = dict(nodes)
        self._view = MappingProxyType(self._nodes)
        self._roles: dict[tuple[str, str], list[NodeInfo]] = {}  # (role, model) -> nodes
        # model -> its decode nodes with the fields best_decode weighs, read once per change
        # (a NodeInfo's fields are slow to read; every request weighs every decode node)
        self._weighed: dict[str, list[tuple[NodeInfo, str, int, int, int, int]]] = {}
        self._hosts: dict[str, list[NodeInfo]] | None = None  # process -> its nodes (shared)

    def heard(self, info: NodeInfo, at: float) -> None:
        """A node's entry as its heartbeat wrote it (`at`: monotonic, or a simulation's
        clock): the table's view of it, and what was sent to it since the last entry
        starts again from none (this one counts it)."""
        self.put(info)
        self.heard_at[info.node_id] = at
        self.left_at.pop(info.node_id, None)
        self.inflight[info.node_id] = 0

    def put(self, info: NodeInfo) -> None:
        """A node's latest registry entry."""
        old = self._nodes.get(info.node_id)
        self._nodes[info.node_id] = info
        self._forget_lists(info.role)
        self._hosts = None
        if old is not None and old.role != info.role:
            self._forget_lists(old.role)

    def drop(self, node_id: str) -> NodeInfo | None:
        """Forget a node, and what was sent to it; its last entry, if it was known."""
        self.inflight.pop(node_id, None)
        gone = self._nodes.pop(node_id, None)
        if gone is not None:
            self._forget_lists(gone.role)
            self._hosts = None
        return gone

    def _forget_lists(self, role: str) -> None:
        for key in [k for k in self._roles if k[0] == role]:
            del self._roles[key]
        if role == "decode":
            self._weighed.clear()

    async def start(self) -> NodeTable:
        self.nodes = await self.registry.nodes()
        self._task = asyncio.create_task(self._watch())
        return self

    def rewatch(self) -> None:
        """Watch the registry afresh (after a reconnect: a restarted server re-creates the
        registry bucket, and a watch of the old one hears nothing more). Nodes not heard
        from within REWATCH_GRACE after it are taken as gone (they died meanwhile); the
        others' next heartbeats fill the new bucket."""
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.create_task(self._watch())
        since = time.monotonic()

        def sweep() -> None:
            for node_id in [n for n in self.nodes if self.heard_at.get(n, 0.0) < since]:
                self._left(node_id)

        asyncio.get_running_loop().call_later(REWATCH_GRACE, sweep)

    async def on_reconnect(self) -> None:
        self.rewatch()

    async def _watch(self) -> None:
        while True:
            try:
                async for ev in self.registry.watch():
                    if ev.kind == "synced":
                        continue
                    if ev.kind == "leave":
                        self._left(ev.node_id)
                    elif ev.info is not None:
                        if ev.kind == "join":
                            log.info("node joined: %s (%s)", ev.node_id, ev.info.role)
                        self.heard(ev.info, time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the connection dropped: watch again once it is back
                log.warning("registry watch failed: %s", exc)
                await asyncio.sleep(0.5)

    def _left(self, node_id: str) -> None:
        gone = self.drop(node_id)
        self.heard_at.pop(node_id, None)
        if gone is not None:
            self.left_at[node_id] = gone.timestamp
            while len(self.left_at) > 1024:  # bounded: oldest first out
                del self.left_at[next(iter(self.left_at))]
        log.warning("node left: %s", node_id)
        for callback in self.on_leave:
            callback(node_id)

    def by_role(self, role: NodeRole, model: str = "") -> list[NodeInfo]:
        """The nodes of a role that take new work (a draining node only finishes its own),
        of those serving `model` when one is named (a node naming no model, of before
        several models, serves any). Kept between changes (routing reads it several times
        a request): not to be changed."""
        nodes = self._roles.get((role, model))
        if nodes is None:
            nodes = [
                n
                for n in self._nodes.values()
                if n.role == role and not n.draining and (not model or n.model in (model, ""))
            ]
            self._roles[role, model] = nodes
        return nodes

    def block_size(self, model: str = "") -> int:
        """Tokens per KV block, as the decode nodes' engines say (the default before any
        has registered)."""
        sizes = [n.block_size for n in self.by_role("decode", model) if n.block_size > 0]
        return max(sizes, default=DEFAULT_BLOCK_SIZE)

    def blocks_needed(self, prompt_tokens: int, max_tokens: int, model: str = "") -> int:
        """KV blocks a request can come to fill (what a decode node must have room for)."""
        return -(-(prompt_tokens + max_tokens) // self.block_size(model))

    def pool_less(self, model: str = "") -> bool:
        """No prefill queue to fall back on for `model`: colocated, or conditional with no
        prefill node up (a job queued then would wait for a node that may never come)."""
        return self.colocated or (self.prefill_optional and not self.by_role("prefill", model))

    def ready(self, model: str = "") -> bool:
        """Whether a request (for `model`) can be served: a decode node, and a prefill
        node unless colocated or conditional."""
        prefill = self.colocated or self.prefill_optional or bool(self.by_role("prefill", model))
        return prefill and bool(self.by_role("decode", model))

    def pick_decode(
        self,
        blocks_needed: int,
        exclude: set[str] | None = None,
        prefer: str = "",
        model: str = "",
    ) -> NodeInfo | None:
        """Node `prefer` if it is a live decode node (of `model`) with room, else the least
        loaded one (`best_decode`); counted as sent one more request."""
        choice = self._with_room(prefer, blocks_needed, exclude, model) or self.best_decode(
            blocks_needed, exclude, model
        )
        if choice is not None:
            self.sent(choice.node_id)
        return choice

    def sent(self, node_id: str, n: int = 1) -> None:
        """`n` more requests sent to the node since its last heartbeat (-1: one it refused).
        The one writer of `inflight` besides the heartbeats that reset it."""
        self.inflight[node_id] = max(0, self.inflight.get(node_id, 0) + n)

    def _with_room(
        self, node_id: str, blocks_needed: int, exclude: set[str] | None, model: str
    ) -> NodeInfo | None:
        if not node_id or (exclude and node_id in exclude):
            return None
        for node in self.by_role("decode", model):
            if node.node_id == node_id:
                return node if self.room(node, blocks_needed) >= blocks_needed else None
        return None

    def room(self, node: NodeInfo, blocks_needed: int) -> int:
        """Free blocks a node has by its last heartbeat, less what was sent to it since
        (each request sent counted at this one's size)."""
        return room_left(node.free_kv_blocks, self.inflight.get(node.node_id, 0), blocks_needed)

    def best_decode(
        self, blocks_needed: int, exclude: set[str] | None = None, model: str = ""
    ) -> NodeInfo | None:
        """The decode node (of `model`) with the most free blocks per running sequence.

        Free blocks are estimated from the last heartbeat less what this router sent since;
        a node short of room now is still chosen (it queues or refuses, and the prefill
        node then tries another), but never one whose whole pool could not hold the request.
        The load counted is its process's (`host_load`: a shared decode process runs
        other models' sequences too), and a node gains its model's share of that load
        (`IDLE_SHARE` on an idle process): another model's steps take turns with its own
        on one core, and a step costs much the same at any batch size, so a model's
        requests gather where it already runs (under a steady load of several models,
        placement converges to a process per model) unless that process carries 20 more
        sequences; a model busy while the others idle spreads over every process once its
        own carries 10 more than an idle one. Single-model nodes: the least loaded one,
        as ever (their share is 1).
        """
        best: tuple[float, str] | None = None
        choice = None
        inflight = self.inflight
        for node, node_id, total, free_blocks, running, hosted in self._weighing(model):
            if exclude and node_id in exclude:
                continue
            if total and total < blocks_needed:
                continue
            sent = inflight.get(node_id, 0)
            free = room_left(free_blocks, sent, blocks_needed)
            if hosted > 1:
                host = self.host_load(node)  # queued sequences too (host_running)
                share = (node.load + sent) / host if host else IDLE_SHARE
            else:  # a node alone in its process: its model's share is all
                host, share = running + sent, 1.0
            score = free / max(1, total) + share - 0.05 * host
            if best is None or (score, node_id) > best:
                best, choice = (score, node_id), node
        return choice

    def _weighing(self, model: str) -> list[tuple[NodeInfo, str, int, int, int, int]]:
        """`by_role("decode", model)`, each node with the fields `best_decode` reads."""
        facts = self._weighed.get(model)
        if facts is None:
            facts = self._weighed[model] = [
                (n, n.node_id, n.total_kv_blocks, n.free_kv_blocks, n.running, n.hosted_models)
                for n in self.by_role("decode", model)
            ]
        return facts

    def host_load(self, node: NodeInfo) -> int:
        """Sequences a shared decode process runs for all its models: what its freshest
        entry says, and every request sent to any of its nodes since their own last entries
        (heartbeats of one process's nodes come at different times: a request sent to one
        model's node a moment ago must count against the others', or the next model's first
        request looks at an idle process and joins it)."""
        if self._hosts is None:
            self._hosts = {}
            for other in self._nodes.values():
                if other.role == "decode" and other.host:
                    self._hosts.setdefault(other.host, []).append(other)
        siblings = self._hosts.get(node.host, [node]) if node.host else [node]
        latest = max(siblings, key=lambda n: n.timestamp)
        return latest.host_running + sum(self.inflight.get(n.node_id, 0) for n in siblings)

    def prefill_sent(self, rid: str, where: str, tokens: int) -> None:
        """A request's prompt (its uncached tokens) went to be prefilled at `where`."""
        self.prefill_done(rid)
        self.prefill_backlog[rid] = (where, tokens)
        self._backlog_tokens[where] = self._backlog_tokens.get(where, 0) + tokens

    def prefill_done(self, rid: str) -> None:
        """Its first token came (or it ended): no longer queued for a prefill anywhere."""
        entry = self.prefill_backlog.pop(rid, None)
        if entry is not None:
            where, tokens = entry
            left = self._backlog_tokens[where] - tokens
            if left:
                self._backlog_tokens[where] = left
            else:
                del self._backlog_tokens[where]

    def backlog_tokens(self, where: str) -> int:
        return self._backlog_tokens.get(where, 0)

    def suspect(self, node_id: str) -> None:
        """Stop choosing a node declared dead by a probe; its next heartbeat (if it is alive
        after all) brings it back, and its registry expiry is then a no-op."""
        self.drop(node_id)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
