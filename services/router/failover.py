"""Failover of a request whose decode node died or stalled: resume, never replay.

The router knows every token it delivered (the stream's in-order deltas). Resuming is
submitting the request again with those tokens as `output_ids`: a prefill node loads the
prompt and the generated tokens' KV from the kvcache service (decode nodes store every
block they fill), recomputes only what no block holds, samples the next token exactly as
the lost node would have (seeded by (seed, position); greedy is greedy), and hands the
sequence to another decode node. New deltas continue at the next sequence number, and the
stream drops any duplicate, so the client sees no gap and no repeat.

Once a stream has delivered `standby_after` tokens (by then its prompt's blocks are
stored), another decode node is picked as its standby and told to load the context's
stored KV into its pool (`services/decode/standby.py`); a resume goes there if it can, and
then loads only what was stored since.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec
from opentelemetry import trace

from services.router.dispatch import Dispatch, ResumeRefused
from services.router.metrics import RouterMetrics
from services.router.streams import RequestStream, StreamTimeout
from shared.bus.messages import Prefetch, PrefillJob
from shared.bus.topology import prefetch_subject

if TYPE_CHECKING:
    from shared.bus.messages import NodeInfo

log = logging.getLogger("tandem.router.failover")

MAX_FAILOVERS = 3
NODE_WAIT = 5.0  # seconds a resume waits for some decode node to be registered
NODE_POLL = 0.1


class Failover:
    """One request's failover state: its current attempt (`job`), the nodes it left, its
    standby; `resume` moves it to another decode node."""

    def __init__(
        self,
        dispatch: Dispatch,
        metrics: RouterMetrics,
        job: PrefillJob,
        stream: RequestStream,
        blocks: int,
        prefill_node: str = "",
    ) -> None:
        self.dispatch = dispatch
        self.metrics = metrics
        self.job = job
        self.stream = stream
        self.blocks = blocks
        # The prefill node whose own queue holds the job (steered there): until token 0,
        # its loss is this request's (a shared-queue job is redelivered by JetStream).
        self.prefill_node = prefill_node
        self.lost = asyncio.Event()
        self.attempts = 0
        # Nodes this request already moved away from: their later "left" (a probe found the
        # node dead, then its registry entry expires) must not resume it a second time.
        self.abandoned: set[str] = set()
        self.standby = ""  # the decode node told to load this stream's KV ahead of a failure

    def node_left(self, node_id: str) -> None:
        """The registry lost a node: if it was serving this request, resume elsewhere."""
        if node_id in self.abandoned:
            return
        serving, seq = self.stream.node_id, self.stream.next_seq
        if (
            node_id == serving
            or (node_id == self.job.decode_node and seq <= 1)
            or (node_id == self.prefill_node and seq == 0)
        ):
            self.lost.set()  # the prefill node sent token 0, the decode node had the rest

    def expected_sender(self) -> str:
        """The node the next token should come from ("" while a prefill node, unknown to
        the router, works on it: JetStream redelivers a dead prefill node's job)."""
        if self.stream.next_seq <= 1:  # token 0 comes from prefill, the rest from decode
            return self.job.decode_node if self.stream.next_seq == 1 else self.prefill_node
        if self.stream.node_id in self.abandoned:  # resumed: the new node sends next
            return self.job.decode_node
        return self.stream.node_id

    async def _target(self, exclude: set[str]) -> NodeInfo | None:
        """Another decode node if one has room, else any; when none is registered (all of
        them lost at once, or suspected while NATS came back), wait up to NODE_WAIT for
        one: a suspected node that is alive returns with its next heartbeat."""
        waited_until = time.monotonic() + NODE_WAIT
        while True:
            nodes = self.dispatch.nodes
            model = self.job.model
            node = nodes.pick_decode(self.blocks, exclude, prefer=self.standby, model=model)
            node = node or nodes.pick_decode(self.blocks, model=model)
            if node is not None or time.monotonic() >= waited_until:
                return node
            await asyncio.sleep(NODE_POLL)

    async def warm_standby(self) -> None:
        """Once the stream has delivered `standby_after` tokens: pick another decode node as
        its standby and have it load the context's stored KV (best effort; only with a
        kvcache service, which holds that KV)."""
        after = self.dispatch.config.standby_after
        delivered = self.stream.token_ids
        if self.standby or not after or len(delivered) < after:
            return
        self.standby = "-"  # tried: once per stream
        nodes = self.dispatch.nodes
        if not nodes.by_role("kvcache"):
            return
        serving = {self.stream.node_id, self.job.decode_node} - {""}
        node = nodes.best_decode(self.blocks, serving, self.job.model)
        if node is None:
            return
        self.standby = node.node_id
        hint = Prefetch(
            attempt_id=self.job.attempt_id,
            token_ids=self.job.prompt_ids + delivered,
            cache_salt=self.job.params.cache_salt,
        )
        try:
            await self.dispatch.bus.publish(prefetch_subject(node.node_id), hint)
        except Exception as exc:  # no standby then: a resume loads everything itself
            log.debug("prefetch hint to %s not sent: %s", node.node_id, exc)

    async def resume(self, reason: str) -> bool:
        """Resubmit the request after the tokens delivered so far; False if it cannot be."""
        if self.attempts >= MAX_FAILOVERS:
            log.warning("%s: %s, and %d failovers were tried", self.job.attempt_id, reason,
                        self.attempts)  # fmt: skip
            return False
        exclude = {self.stream.node_id, self.job.decode_node} - {""}
        node = await self._target(exclude)
        if self.stream.ended:
            # Its last tokens came while a node was sought (a router that woke from a stall
            # reads the deltas that waited in NATS after it saw the nodes' entries lapse):
            # nothing is left to resume, and a resume would be refused (max_tokens reached).
            log.info("%s: %s, but its stream ended meanwhile", self.job.attempt_id, reason)
            return True
        if node is None:
            log.warning("%s: %s, and no decode node came within %.0fs", self.job.attempt_id,
                        reason, NODE_WAIT)  # fmt: skip
            return False
        delivered = list(self.stream.token_ids)
        path = await self._move(node, exclude, reason)
        if path is None:
            return False
        trace.get_current_span().add_event(
            "failover",
            {"tandem.reason": reason, "tandem.tokens_delivered": len(delivered),
             "tandem.decode_node": node.node_id},
        )  # fmt: skip
        log.warning(
            "%s: %s; resuming after %d delivered tokens on %s (failover %d, %s)",
            self.job.attempt_id,
            reason,
            len(delivered),
            node.node_id,
            self.attempts,
            path,
        )
        return True

    async def _move(self, node: NodeInfo, exclude: set[str], reason: str) -> str | None:
        """Submit the next attempt to `node` and cancel the request where it was; the path
        taken, or None if it could not be submitted."""
        # Decode nodes that held it (token 0 alone came from a prefill node: not that one,
        # which must not mark the request cancelled: it may prefill the resumed job).
        left = {self.job.decode_node} | (
            {self.stream.node_id} if self.stream.next_seq > 1 else set()
        )
        left -= {"", node.node_id}
        self.attempts += 1
        self.abandoned |= exclude
        if self.prefill_node and self.stream.next_seq == 0:
            self.abandoned.add(self.prefill_node)
        self.prefill_node = ""  # a resumed job is never steered
        delivered = list(self.stream.token_ids)
        self.job = msgspec.structs.replace(self.job, decode_node=node.node_id)
        job = msgspec.structs.replace(
            self.job,
            output_ids=delivered,
            handoff=self.attempts,
            deadline=time.time() + self.dispatch.config.first_token_timeout,
            alone=False,  # said when it was first sent: stale now
        )
        self.stream.handoff = job.handoff  # from now on the old handoff's errors are stale
        try:
            path = await self.dispatch.resubmit(node, job, self.blocks)
        except ResumeRefused as exc:  # the client hears why, at once, not after a timeout
            raise StreamTimeout(f"{reason}, and it cannot resume there: {exc}") from None
        except Exception as exc:
            log.warning("failover of %s not submitted: %s", self.job.attempt_id, exc)
            return None
        self.metrics.failovers.inc()
        self.stream.sender = node.node_id
        self.standby = ""  # the next delta picks a standby for the new node
        for old in left:
            # The node it left may live on (cut off, or stalled): it must free the blocks.
            # It hears this once it can; until then its own lease on NATS runs out.
            await self.dispatch.cancel_on(old, self.job.attempt_id, f"failed over: {reason}")
        return path
