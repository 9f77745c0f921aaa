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

from collections.abc import Iterable
from dataclasses import dataclass

from services.decode.local_rules import local_prefill_refusal
from shared.costs.model import CostModel
from shared.engine.limits import check_fits, handoff_refusal
from shared.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from shared.engine.sequence import Sequence, SequenceStatus
from shared.errors import CapacityError
from shared.kv.block_pool import BlockPool
from shared.sampling_params import SamplingParams

SIM_TOKEN = 7  # every simulated output token: its value never matters, its count does


@dataclass
class EngineShape(SchedulerConfig):
    """The engine options a node runs with: its scheduler's, and its pool's size in blocks."""

    num_blocks: int = 4096


@dataclass
class SteadyRun:
    """Steady decode steps in a row (`SimEngine.steady_run`) from `start`: the simulator
    applies them to the engine and the records lazily, when cut or at the end."""

    start: float
    batch: list[Sequence]
    steps: list[tuple[float, int]]  # (seconds of each step, steps), in order
    total: int
    applied: int = 0

    def elapsed(self, steps: int) -> float:
        """Seconds from the start to the end of step `steps`."""
        seconds = 0.0
        for each, count in self.steps:
            if steps <= 0:
                break
            seconds += each * min(count, steps)
            steps -= count
        return seconds

    def begun(self, now: float) -> int:
        """Steps a stepwise node has begun by `now` (its tokens are in the batch's
        sequences from a step's start): every step ended by then, and the next."""
        steps, at = 0, self.start
        for each, count in self.steps:
            whole = min(count, int((now - at) / each) if each > 0 else count)
            steps, at = steps + whole, at + each * whole
            if whole < count:
                break
        return min(self.total, steps + 1)

    def gaps(self, first: int, last: int) -> list[tuple[float, int]]:
        """The step durations of steps `first`+1 .. `last` (1-based), as runs."""
        out, seen = [], 0
        for each, count in self.steps:
            lo, hi = max(first, seen), min(last, seen + count)
            if hi > lo:
                out.append((each, hi - lo))
            seen += count
        return out


class CountingPool(BlockPool):
    """A block pool that only counts its free blocks, for engines without prefix caching:
    no block is then ever found by its content, so which ids a sequence holds never
    matters to a decision, only how many are free (and a simulated hour of a cluster
    allocates a few hundred million blocks; tests hold it to the real pool)."""

    def __init__(self, num_blocks: int) -> None:  # not the real pool's per-block state
        if num_blocks <= 0:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.free_count = num_blocks
        self.ref_counts, self.block_hash, self.hash_to_block_id = [], [], {}
        self.on_evict = None

    @property
    def num_free(self) -> int:
        return self.free_count

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.free_count

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.free_count

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise CapacityError(f"need {n} KV blocks, {self.free_count} free")
        self.free_count -= n
        return [0] * n

    def free(self, block_ids: Iterable[int]) -> None:
        self.free_count += len(block_ids if isinstance(block_ids, list) else list(block_ids))


class SimEngine:
    def __init__(self, shape: EngineShape, costs: CostModel, checkpointing: bool = False) -> None:
        self.shape = shape
        self.costs = costs
        # A checkpointing node copies each block it fills out of its pool (between steps):
        # per token computed, a block's copy over its tokens.
        bs = shape.block_size
        self.copy_per_token = costs.kv_copy("checkpoint", bs) / bs if checkpointing else 0.0
        pool = BlockPool if shape.enable_prefix_caching else CountingPool
        self.scheduler = Scheduler(shape, pool(shape.num_blocks), b"sim")

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
        sched = self.scheduler
        need = sched.blocks_for(seq.num_computed)
        waiting, running = sched.num_waiting_midstream, sched.num_running
        if handoff_refusal(sched.pool.num_free, need, waiting, running) is not None:
            return False
        seq.block_ids = self.scheduler.pool.allocate(need)
        self.scheduler.name_blocks(seq)
        self.scheduler.add_running(seq)
        return True

    def check_fits(self, request_id: str, tokens: int) -> None:
        """The node's engine's refusal of a sequence of `tokens` (prompt and max_tokens)
        its pool cannot hold in all (`limits.check_fits`): as a prefill node checks a
        fetched job, and as its engine checks one added."""
        check_fits(request_id, tokens, self.shape.block_size, self.shape.num_blocks)

    def takes_local(self, prompt_tokens: int, draining: bool) -> bool:
        """Whether the node prefills a request the router sent it itself (the node's rule,
        `local_prefill_refusal`); refused, the router sends it the usual way."""
        blocks = self.scheduler.blocks_for(prompt_tokens)
        return local_prefill_refusal(self.scheduler.pool.num_free, blocks, draining) is None

    def begin(self) -> tuple[StepPlan, float, list[Sequence]]:
        """Plan the next step and say how long it takes. As in `Engine.step`, the decodes'
        tokens are appended before the step's prompt chunks are chosen (finished sequences
        free their blocks first); they are returned here and made public at the step's end."""
        plan = self.scheduler.plan_step()
        seconds = 0.0
        decoded: list[Sequence] = []
        if plan.decodes:
            batch = len(plan.decodes)
            context = sum(s.num_tokens for s in plan.decodes) / batch
            seconds += self.costs.decode(batch, context) + self.copy_per_token * batch
            decoded = self._tokens(plan.decodes)
        self.scheduler.plan_chunks(plan)
        if plan.prefills:
            tokens = plan.prefill_tokens
            seconds += self.costs.prefill(tokens) + self.copy_per_token * tokens
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

    def steady_run(self, limit: int) -> tuple[list[Sequence], int, list[tuple[float, int]]] | None:
        """Decode steps the scheduler would plan one by one with nothing to decide
        (`Scheduler.steady_decode_steps`), up to `limit` and to the first sequence's last
        token: the batch, the number of steps and their times (runs of (seconds, steps)).
        None when the next step has something to decide (or only one step would run)."""
        running = self.scheduler.running
        if not running:
            return None
        left = min(s.params.max_tokens - len(s.output_ids) for s in running)
        steps = self.scheduler.steady_decode_steps(min(limit, left))
        if steps < 2:
            return None
        batch = len(running)
        context = sum(s.num_tokens for s in running) / batch
        runs = self.costs.decode_run(batch, context, steps)
        if self.copy_per_token:
            runs = [(seconds + self.copy_per_token * batch, n) for seconds, n in runs]
        return list(running), steps, runs

    def advance(self, batch: list[Sequence], steps: int) -> None:
        """`steps` steps of a steady run: their blocks, then a token each per step (as
        `begin` appends them one step at a time); those reaching max_tokens finish."""
        self.scheduler.allocate_decodes(steps)
        for seq in batch:
            seq.output_ids.extend([SIM_TOKEN] * steps)
            seq.num_computed = seq.num_tokens - 1
            self.scheduler.commit_full_blocks(seq)
            if len(seq.output_ids) >= seq.params.max_tokens:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED

    def release(self, seq: Sequence) -> None:
        """Its KV left for a decode node (prefill node): blocks freed, cached ones kept."""
        self.scheduler.remove(seq)
