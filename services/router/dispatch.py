"""Sending a request's attempts to nodes, and taking them back.

An attempt goes to the prefill work queue (the usual path), straight to a decode node that
holds its prefix (local prefill: the node answers whether it took it), or back to a decode
node after a failure (resubmit). A cancel reaches every node, or only the one a request
left. Every call here is bounded in time; a node that does not answer is a refusal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from services.router.config import RouterConfig
from services.router.nodes import NodeTable
from services.router.placement import after_local_refusal
from shared.bus.client import Bus
from shared.bus.ids import AttemptId, RequestId
from shared.bus.journal import RequestJournal
from shared.bus.messages import Cancel, NodeInfo, PrefillJob, Reply, encode, read_reply
from shared.bus.topology import REPLY_BY_HEADER, cancel_subject, local_prefill_subject
from shared.bus.tracing import inject_headers
from shared.bus.workqueue import submit_job


class ResumeRefused(Exception):
    """A resumed request that no path takes: its decode node refused it for what it is
    (`Reply.invalid`), or refused it where no prefill queue is there to fall back on."""


log = logging.getLogger("tandem.router")

LOCAL_PREFILL_TIMEOUT = 2.0
REPLY_MARGIN = 0.5  # a decode node's "ok" must reach us before we stop waiting


class Dispatch:
    def __init__(
        self, config: RouterConfig, bus: Bus, nodes: NodeTable, journal: RequestJournal
    ) -> None:
        self.config = config
        self.bus = bus
        self.nodes = nodes
        self.journal = journal

    async def submit(self, job: PrefillJob, prefill_node: str = "") -> None:
        """To the prefill work queue (a steered job: that prefill node's own queue)."""
        await submit_job(self.bus, job, prefill_node=prefill_node)

    async def resubmit(self, node: NodeInfo, job: PrefillJob, blocks: int) -> str:
        """A resumed request (failover, or a stream picked up after a router died): straight
        to the decode node, which loads the checkpointed KV itself and recomputes only the
        tail, no prefill node or transfer in the way; through the prefill queue if it
        refuses. Returns the path taken."""
        answer = await self.ask_local(node, job)
        if answer.accepted:
            return "local"
        if answer.invalid or self.nodes.pool_less(job.model):  # no prefill queue to fall back on
            raise ResumeRefused(answer.reason or "no decode node took it")
        other = after_local_refusal(self.nodes, node, blocks, job.model)
        job = msgspec.structs.replace(job, decode_node=other.node_id)
        await self.submit(job)
        return "remote"

    async def send_local(self, node: NodeInfo, job: PrefillJob) -> bool:
        """Ask a decode node holding the prompt's prefix to prefill the rest itself (the
        plan that chose it counted it as sent: not counted here again); whether it took it."""
        return (await self.ask_local(node, job)).accepted

    async def ask_local(self, node: NodeInfo, job: PrefillJob) -> Reply:
        """`send_local`, with the node's answer: taken, or why not (`invalid`: the request
        itself, not the node's state)."""
        assert self.bus.nc is not None
        # The node answers once the request is queued in its engine, after the step running
        # now. Colocated (or no prefill node up), that step may be a long prefill and there
        # is no other path: wait.
        pool_less = self.nodes.pool_less(job.model)
        timeout = self.config.first_token_timeout if pool_less else LOCAL_PREFILL_TIMEOUT
        # The node admits it only until shortly before we stop waiting: a late "ok" would
        # leave it running there as well as on the path taken instead.
        reply_by = time.time() + timeout - REPLY_MARGIN
        try:
            reply = await self.bus.nc.request(
                local_prefill_subject(node.node_id),
                encode(job),
                timeout=timeout,
                headers=inject_headers({REPLY_BY_HEADER: f"{reply_by:.3f}"}),
            )
        except Exception as exc:  # gone or slow: the disaggregated path still serves it
            log.warning("local prefill on %s failed: %s", node.node_id, exc)
            # Past reply_by it admits nothing; one admitted just before is dropped by this.
            await self.cancel_on(node.node_id, job.attempt_id, "local prefill timed out")
            return Reply(accepted=False, reason=f"local prefill on {node.node_id} failed")
        answer = read_reply(reply.data)
        if not answer.accepted:
            log.info("%s refused local prefill: %s", node.node_id, answer.reason[:200])
        return answer

    async def cancel_on(self, node_id: str, attempt: AttemptId, reason: str) -> None:
        """Only `node_id` drops the request (a path or node it left; the others go on)."""
        cancel = Cancel(attempt_id=attempt, reason=reason, node_id=node_id)
        try:
            await self.bus.publish(cancel_subject(), cancel)
        except Exception as exc:  # best effort: that node's lease frees the blocks anyway
            log.debug("cancel on %s not sent: %s", node_id, exc)

    async def cancel(
        self,
        rid: RequestId,
        attempt: AttemptId,
        reason: str,
        settle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Every node drops the request's current attempt; the journal forgets it (after
        `settle`, which lets a journal write in flight land so it can't re-create the entry)."""
        try:
            await self.bus.publish(cancel_subject(), Cancel(attempt_id=attempt, reason=reason))
            if settle is not None:
                await settle()
            await self.journal.delete(rid, attempt)
        except Exception as exc:  # best effort: nodes also expire work past its deadline
            log.warning("cancel of %s failed: %s", rid, exc)
