"""The prefill side of the simulator (simulator.py): prefill nodes taking jobs from the
shared queue, prefilling them step by step, publishing their first tokens and handing each
one's KV to its decode node, as `services/prefill/` does.

A prefill node takes up to `prefill_max_batch` queued jobs at a time (the shared queue is
FIFO, as JetStream's pull consumer serves it) and prefills them, shortest first, in
engine steps of at most its step tokens: the node's own rule, `prefill_steps`
(shared/engine/prefill_steps.py), run on the simulated engine (`SimBatch`); as each step
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
from collections.abc import Callable
from typing import Any

from services.prefill.handoff_rules import FIRST_DELAY, next_delay, offer_order
from shared.costs.model import CostModel
from shared.engine.prefill_steps import PrefillRequest, prefill_steps
from shared.engine.sequence import Sequence, SequenceStatus
from shared.errors import CapacityError
from shared.sampling_params import SamplingParams
from tandem.bench.metrics import RequestRecord
from tandem.plan.simengine import SimEngine
from tandem.plan.simnodes import DecodeNode, Job, PrefillNode
from tandem.plan.topology import Topology

FINISHED = SequenceStatus.FINISHED


class SimBatch:
    """A prefill node's batch on its simulated engine, as `prefill_steps` drives an engine
    (its `BatchEngine`): the jobs' sequences are added as they are, a step is planned and
    timed (`seconds`), and "exporting" a prompt's KV hands back its sequence."""

    def __init__(self, engine: SimEngine, seqs: dict[str, Sequence]) -> None:
        self.engine = engine
        self.seqs = seqs
        self.pending: dict[str, Sequence] = {}  # added, no first token yet
        self.seconds = 0.0  # the latest step's

    def has_unfinished(self) -> bool:
        return self.engine.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        output_ids: list[int] | None = None,
    ) -> str:
        assert request_id is not None
        self.engine.check_fits(request_id, len(prompt_ids) + params.max_tokens)
        seq = self.seqs[request_id]
        self.pending[request_id] = seq
        self.engine.add(seq)
        return request_id

    def step(self) -> list[Sequence]:
        plan, self.seconds, _ = self.engine.begin()
        done = self.engine.end(plan)
        for seq in done:
            del self.pending[seq.request_id]
        return done

    def export(self, request_id: str) -> tuple[Sequence, None]:
        return self.seqs[request_id], None

    def abort(self, request_id: str) -> bool:
        self.engine.release(self.seqs[request_id])  # its KV left for a decode node
        return True

    def cancel_all(self) -> None:
        for seq in self.pending.values():
            self.engine.scheduler.remove(seq)
        self.pending.clear()


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
        fetched = [self.queue.popleft() for _ in range(count)]
        jobs = [job for job in fetched if self._fits(node, job)]
        if not jobs:  # each failed alone: the next fetch
            self.at(self.now, self._take_jobs, node)
            return
        node.holding = node.batch = len(jobs)
        left = {job.seq.request_id: job for job in jobs}
        export, transfer = self.transfer_costs.kv_copy, self.transfer_costs.kv_transfer
        clock = link = self.now
        batch = SimBatch(node.engine, {rid: job.seq for rid, job in left.items()})
        requests: list[PrefillRequest] = [
            (job.seq.request_id, job.seq.prompt_ids, job.seq.params) for job in jobs
        ]
        resumed = {job.seq.request_id: job.seq.output_ids for job in jobs if job.seq.output_ids}
        try:
            for outs in prefill_steps(batch, requests, resumed):
                step = [left.pop(seq.request_id) for seq, _, _ in outs]
                ship = [j for j in step if j.seq.status is not FINISHED]
                # each one's KV read out into its frame, on the engine thread, before the
                # step's first tokens go out (`prefill_steps`); the next step follows
                clock += batch.seconds + sum(export("export", j.seq.num_computed) for j in ship)
                self.at(clock, self._prefilled, node, step)
                # a step's hand-offs run together on the one link, after the step before's:
                # all of them land when the bytes are through
                link = max(link, clock) + transfer(sum(j.seq.num_computed for j in ship))
                self.at(link, self._hand_offs, node, ship)
        except CapacityError:  # never admitted: more KV than this node's pool
            self.at(clock, self._not_admitted, node, list(left.values()))

    def _fits(self, node: PrefillNode, job: Job) -> bool:
        """Checked alone before its batch, as the node checks each job it fetched (the
        engine's limits): one its pool cannot hold in all fails by itself, not the batch it
        would have joined."""
        seq = job.seq
        try:
            node.engine.check_fits(seq.request_id, len(seq.prompt_ids) + seq.params.max_tokens)
        except CapacityError as exc:
            self._fail(job.record, exc.message)
            return False
        return True

    def _prefilled(self, node: PrefillNode, jobs: list[Job]) -> None:
        """A step of the batch is done: its first tokens out (one event for the step)."""
        for job in jobs:
            self._token(job.record, job.seq)
            if job.seq.status is FINISHED:  # its first token was its last
                self._handed_off(node)

    def _not_admitted(self, node: PrefillNode, jobs: list[Job]) -> None:
        for job in jobs:  # out of its engine already (`prefill_steps` cancels what is left)
            self._job_failed(node, job, "KV blocks exhausted during prefill")

    def _hand_offs(self, node: PrefillNode, jobs: list[Job]) -> None:
        for job in jobs:
            self._hand_off(node, job, FIRST_DELAY)

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
            node.batch = 0
            self.at(self.now, self._take_jobs, node)  # its next fetch
