"""The prefill side of the simulator (simulator.py): prefill nodes taking jobs from the
shared queue, prefilling them step by step, publishing their first tokens and handing each
one's KV to its decode node, as `services/prefill/` does.

A prefill node takes up to `prefill_max_batch` queued jobs at a time (the shared queue is
FIFO, as JetStream's pull consumer serves it) and prefills them, shortest first, in
engine steps of at most its step tokens (`shared/engine/prefill_steps.py`); as each step
ends it publishes that step's first tokens and ships their KV to their decode nodes (over
one link, a step's transfers after the step before's), while the next step computes; it
takes its next jobs once every hand-off is done, retrying (with the node's backoff) a
decode node that has no room, then any other, as `services/prefill/handoff.py` does. A
hand-off ends when the decode node has imported the KV: on its engine thread, after its
step in progress (and any import queued before it). Its next fetch follows at once
(`services/prefill/intake.py`: a busy node asks how many jobs its own queue holds, an API
round trip, instead of pulling it empty).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from services.prefill.handoff_rules import FIRST_DELAY, next_delay, offer_order
from shared.costs.model import CostModel
from shared.engine.sequence import Sequence, SequenceStatus
from tandem.bench.metrics import RequestRecord
from tandem.plan.simengine import SimEngine
from tandem.plan.simnodes import DecodeNode, Job, PrefillNode
from tandem.plan.topology import Topology

FINISHED = SequenceStatus.FINISHED


class PrefillSide:
    """`Simulation`'s prefill nodes' events (a mixin: the simulation's clock, queue,
    decode nodes and record keeping are its own)."""

    now: float
    topology: Topology
    transfer_costs: CostModel
    queue: deque[Job]
    decoders: dict[str, DecodeNode]
    draining: set[str]  # nodes taking no new work (simscale.py)

    # Simulation's (defined here, not declared under TYPE_CHECKING: mypyc compiles no
    # conditional methods, tandem/plan/compiled.py)
    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        raise NotImplementedError

    def _token(self, record: RequestRecord, seq: Sequence) -> None:
        raise NotImplementedError

    def _fail(self, record: RequestRecord, error: str) -> None:
        raise NotImplementedError

    def _cut(self, node: DecodeNode) -> None:
        raise NotImplementedError

    def _kick(self, node: DecodeNode) -> None:
        raise NotImplementedError

    def retire_if_idle(self, node_id: str) -> None:
        raise NotImplementedError

    def _take_jobs(self, node: PrefillNode) -> None:
        if node.node_id in self.draining:  # fetches nothing more; leaves once empty
            self.retire_if_idle(node.node_id)
            return
        if node.holding or not self.queue:
            return
        count = min(self.topology.prefill_max_batch, len(self.queue))
        jobs = [self.queue.popleft() for _ in range(count)]
        node.holding = len(jobs)
        left = {id(job.seq): job for job in jobs}
        export, transfer = self.transfer_costs.kv_copy, self.transfer_costs.kv_transfer
        clock = link = self.now
        order = sorted(jobs, key=lambda job: job.seq.num_tokens)  # shortest first, as the node
        for seconds, seqs in self._prefill(node.engine, [job.seq for job in order]):
            step = [left.pop(id(seq)) for seq in seqs]
            ship = [j for j in step if j.seq.status is not FINISHED]
            # each one's KV read out into its frame, on the engine thread, before the
            # step's first tokens go out (`prefill_steps`); the next step follows
            clock += seconds + sum(export("export", j.seq.num_computed) for j in ship)
            self.at(clock, self._prefilled, node, step)
            # a step's hand-offs run together on the one link, after the step before's:
            # all of them land when the bytes are through
            link = max(link, clock) + transfer(sum(j.seq.num_computed for j in ship))
            self.at(link, self._hand_offs, node, ship)
        if left:  # never admitted: more KV than this node's pool
            self.at(clock, self._not_admitted, node, list(left.values()))

    def _prefilled(self, node: PrefillNode, jobs: list[Job]) -> None:
        """A step of the batch is done: its first tokens out (one event for the step)."""
        for job in jobs:
            self._token(job.record, job.seq)
            if job.seq.status is FINISHED:  # its first token was its last
                self._handed_off(node)

    def _not_admitted(self, node: PrefillNode, jobs: list[Job]) -> None:
        for job in jobs:
            node.engine.scheduler.remove(job.seq)
            self._job_failed(node, job, "KV blocks exhausted during prefill")

    def _hand_offs(self, node: PrefillNode, jobs: list[Job]) -> None:
        for job in jobs:
            self._hand_off(node, job, FIRST_DELAY)

    @staticmethod
    def _prefill(engine: SimEngine, seqs: list[Sequence]) -> Iterator[tuple[float, list[Sequence]]]:
        """`prefill_steps`: step until every prompt has its first token, each one's blocks
        freed as soon as it has (its KV is exported); per step, (seconds, its prefilled)."""
        for seq in seqs:
            engine.add(seq)
        while engine.scheduler.waiting:
            plan, step, _ = engine.begin()
            if not plan.prefills:
                return
            done = engine.end(plan)
            for seq in done:
                if seq.status is not SequenceStatus.FINISHED:
                    engine.release(seq)
            yield step, done

    def _job_failed(self, node: PrefillNode, job: Job, error: str) -> None:
        self._fail(job.record, error)
        self._handed_off(node)

    def _hand_off(self, node: PrefillNode, job: Job, delay: float) -> None:
        """Offered as the node offers it (`offer_order`); none with room: again later."""
        order = offer_order(
            [d for d in self.decoders.values() if d.node_id not in self.draining],
            job.decode_node,
            name=lambda d: d.node_id,
            free_blocks=lambda d: d.engine.scheduler.pool.num_free,
        )
        for decoder in order:
            self._cut(decoder)
            if decoder.engine.add_prefilled(job.seq):
                # its KV checked and written into the pool on the engine thread (add_snapshot),
                # after the step in progress and the imports queued before it; the prefill
                # node's hand-off ends with the decode node's answer, then
                decoder.stall += decoder.engine.costs.kv_copy("import", job.seq.num_computed)
                accepted = max(self.now, decoder.free_at()) + decoder.stall
                decoder.records[job.seq.request_id] = job.record
                self._kick(decoder)
                self.at(accepted, self._handed_off, node)
                return
        self.at(self.now + delay, self._hand_off, node, job, next_delay(delay))

    def _handed_off(self, node: PrefillNode) -> None:
        node.holding -= 1
        if not node.holding:
            self.at(self.now, self._take_jobs, node)  # its next fetch
