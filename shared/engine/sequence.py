"""A sequence's state in an engine, and what of it another engine needs to continue it.

Invariant: `all_ids = prompt_ids + output_ids`; the KV cache holds the first `num_computed`
of them; the rest (at least one token while running) are pending and go into the next
forward, which then samples one new token. A fresh request has its whole prompt pending;
a decode step has exactly one pending token; a sequence imported from another node or
resumed after a failure has whatever its exported KV does not cover.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from shared.engine.detokenize import IncrementalDetokenizer
from shared.engine.types import SequenceState, TokenLogprob
from shared.kv.block_hash import BlockHash
from shared.kv.tail import TailBlock
from shared.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: a sequence is itself, not its field values. The scheduler's `seq in running`
# (every finish, abort and preemption) then compares identities instead of every field
# of every running sequence.
@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    detok: IncrementalDetokenizer | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)  # of its full computed blocks
    tail: TailBlock | None = None  # a resume's stored partial block, placed at admission
    # Entry j: prompt token j+1's logprob (params.prompt_logprobs), filled chunk by chunk
    prompt_logprobs: list[TokenLogprob] | None = None
    guide: Any = None  # its grammar's matcher (shared/engine/guided.py), made on first use

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_pending(self) -> int:
        """len(pending_ids), without copying them (a prompt's are all of it)."""
        return max(0, len(self.prompt_ids) + len(self.output_ids) - self.num_computed)

    @property
    def pending_ids(self) -> list[int]:
        # Sliced without building prompt + output first: decode asks for this every step.
        split = len(self.prompt_ids)
        if self.num_computed >= split:
            return self.output_ids[self.num_computed - split :]
        return self.prompt_ids[self.num_computed :] + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def state(self) -> SequenceState:
        """Its state for another engine (lists copied: this one keeps appending)."""
        return SequenceState(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids),
            output_ids=list(self.output_ids),
            params=self.params,
            num_computed=self.num_computed,
        )
