"""Continuous-batching scheduler: which sequences run in the next forward, and their KV blocks.

Life cycle of a sequence here: WAITING (queued, FIFO) → admitted into a prefill batch when
its blocks fit → RUNNING (one token per decode step) → FINISHED (blocks freed). When a
decode step needs a block and none is free, the most recently admitted running sequence is
preempted: its blocks are freed (full ones stay findable in the prefix cache) and it goes
back to the head of the queue to be recomputed, so memory stays bounded and nothing is lost.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.sequence import Sequence, SequenceStatus
from shared.kv.block_hash import BlockHash, block_hashes, chain_root
from shared.kv.block_pool import BlockPool


@dataclass
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True
    # Chunked prefill: tokens one step may compute, decodes and a prefill chunk together
    # (0: off, a prompt is prefilled whole before the next decode step).
    step_token_budget: int = 0
    prefill_chunk_tokens: int = 512  # at most this many prompt tokens per step when chunking
    # A burst (more short prompts waiting than streams running) is prefilled whole in one
    # step instead of a chunk per step: the few running streams stall once, not once per
    # prompt (docs/benchmarks-log.md, "Bursts of short prompts").
    prefill_bursts: bool = True


@dataclass
class StepPlan:
    """One engine step: sequences that decode a token, prompts that compute (a chunk of)
    their pending tokens (sequence, tokens this step)."""

    decodes: list[Sequence]
    prefills: list[tuple[Sequence, int]]
    chunked: bool

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)


class Scheduler:
    """Owns the waiting queue, the running batch and block allocation for both."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, hash_extra: bytes) -> None:
        self.config = config
        self.pool = pool
        self.hash_extra = hash_extra
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # admitted, blocks held, prompt partly computed: prefilled a chunk per step
        self.prefilling: list[Sequence] = []
        self.num_preemptions = 0
        # Told of blocks this node filled itself (hashes, block ids), to store them elsewhere.
        self.on_commit: Callable[[Sequence, int, list[BlockHash], list[int]], None] | None = None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def num_running(self) -> int:
        """Sequences holding blocks and a seat: decoding, or prefilling chunk by chunk."""
        return len(self.running) + len(self.prefilling)

    @property
    def num_waiting_midstream(self) -> int:
        """Waiting sequences that have made tokens already: preempted here for KV room (at
        the queue's head), or resumed from elsewhere. A decode node takes no hand-off while
        any wait (shared/engine/limits.handoff_refusal)."""
        return sum(1 for seq in self.waiting if seq.output_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = SequenceStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release_blocks(seq)

    def release_blocks(self, seq: Sequence) -> None:
        self.pool.free(seq.block_ids)
        seq.block_ids = []

    def _prefix_hits(self, seq: Sequence) -> tuple[list[int], list[BlockHash]]:
        """Cached blocks covering the longest prefix of the sequence (leaving ≥1 token pending)."""
        if not self.config.enable_prefix_caching or seq.block_ids:
            return [], []
        if seq.params.prompt_logprobs is not None and not seq.output_ids:
            return [], []  # every prompt position is computed: its logprobs come from there
        hashes = block_hashes(
            seq.all_ids[: seq.num_tokens - 1],
            self.config.block_size,
            self.hash_extra,
            parent=chain_root(seq.params.cache_salt),
        )
        hits = self.pool.cached_prefix(hashes)
        return hits, hashes[: len(hits)]

    def schedule_prefill(self) -> list[Sequence]:
        """Admit waiting sequences, FIFO, while their tokens and blocks fit."""
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.config.max_num_seqs:
            pending = self._admit_head(budget=None if not batch else self._room(tokens))
            if pending is None:
                break
            batch.append(self.waiting.popleft())
            tokens += pending
        for seq in batch:
            seq.status = SequenceStatus.RUNNING
        return batch

    def _room(self, tokens: int) -> int:
        return self.config.max_num_batched_tokens - tokens

    def _admit_head(self, budget: int | None) -> int | None:
        """Give the first waiting sequence its blocks (cached prefix hits shared, the rest
        allocated), if they fit and its pending tokens are within `budget` (None: any);
        returns its pending token count, or None (nothing changed)."""
        seq = self.waiting[0]
        hits, hit_hashes = self._prefix_hits(seq)
        computed = seq.num_computed if seq.block_ids else len(hits) * self.config.block_size
        pending = seq.num_tokens - computed
        if budget is not None and pending > budget:
            return None
        held = len(seq.block_ids) + len(hits)
        need = max(0, self.blocks_for(seq.num_tokens) - held)
        reclaimed = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        if not self.pool.can_allocate(need + reclaimed):
            return None
        self.pool.share(hits)
        seq.block_ids = seq.block_ids + hits + self.pool.allocate(need)
        if hits:
            seq.block_hashes = hit_hashes
            seq.num_computed = computed
            seq.num_cached_tokens = max(seq.num_cached_tokens, computed)
        return pending

    # ---- chunked prefill ------------------------------------------------------------------

    @property
    def chunking(self) -> bool:
        """Whether this step should prefill in chunks beside the running decodes."""
        return self.config.step_token_budget > 0 and bool(self.running or self.prefilling)

    def schedule_chunks(self, budget: int) -> list[tuple[Sequence, int]]:
        """The prompts this step computes a chunk of, and how many tokens each, within
        `budget`: the ones started first (FIFO), then waiting ones admitted while blocks
        and the budget last (an admitted one holds its blocks until it finishes)."""
        chunks: list[tuple[Sequence, int]] = []
        for seq in self.prefilling:
            if budget <= 0:
                return chunks
            n = min(budget, seq.num_pending)
            chunks.append((seq, n))
            budget -= n
        while budget > 0 and self.waiting:
            if len(self.running) + len(self.prefilling) >= self.config.max_num_seqs:
                break
            if self._admit_head(budget=None) is None:
                break
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.prefilling.append(seq)
            n = min(budget, seq.num_pending)
            chunks.append((seq, n))
            budget -= n
        return chunks

    def burst_size(self) -> int:
        """How many short prompts (at most one chunk each) lead the queue, if they are a
        burst: at least two, and no fewer than the streams running; else 0. Chunking a
        burst would stall each running stream once per prompt (and each new stream once
        per prompt after it), prefilling it whole stalls them once, and the prefill
        itself runs as one batch. A long prompt is never part of a burst: it is chunked,
        which is what keeps a long prompt from stalling the streams for its whole prefill."""
        if not self.config.prefill_bursts or self.prefilling:
            return 0
        limit = self.config.prefill_chunk_tokens
        short = 0
        for seq in self.waiting:
            if seq.num_tokens - seq.num_computed > limit:
                break
            short += 1
        return short if short >= max(2, len(self.running)) else 0

    def schedule_burst(self, decodes: int) -> list[tuple[Sequence, int]]:
        """A burst's prompts, admitted and computed whole this step (beside `decodes`
        decode tokens, within the batch token limit and the free blocks), or none."""
        short = self.burst_size()
        prompts: list[tuple[Sequence, int]] = []
        room = self.config.max_num_batched_tokens - decodes
        while len(prompts) < short and self.num_running < self.config.max_num_seqs:
            pending = self._admit_head(budget=room)
            if pending is None:
                break
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.prefilling.append(seq)
            prompts.append((seq, pending))
            room -= pending
        return prompts

    def chunk_size(self, decodes: int) -> int:
        """Prompt tokens this step may compute beside `decodes` decode tokens (at least one
        block, so a long prompt still advances on a full batch)."""
        room = self.config.step_token_budget - decodes
        return max(self.config.block_size, min(self.config.prefill_chunk_tokens, room))

    def prefilled(self, seq: Sequence) -> None:
        """Its last chunk is computed: it decodes from the next step on."""
        self.prefilling.remove(seq)
        self.running.append(seq)

    # ---- one step ---------------------------------------------------------------------------

    def plan_step(self) -> StepPlan:
        """What the next engine step computes, in two parts. Classic schedule: a prefill
        batch if one can be admitted, else a decode step. Chunked (a budget set, sequences
        running): a decode step for every running sequence now, and, once its tokens are
        appended (finished sequences free their blocks and seats), chunks of prompts within
        the budget (`plan_chunks`). The engine runs the plan on the model; `tandem plan
        simulate` runs it on a profile."""
        if self.chunking:
            return StepPlan(self.schedule_decode(), [], chunked=True)
        batch = self.schedule_prefill()
        if batch:
            return StepPlan([], [(s, s.num_pending) for s in batch], chunked=False)
        return StepPlan(self.schedule_decode(), [], chunked=False)

    def plan_chunks(self, plan: StepPlan) -> None:
        """A chunked step's prompt chunks, after its decodes (see `plan_step`): a burst's
        prompts whole if one waits (`schedule_burst`), else chunks within the budget."""
        if plan.chunked:
            decodes = len(plan.decodes)
            plan.prefills = self.schedule_burst(decodes) or self.schedule_chunks(
                self.chunk_size(decodes)
            )

    def prefill_done(self, plan: StepPlan) -> list[int]:
        """After the plan's prefill forward: the indices of `plan.prefills` whose prompt is
        now computed (they sample their first token; they decode from the next step), the
        others advanced by their chunk."""
        done: list[int] = []
        for i, (seq, n) in enumerate(plan.prefills):
            if not plan.chunked:
                self.add_running(seq)
                done.append(i)
            elif n < seq.num_pending:  # more to come: no token yet
                seq.num_computed += n
                self.commit_full_blocks(seq)
            else:
                self.prefilled(seq)
                done.append(i)
        return done

    def schedule_decode(self) -> list[Sequence]:
        """Every running sequence, each with a slot for its next token (preempting if needed)."""
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below to make room for an earlier sequence
            if seq.num_computed // self.config.block_size >= len(seq.block_ids):
                while not self.pool.can_allocate(1) and self._preempt_last(keep=seq):
                    pass
                if not self.pool.can_allocate(1):
                    self._preempt(seq)
                    continue
                seq.block_ids.extend(self.pool.allocate(1))
            scheduled.append(seq)
        # A sequence scheduled early may have been preempted to make room for a later one.
        return [s for s in scheduled if s.status is SequenceStatus.RUNNING]

    def steady_decode_steps(self, limit: int) -> int:
        """How many decode steps in a row (at most `limit`) the running batch can take with
        no decision to make: nothing waits or prefills (no admission, no chunk), and the
        pool holds every block they need (no preemption). `plan_step` would plan each of
        them as a decode of the whole batch; `tandem plan simulate` takes them at once."""
        if self.waiting or self.prefilling or not self.running or limit < 1:
            return 0
        if self.pool.can_allocate(self._decode_blocks(limit)):
            return limit
        lo, hi = 0, limit  # lo steps fit, hi do not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.pool.can_allocate(self._decode_blocks(mid)) else (lo, mid)
        return lo

    def _decode_blocks(self, steps: int) -> int:
        """New blocks the running batch takes over `steps` decode steps."""
        return sum(self._blocks_to_add(s, steps) for s in self.running)

    def _blocks_to_add(self, seq: Sequence, steps: int) -> int:
        """Blocks `seq` lacks for `steps` more decode steps (a step's token goes at position
        num_computed, as `schedule_decode` places it)."""
        last = (seq.num_computed + steps - 1) // self.config.block_size
        return max(0, last + 1 - len(seq.block_ids))

    def allocate_decodes(self, steps: int) -> None:
        """The blocks of `steps` steady decode steps (`steady_decode_steps`), all at once."""
        for seq in self.running:
            if need := self._blocks_to_add(seq, steps):
                seq.block_ids.extend(self.pool.allocate(need))

    def _preempt_last(self, keep: Sequence) -> bool:
        for victim in reversed(self.running):
            if victim is not keep:
                self._preempt(victim)
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release_blocks(seq)
        seq.num_computed = 0
        seq.block_hashes = []
        self.num_preemptions += 1
        self.add(seq, front=True)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Name newly filled blocks by their chained hash so later prefixes can reuse them."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        full = seq.num_computed // bs
        known = len(seq.block_hashes)
        if full <= known:
            return
        ids = seq.all_ids
        parent = seq.block_hashes[-1] if seq.block_hashes else chain_root(seq.params.cache_salt)
        new = block_hashes(ids[known * bs : full * bs], bs, self.hash_extra, parent=parent)
        for i, h in enumerate(new, start=known):
            self.pool.commit_hash(seq.block_ids[i], h)
        seq.block_hashes.extend(new)
        if self.on_commit is not None:
            self.on_commit(seq, known, new, seq.block_ids[known:full])

    def name_blocks(self, seq: Sequence) -> None:
        """Hash the full blocks of a sequence whose KV came from elsewhere (not new work)."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        full = seq.num_computed // bs
        seq.block_hashes = block_hashes(
            seq.all_ids[: full * bs], bs, self.hash_extra, parent=chain_root(seq.params.cache_salt)
        )
        for block_id, h in zip(seq.block_ids, seq.block_hashes, strict=False):
            self.pool.commit_hash(block_id, h)
