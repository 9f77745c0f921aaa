"""Where a prefill node's jobs come from: its own consumer first, then the shared one.

A router steers a job to the prefill node whose pool holds the job's prompt prefix (it then
computes only the rest and loads nothing); such jobs wait on `tandem.prefill.node.<id>`,
which only this node takes. Every other job goes to whichever node of its model asks that
model's shared consumer first. A node asks its own queue first and briefly, so steered
jobs never wait behind the shared queue's long poll, and an idle node still polls both
several times a second.

A busy node (its last fetch brought jobs) first asks the server how many jobs its own queue
holds and pulls from it only if there are any: a pull from an empty queue waits out its
expiry (JetStream ignores `no_wait` on a pull with an expiry), which put OWN_WAIT between
every two batches of a busy node. An idle node pulls its own queue as before: it has time,
and the pull also drains any job a timed-out fetch left in the subscription.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.bus.client import Bus
from shared.bus.messages import NodeInfo
from shared.bus.workqueue import JobConsumer, ReceivedJob

OWN_WAIT = 0.02  # seconds a fetch from the node's own queue waits when it is empty
SHARED_WAIT = 0.2  # and from the shared queue (a steered job may wait this much more)


class JobIntake:
    def __init__(self, bus: Bus, node_id: str, model: str = "") -> None:
        self.own = JobConsumer(bus, node_id)
        self.shared = JobConsumer(bus, model=model)  # its model's queue
        self.busy = False  # the last fetch brought jobs

    async def start(self) -> JobIntake:
        await self.own.start()
        await self.shared.start()
        return self

    async def stop(self) -> None:
        await self.own.stop()
        await self.shared.stop()

    async def fetch(self, batch: int, shared: bool = True) -> list[ReceivedJob]:
        """Up to `batch` jobs: steered ones first, the rest from the shared queue (not
        asked when `shared` is False: a draining node another one relieves)."""
        jobs: list[ReceivedJob] = []
        # backlog None (no answer in time): pull anyway
        if not self.busy or await self.own.backlog() != 0:
            jobs = await self.own.fetch(batch=batch, timeout=OWN_WAIT)
        if len(jobs) < batch and shared:
            wait = OWN_WAIT if jobs else SHARED_WAIT
            jobs += await self.shared.fetch(batch=batch - len(jobs), timeout=wait)
        self.busy = bool(jobs)
        return jobs


async def one_per_request(jobs: list[ReceivedJob]) -> list[ReceivedJob]:
    """One job per request id in a batch: a failover resubmits a request (with the tokens
    delivered so far) that may still be queued; the resumed one wins, the other is ended."""
    kept: dict[str, ReceivedJob] = {}
    for job in jobs:
        other = kept.get(job.job.attempt_id)
        if other is not None:
            if len(job.job.output_ids) < len(other.job.output_ids):
                job, other = other, job
            await other.term()
        kept[job.job.attempt_id] = job
    return list(kept.values())


def others_serve(nodes: Mapping[str, NodeInfo], node_id: str, model: str) -> bool:
    """Whether, by the registry's `nodes`, a prefill node of `model` other than `node_id`
    takes new work (and so the shared queue). None known (the registry unread): no, and a
    draining node serves the shared queue itself."""
    return any(
        n.role == "prefill"
        and n.node_id != node_id
        and not n.draining
        and (not model or n.model in (model, ""))
        for n in nodes.values()
    )
