"""The engine: one model, one paged KV cache, continuous batching over many sequences.

`step()` runs one forward: a prefill batch when sequences are waiting and fit, otherwise one
decode step for every running sequence (the colocated schedule: prefill first, as classic
monolithic servers do). The same engine serves each role of the disaggregated stack:
`prefill_steps.py` for a prefill node (prefill, sample the first token, hand the KV out as
bytes, free the blocks) and `add_snapshot` + `step` for a decode node (import the KV, join
the running batch).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from shared.engine.block_exchange import BlockExchange
from shared.engine.detokenize import IncrementalDetokenizer
from shared.engine.guided import Guides
from shared.engine.limits import RequestLimits
from shared.engine.logits import process_batch
from shared.engine.logprobs import (
    chosen_logprobs,
    fill_prompt_logprobs,
    model_logprobs,
    wants_prompt_logprobs,
)
from shared.engine.sampling import sample
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.engine.sequence import Sequence, SequenceStatus
from shared.engine.stopping import stop_reason
from shared.engine.tail_exchange import TailExchange
from shared.engine.types import EngineStats, SequenceState, StepOutput, TokenLogprob
from shared.errors import CapacityError, WireFormatError
from shared.kv.block_pool import BlockPool
from shared.kv.export import decode_kv, new_frame
from shared.kv.paged_cache import PagedKVCache
from shared.kv.shared_pool import KVBudget, SharedBlockPool
from shared.kv.tail import TailBlock
from shared.model.loader import LoadedModel
from shared.model.runner import ModelRunner, PackedItem, kv_layout
from shared.sampling_params import SamplingParams, seeded

_DETOK_CONTEXT = 4  # prompt tokens given to the detokenizer for the first word's spacing


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # default: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True
    detokenize: bool = True
    # Chunked prefill (scheduler.py): 0 prefills a prompt whole before the next decode step
    step_token_budget: int = 0
    prefill_chunk_tokens: int = 512
    prefill_bursts: bool = True  # a burst of short prompts prefilled whole (scheduler.py)


class Engine:
    """Owns the model runner, KV cache, block pool and scheduler, and the parts that move
    blocks (`exchange`) and tails (`tails`) in and out of the pool."""

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig | None = None,
        budget: KVBudget | None = None,
    ) -> None:
        """`budget`: the node's KV memory, shared with other models' engines (CPU only;
        shared/kv/shared_pool.py); else the pool is `config`'s, its own."""
        self.model = model
        self.config = config or EngineConfig()
        self.layout = kv_layout(model, self.config.block_size)
        self.pool: BlockPool
        if budget is not None:
            pool = SharedBlockPool(budget, self.layout.bytes_per_block)
            num_blocks = pool.num_blocks
            self.cache = PagedKVCache(self.layout, num_blocks, model.device, lazy=True)
            pool.on_release = self.cache.release_block
            self.pool = pool
        else:
            num_blocks = self.config.num_blocks or max(
                1, self.config.kv_cache_bytes // self.layout.bytes_per_block
            )
            self.pool = BlockPool(num_blocks)
            self.cache = PagedKVCache(self.layout, num_blocks, model.device)
        self.runner = ModelRunner(model, self.cache)
        hash_extra = f"{model.served_name}/{self.layout.dtype}".encode()
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=self.config.block_size,
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                enable_prefix_caching=self.config.enable_prefix_caching,
                step_token_budget=self.config.step_token_budget,
                prefill_chunk_tokens=self.config.prefill_chunk_tokens,
                prefill_bursts=self.config.prefill_bursts,
            ),
            self.pool,
            hash_extra,
        )
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.hash_extra = hash_extra
        self.exchange = BlockExchange(self.layout, self.pool, self.cache, hash_extra)
        self.scheduler.on_commit = self.exchange.on_commit
        self.tails = TailExchange(self.layout, self.cache, self.scheduler, hash_extra)
        self.vocab_size = int(model.config.vocab_size)
        vocab = int(model.hf_model.config.vocab_size)
        self.guides = Guides(model.tokenizer, vocab, model.eos_token_ids)
        self.limits = RequestLimits(
            model.max_model_len, self.vocab_size, self.config.block_size, num_blocks
        )
        self._ids = itertools.count()

    # ---- what it is (shared/engine/interface.py) --------------------------------------------

    kind = "native"

    @property
    def served_name(self) -> str:
        return self.model.served_name

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def hash_key(self) -> str:
        return self.hash_extra.decode()

    def blocks_for(self, num_tokens: int) -> int:
        return self.scheduler.blocks_for(num_tokens)

    def running_tokens(self) -> dict[str, int]:
        try:
            running = list(self.requests.values())
        except RuntimeError:  # the engine thread changed the table mid-copy: a scrape lost
            return {}
        return {s.request_id: s.num_tokens for s in running if s.status is SequenceStatus.RUNNING}

    # ---- admission -------------------------------------------------------------------------

    def serves(self, model: str) -> bool:
        """Whether work named for `model` is this engine's ("": a message of before
        several models, meant for the cluster's one model)."""
        return model in ("", self.model.served_name)

    def validate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        output_ids: list[int] | None = None,
    ) -> None:
        """Raise InvalidRequestError (or CapacityError) without touching any state.

        `output_ids`: tokens generated before (a resumed or imported sequence).
        """
        self.limits.check(request_id, prompt_ids, params, output_ids, known=self.requests)

    def _new_sequence(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        output_ids: list[int] | None = None,
    ) -> Sequence:
        """A sequence; `output_ids` were generated (and streamed) before, elsewhere."""
        seq = Sequence(request_id, list(prompt_ids), params, seed, list(output_ids or []))
        if self.config.detokenize or params.stop:
            seq.detok = IncrementalDetokenizer(
                self.model.tokenizer, prompt_ids[-_DETOK_CONTEXT:], params.stop
            )
            for tok in seq.output_ids:
                seq.detok.add(tok)
            seq.detok.emitted = len(seq.detok.text)  # the client has that text already
        return seq

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        output_ids: list[int] | None = None,
        tail: TailBlock | None = None,
    ) -> str:
        """Queue a request for prefill; returns its id. Invalid input raises and changes nothing.

        `output_ids`: tokens a failed node already generated (and the client received); the
        sequence resumes after them, sampling exactly what it would have sampled next.
        `tail`: the failed node's partial last block, as `tails.fit` cut it for this context;
        used if the prefix found at admission reaches its start.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        self.validate(request_id, prompt_ids, params, output_ids)
        if tail is not None:
            context = prompt_ids + (output_ids or [])
            if self.tails.fit(tail, context, params.cache_salt) != tail:
                raise WireFormatError(
                    "the KV tail does not fit this context", request_id=request_id
                )
        params = seeded(params)
        seq = self._new_sequence(request_id, prompt_ids, params, params.seed or 0, output_ids)
        seq.tail = tail
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def add_snapshot(self, snapshot: SequenceState, kv_frame: bytes | memoryview) -> str:
        """Continue a sequence computed elsewhere: import its KV, then join the batch (a
        writable frame, as received, is copied once: into the pool)."""
        header, blocks = decode_kv(kv_frame)
        if header.layout() != self.layout:
            raise WireFormatError(
                f"KV layout {header.layout()} does not match this node's {self.layout}",
                request_id=snapshot.request_id,
            )
        if header.first_block != 0 or header.num_tokens != snapshot.num_computed:
            raise WireFormatError(
                "KV export must cover the sequence from its first block up to num_computed",
                request_id=snapshot.request_id,
            )
        if self.scheduler.blocks_for(snapshot.num_computed) != header.num_blocks:
            raise WireFormatError(
                "KV export block count does not match its token count",
                request_id=snapshot.request_id,
            )
        total = len(snapshot.prompt_ids) + len(snapshot.output_ids)
        if not total - snapshot.num_computed > 0:
            raise WireFormatError("snapshot has no pending token", request_id=snapshot.request_id)
        self.validate(
            snapshot.request_id, snapshot.prompt_ids, snapshot.params, snapshot.output_ids
        )
        if not self.pool.can_allocate(header.num_blocks):
            raise CapacityError(
                f"no room for {header.num_blocks} KV blocks ({self.pool.num_free} free)",
                request_id=snapshot.request_id,
            )
        block_ids = self.pool.allocate(header.num_blocks)
        self.cache.write_blocks(block_ids, blocks)
        params = seeded(snapshot.params)  # fixed where it was added: kept
        seq = self._new_sequence(
            snapshot.request_id, snapshot.prompt_ids, params, params.seed or 0, snapshot.output_ids
        )
        seq.block_ids = block_ids
        seq.num_computed = snapshot.num_computed
        self.scheduler.name_blocks(seq)  # findable for later prefixes; not filled here
        self.exchange.named(seq.block_hashes)
        self.requests[seq.request_id] = seq
        if len(seq.pending_ids) == 1:
            self.scheduler.add_running(seq)
        else:
            self.scheduler.add(seq, front=True)
        return seq.request_id

    def export(self, request_id: str) -> tuple[SequenceState, memoryview]:
        """Snapshot and KV frame of a sequence (its blocks stay allocated); the blocks
        are copied once, straight into the frame."""
        seq = self.requests[request_id]
        nblocks = self.scheduler.blocks_for(seq.num_computed)
        frame, payload = new_frame(self.layout, nblocks, seq.num_computed)
        self.cache.read_blocks(seq.block_ids[:nblocks], out=payload)
        return seq.state(), frame

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its blocks are freed. False if unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        self.exchange.sequence_ended(seq, finished=False)
        self.tails.forget(seq.request_id)
        return True

    # ---- execution -------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_waiting_midstream(self) -> int:
        return self.scheduler.num_waiting_midstream

    def step(self) -> list[StepOutput]:
        """One step as the scheduler plans it (`Scheduler.plan_step`): a prefill batch or a
        decode step (the classic schedule), or, with chunked prefill and sequences running,
        a decode step and chunks of prompts. A chunk that ends its prompt samples the first
        token, so a long prompt no longer stalls the running streams for its whole prefill;
        greedy output is unchanged: a chunk attends over the KV of the chunks before it
        exactly as a prompt attends over a cached prefix."""
        plan = self.scheduler.plan_step()
        outputs = self._decode(plan.decodes) if plan.decodes else []
        self.scheduler.plan_chunks(plan)
        if not plan.prefills:
            return outputs
        for seq, _ in plan.prefills:
            if seq.tail is not None:  # a resume's stored tail, placed once at admission
                self.tails.place(seq)
        items = [
            PackedItem(s.pending_ids[:n], s.num_computed, s.block_ids) for s, n in plan.prefills
        ]
        if any(wants_prompt_logprobs(s) for s, _ in plan.prefills):
            logits, hidden = self.runner.forward_packed_hidden(items)
            fill_prompt_logprobs(plan.prefills, hidden, self.runner.logits_of)
        else:
            logits = self.runner.forward_packed(items)
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += plan.prefill_tokens
        if plan.chunked:
            self.stats.chunked_steps += 1
        else:
            self.stats.steps += 1
            self.stats.last_batch_size = len(plan.prefills)
        done = self.scheduler.prefill_done(plan)
        if not done:
            return outputs
        return outputs + self._after_forward([plan.prefills[i][0] for i in done], logits[done])

    def _decode(self, batch: list[Sequence]) -> list[StepOutput]:
        logits = self.runner.forward_decode(
            [s.last_token for s in batch],
            [s.num_tokens - 1 for s in batch],
            [s.block_ids for s in batch],
        )
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(batch)
        self.stats.steps += 1
        self.stats.last_batch_size = len(batch)
        return self._after_forward(batch, logits)

    def _after_forward(self, batch: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        rows, raw = model_logprobs(logits, batch)  # before processing changes the logits
        process_batch(logits, batch, self.model.eos_token_ids)
        self.guides.constrain(logits, batch)
        positions = [s.num_tokens for s in batch]
        tokens = sample(logits, [s.params for s in batch], [s.seed for s in batch], positions)
        logprobs = chosen_logprobs(rows, raw, batch, tokens)
        outputs = []
        for seq, tok, lp in zip(batch, tokens, logprobs, strict=True):
            seq.num_computed = seq.num_tokens
            self.scheduler.commit_full_blocks(seq)
            outputs.append(self._append_token(seq, tok, lp))
        return outputs

    def _append_token(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> StepOutput:
        seq.output_ids.append(tok)
        reason = stop_reason(seq, tok, self.model.eos_token_ids, self.guides, self.max_model_len)
        text = seq.detok.delta(final=reason is not None) if seq.detok is not None else ""
        prompt_lps, seq.prompt_logprobs = seq.prompt_logprobs, None  # out with the first token
        if reason is not None:
            self._finish(seq, reason)
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=[tok],
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=None if lp is None else [lp],
            prompt_logprobs=prompt_lps,
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.requests.pop(seq.request_id, None)
        self.stats.cached_prompt_tokens += seq.num_cached_tokens
        self.exchange.sequence_ended(seq, finished=True)
        self.tails.forget(seq.request_id)

    # ---- roles -----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (a convenience for tools and tests)."""
        ids = [self.add_request(p, params) for p in prompts]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                outputs[out.request_id].extend(out.new_token_ids)
        return [outputs[i] for i in ids]

    def cancel_all(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)
