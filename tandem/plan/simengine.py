"""A node's engine in the simulator: the engine's own scheduler and block pool
(shared/engine/scheduler.py, shared/kv/block_pool.py) deciding every step, exactly as on a
node, with the model's forward replaced by the profile's time for it (shared/costs/model.py).

A step is split in two around its duration, as on a node: `begin` plans it and applies
what happens inside it before its prompt forward (admissions, block allocations,
preemptions, the decodes' tokens) and says how long it takes; `end` applies the prompt
forward (first tokens of prompts whose last chunk was computed). The simulator makes all
of the step's tokens public at its end, as a node publishes a step's outputs. Requests
arriving meanwhile wait for the next step, as they do behind a node's engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.bus.params import SamplingParams
from shared.costs.model import CostModel
from shared.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from shared.engine.sequence import Sequence, SequenceStatus
from shared.kv.block_pool import BlockPool

SIM_TOKEN = 7  # every simulated output token: its value never matters, its count does


@dataclass
class EngineShape(SchedulerConfig):
    """The engine options a node runs with: its scheduler's, and its pool's size in blocks."""

    num_blocks: int = 4096


class SimEngine:
    def __init__(self, shape: EngineShape, costs: CostModel) -> None:
        self.shape = shape
        self.costs = costs
        self.scheduler = Scheduler(shape, BlockPool(shape.num_blocks), b"sim")

    @staticmethod
    def new_sequence(request_id: str, prompt_ids: list[int], max_tokens: int) -> Sequence:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return Sequence(request_id, prompt_ids, params, seed=0, arrival=0.0)

    def add(self, seq: Sequence) -> None:
        """A request to prefill here (colocated, or a local prefill)."""
        self.scheduler.add(seq)

    def add_prefilled(self, seq: Sequence) -> bool:
        """A sequence whose prompt KV arrived from a prefill node (`Engine.add_snapshot`):
        False, and nothing changed, when its blocks do not fit now (the node refuses)."""
        need = self.scheduler.blocks_for(seq.num_computed)
        if not self.scheduler.pool.can_allocate(need):
            return False
        seq.block_ids = self.scheduler.pool.allocate(need)
        self.scheduler.name_blocks(seq)
        self.scheduler.add_running(seq)
        return True

    def begin(self) -> tuple[StepPlan, float, list[Sequence]]:
        """Plan the next step and say how long it takes. As in `Engine.step`, the decodes'
        tokens are appended before the step's prompt chunks are chosen (finished sequences
        free their blocks first); they are returned here and made public at the step's end."""
        plan = self.scheduler.plan_step()
        seconds = 0.0
        decoded: list[Sequence] = []
        if plan.decodes:
            context = sum(s.num_tokens for s in plan.decodes) / len(plan.decodes)
            seconds += self.costs.decode(len(plan.decodes), context)
            decoded = self._tokens(plan.decodes)
        self.scheduler.plan_chunks(plan)
        if plan.prefills:
            seconds += self.costs.prefill(plan.prefill_tokens)
        return plan, seconds, decoded

    def end(self, plan: StepPlan) -> list[Sequence]:
        """The step's prefill forward is done: the prompts that got their first token."""
        if not plan.prefills:
            return []
        return self._tokens([plan.prefills[i][0] for i in self.scheduler.prefill_done(plan)])

    def _tokens(self, seqs: list[Sequence]) -> list[Sequence]:
        """A token each (`Engine._after_forward`); finished ones leave the scheduler."""
        out = []
        for seq in seqs:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted meanwhile
            seq.num_computed = seq.num_tokens
            self.scheduler.commit_full_blocks(seq)
            seq.output_ids.append(SIM_TOKEN)
            if len(seq.output_ids) >= seq.params.max_tokens:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED
            out.append(seq)
        return out

    def release(self, seq: Sequence) -> None:
        """Its KV left for a decode node (prefill node): blocks freed, cached ones kept."""
        self.scheduler.remove(seq)
