"""Structured output: tokens constrained by a grammar (`response_format`), with llguidance.

A request's `SamplingParams.guide` is an llguidance grammar (the router compiles it from a
JSON schema, `shared/grammar.py`). At each sampling step, every guided row's logits lose the
tokens the grammar does not allow next (the mask comes from the sequence's matcher); the
sampled token then advances the matcher, and once the grammar is complete (the matcher
stopped) the request ends with finish reason "stop".

The matcher is a function of the tokens generated so far, so it is never sent anywhere: a
sequence that arrives from a prefill node or resumes after a failover gets a new one, fed
its output so far, and constrains its next token exactly as the lost node would have.

Why llguidance: it computes each step's mask lazily from the grammar (no index over the
vocabulary built up front, so a new schema costs ~1 ms, not seconds), it bounds the work a
grammar may take per token (`LLParserLimits`), it needs nothing else (no torch pin, no
compiler); docs/benchmarks-log.md has the per-token overhead. Its `llguidance.torch` helpers
are not used: importing them sets up a `torch.compile` kernel (38 s to compile on first use
here), so the mask is filled through the matcher itself and applied with plain torch ops,
on any device.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

log = logging.getLogger("tandem.engine")

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from shared.engine.sequence import Sequence


class Guides:
    """A node's matchers: the model's tokenizer for llguidance (built on first use, ~1 s),
    one matcher per guided sequence, kept on the sequence."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Iterable[int] = ()) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.failed = 0  # matchers that went into an error state (their requests ended)
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size
                )
            return self._tokenizer

    def matcher(self, seq: Sequence) -> LLMatcher:
        """The sequence's matcher, made (and fed its output so far) on first use."""
        matcher: LLMatcher | None = seq.guide
        if matcher is None:
            from llguidance import LLMatcher

            matcher = LLMatcher(self._llg_tokenizer(), seq.params.guide, log_level=0)
            if seq.output_ids:
                matcher.consume_tokens(list(seq.output_ids))
            seq.guide = matcher
        return matcher

    @torch.inference_mode()
    def constrain(self, logits: torch.Tensor, batch: list[Sequence]) -> None:
        """Rows of guided sequences keep only the tokens their grammar allows next."""
        rows = [i for i, seq in enumerate(batch) if seq.params.guide]
        if not rows:
            return
        words = (self.vocab_size + 31) // 32
        bits = torch.zeros((len(rows), words), dtype=torch.int32)
        for j, i in enumerate(rows):  # llguidance writes row j's bits in place
            row = bits[j]
            matcher = self.matcher(batch[i])
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
            if matcher.is_error():  # past its limits, or fed a token it refused: it allows
                self._fail(batch[i], matcher, row)  # only the end; `advance` ends it
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bits[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, : logits.shape[1]]
        allowed = allowed.to(device=logits.device, dtype=torch.bool)
        if allowed.shape[1] < logits.shape[1]:  # a model head wider than the vocabulary
            pad = logits.shape[1] - allowed.shape[1]
            allowed = torch.nn.functional.pad(allowed, (0, pad), value=False)
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

    def _fail(self, seq: Sequence, matcher: LLMatcher, row: torch.Tensor) -> None:
        self.failed += 1
        log.warning(
            "request %s: its response format failed: %s", seq.request_id, matcher.get_error()
        )
        row.zero_()
        for t in self.eos_ids:
            row[t // 32] |= 1 << (t % 32)

    def advance(self, seq: Sequence, token: int) -> bool:
        """Feed the sampled token; True once the grammar is complete, or failed (the
        request ends either way)."""
        if not seq.params.guide:
            return False
        matcher = self.matcher(seq)
        matcher.consume_token(token)
        return bool(matcher.is_stopped())
